"""Which logged curve is a run's test accuracy and which its validation accuracy: the one rule report, plot and
selection read by.

A run with a validation split (``data.val_fraction > 0`` in its ``config.yaml``: a fraction of each training
client's samples held out and pooled) logs ``val/acc`` and ``val/acc_ema`` on that validation set and
``test/acc``, ``test/acc_ema`` on the test set. A run without one (``val_fraction`` absent or 0, every run made
before the split existed) logs only ``val/acc`` and ``val/acc_ema``, and they are the test accuracy, as the
paper reports it. So a run's test accuracy is ``test/acc*`` where logged, else ``val/acc*``; it has a
validation accuracy only when it logged ``test/acc`` (``with_test_tags``, ``validation_curve``).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

from fedrcl.analysis.runs import Curve
from fedrcl.analysis.settings import init_args

__all__ = ["ACCURACY_KINDS", "has_validation_split", "logged_validation", "with_test_tags", "tag_of_test",
           "val_fraction", "validation_curve"]

ACCURACY_KINDS = ("acc", "acc_ema")
"""Raw and EMA (0.9, the paper's table metric), the two accuracies evaluated each round."""


def logged_validation(curves: Mapping[str, Curve]) -> bool:
    """Whether a run's logged curves hold a validation accuracy apart from the test accuracy (it logged
    ``test/acc`` or ``test/acc_ema``; then its ``val/acc*`` are the validation set's)."""
    return any(f"test/{kind}" in curves for kind in ACCURACY_KINDS)


def tag_of_test(curves: Mapping[str, Curve], kind: str = "acc_ema") -> str:
    """The tag a run logged its test accuracy under: ``test/<kind>`` for a run with a validation split, else
    ``val/<kind>`` (the test accuracy of a run without one).

    Args:
        curves: the run's logged curves (``RunResult.curves``, ``load_scalars``).
        kind: ``"acc"`` (raw) or ``"acc_ema"``.
    """
    if kind not in ACCURACY_KINDS:
        raise ValueError(f"kind must be one of {', '.join(ACCURACY_KINDS)}, got {kind!r}")
    return f"test/{kind}" if logged_validation(curves) else f"val/{kind}"


def validation_curve(curves: Mapping[str, Curve], kind: str = "acc_ema") -> Optional[Curve]:
    """A run's validation accuracy (``val/<kind>`` of a run that logged ``test/acc``), ``None`` for a run
    without a validation split (its ``val/<kind>`` is the test accuracy)."""
    if kind not in ACCURACY_KINDS:
        raise ValueError(f"kind must be one of {', '.join(ACCURACY_KINDS)}, got {kind!r}")
    return curves.get(f"val/{kind}") if logged_validation(curves) else None


def with_test_tags(curves: Mapping[str, Curve]) -> dict[str, Curve]:
    """The logged curves with the test accuracy also under ``test/acc`` and ``test/acc_ema`` for a run without a
    validation split (copied from its ``val/acc*``, which stay as logged); a run with one is returned as logged.
    Read ``test/...`` from the result to get every run's test accuracy; decide ``logged_validation`` on the
    logged curves, not on this result."""
    if logged_validation(curves):
        return dict(curves)
    return {**curves, **{f"test/{kind}": curves[f"val/{kind}"] for kind in ACCURACY_KINDS if f"val/{kind}" in curves}}


def val_fraction(config: Mapping[str, Any]) -> float:
    """``data.val_fraction`` of a saved config (``data`` plain or a ``class_path`` spec), 0 when absent."""
    data = config.get("data") or {}
    if isinstance(data, Mapping) and "class_path" in data:
        data = init_args(data)
    value = data.get("val_fraction") if isinstance(data, Mapping) else None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def has_validation_split(config: Mapping[str, Any], curves: Mapping[str, Curve]) -> bool:
    """Whether a run held out a validation split: ``data.val_fraction > 0`` in its config, or ``test/acc``
    logged (the two go together for a run of ``fedrcl fit``)."""
    return val_fraction(config) > 0 or logged_validation(curves)
