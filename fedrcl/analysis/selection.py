"""Each method's setting chosen on its validation accuracy, never on its test accuracy.

A sweep (``fedrcl sweep``) trains each method under several settings (configs that differ in swept keys, a
learning rate, a loss weight), each under several seeds. Choosing the setting with the best test accuracy and
then reporting that test accuracy tunes on the test set: the winner's number is biased upwards, the more so the
more settings were tried. ``choose_setting`` is handed only validation curves (``fedrcl.analysis.tags``) and
picks the setting with the best mean over its seeds at one round; the test accuracy of the chosen setting is
read afterwards, by the caller.

``select_on_validation`` does it per method (the client algorithm's class, and the server optimizer where it
is not FedAvg's) over the seed groups of ``fedrcl.analysis.grouping``, and says what was searched
(``searched``: the config keys whose values differ between a method's settings) and what it cost
(``MethodSelection.budget``: runs x rounds up to the selection round), so that unequal tuning budgets are seen.
"""
from __future__ import annotations

import json
import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from fedrcl.analysis.catalogue import RunResult
from fedrcl.analysis.grouping import seed_groups
from fedrcl.analysis.runs import Curve
from fedrcl.analysis.seed_stats import align, value_at
from fedrcl.analysis.settings import experiment_key
from fedrcl.analysis.tags import has_validation_split, val_fraction, validation_curve

__all__ = ["BENCHMARK_KEYS", "Choice", "MethodSelection", "choose_setting", "method_label", "searched",
           "select_on_validation", "selection_round"]

BENCHMARK_KEYS = ("dataset", "partition", "alpha", "shards_per_client", "num_clients", "partition_file")
"""The ``run_setting`` facts all runs of one selection share: one data set and split, the methods' common
ground."""


@dataclass(frozen=True)
class Choice:
    """The setting chosen: its key, the round it was chosen at, every scored setting's mean validation accuracy
    there, and the settings left out because not all their runs logged that round."""

    best: Hashable
    round_idx: int
    scores: dict[Hashable, float]
    left_out: tuple[Hashable, ...] = ()


def selection_round(validation: Mapping[Hashable, Sequence[Curve]]) -> Optional[int]:
    """The last round every curve of every setting logged (``None`` when they share none)."""
    curves = [curve for seeds in validation.values() for curve in seeds]
    if not curves:
        return None
    common, _ = align(curves)
    return int(common[-1]) if len(common) else None


def choose_setting(validation: Mapping[Hashable, Sequence[Curve]], round_idx: Optional[int] = None) -> Choice:
    """The setting whose seeds' mean validation accuracy at ``round_idx`` is highest.

    Args:
        validation: ``{setting: [validation curve of each of its seeds]}``, in the order the settings are
            listed; nothing else (no test accuracy) is handed in.
        round_idx: the round compared (default: ``selection_round``, the last round all curves logged). A
            setting whose curves did not all log it is left out; a NaN mean (a diverged seed) never wins.
            Of equal means the first listed wins.
    """
    at = selection_round(validation) if round_idx is None else round_idx
    if at is None:
        raise ValueError("no round all the settings' validation curves logged")
    scores: dict[Hashable, float] = {}
    left_out = []
    for key, seeds in validation.items():
        values = [value_at(curve, at) for curve in seeds]
        logged = [v for v in values if v is not None]
        if not seeds or len(logged) < len(values):
            left_out.append(key)
            continue
        scores[key] = float(np.mean(logged))
    ranked = [key for key, score in scores.items() if not math.isnan(score)]
    if not ranked:
        raise ValueError(f"no setting has a validation accuracy of all its seeds at round {at}")
    best = ranked[0]
    for key in ranked[1:]:
        if scores[key] > scores[best]:
            best = key
    return Choice(best, at, scores, tuple(left_out))


def method_label(setting: Mapping[str, Any]) -> str:
    """A method as a selection names it: the client algorithm's class, ``server + method`` where the server
    optimizer is not FedAvg's."""
    method, server = setting["method"], setting["server"]
    return str(method) if server in ("FedAvg", method) else f"{server} + {method}"


def _flat(node: Any, prefix: str = "") -> dict[str, Any]:
    """A nested config as ``{dotted key: leaf value}``."""
    if not isinstance(node, dict) or not node:
        return {prefix: node}
    out: dict[str, Any] = {}
    for key, value in node.items():
        out.update(_flat(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def searched(groups: Sequence[Sequence[RunResult]]) -> dict[str, list[Any]]:
    """``{dotted config key: [its value in each group]}`` for the keys whose values differ between the seed
    groups (what was searched; seeds and ``EXPERIMENT_IGNORES`` set aside, a key a group lacks is ``None``)."""
    flats = [_flat(json.loads(experiment_key(group[0].config))) for group in groups]
    keys = sorted({key for flat in flats for key in flat})
    return {key: [flat.get(key) for flat in flats] for key in keys
            if len({json.dumps(flat.get(key), sort_keys=True, default=str) for flat in flats}) > 1}


@dataclass
class MethodSelection:
    """One method's settings (seed groups), what differs between them, and the one chosen on validation."""

    method: str
    settings: list[list[RunResult]]
    searched: dict[str, list[Any]]
    choice: Choice
    best: int
    """The chosen setting's index in ``settings``."""

    @property
    def chosen(self) -> list[RunResult]:
        """The chosen setting's runs (its seeds)."""
        return self.settings[self.best]

    @property
    def scored(self) -> list[list[RunResult]]:
        """The settings scored at the selection round (all their runs logged it)."""
        return [group for i, group in enumerate(self.settings) if i in self.choice.scores]

    @property
    def budget(self) -> int:
        """The run-rounds spent on the scored settings up to the selection round (settings x seeds x rounds)."""
        return sum(len(group) for group in self.scored) * self.choice.round_idx

    def chosen_values(self) -> dict[str, Any]:
        """``{searched key: the chosen setting's value}``."""
        return {key: values[self.best] for key, values in self.searched.items()}


def _refuse_without_validation(runs: Sequence[RunResult]) -> None:
    """A run without a validation split is refused in one line: selecting on its ``val/acc*`` (test accuracy)
    would tune on the test set."""
    for run in runs:
        if not has_validation_split(run.config, run.curves):
            raise ValueError(
                f"{run.path}: data.val_fraction is {val_fraction(run.config):g}, so the run has no validation "
                "split and its val/acc is the test accuracy; selecting on it would tune on the test set (train "
                "with data.val_fraction > 0, or report without --select)")


def _one_benchmark(runs: Sequence[RunResult]) -> None:
    """Refuses runs of several data sets or splits in one selection, naming the facts that differ."""
    differ = [key for key in BENCHMARK_KEYS if len({repr(run.setting.get(key)) for run in runs}) > 1]
    if differ:
        values = "; ".join(f"{key}: {', '.join(sorted({str(run.setting.get(key)) for run in runs}))}"
                           for key in differ)
        raise ValueError(f"runs of several benchmarks ({values}); select on one data set and split at a time "
                         "(give RUNS of one)")


def select_on_validation(runs: Sequence[RunResult], kind: str = "acc_ema",
                         round_idx: Optional[int] = None) -> list[MethodSelection]:
    """Per method (``method_label``, in the order of the runs), its setting with the best mean validation
    accuracy over seeds (``choose_setting`` on ``validation_curve(run.curves, kind)``) at ``round_idx``
    (default: the last round all the method's runs logged, so its settings are compared at one budget).

    Raises ``ValueError`` in one line for a run without a validation split (naming its folder and
    ``data.val_fraction``), for runs of several benchmarks (``BENCHMARK_KEYS``), or for a method none of whose
    settings logged a validation accuracy at the round.
    """
    _refuse_without_validation(runs)
    _one_benchmark(runs)
    by_method: dict[str, list[list[RunResult]]] = {}
    for group in seed_groups(runs):
        by_method.setdefault(method_label(group[0].setting), []).append(group)
    selections = []
    for method, groups in by_method.items():
        validation: dict[Hashable, list[Curve]] = {}
        for i, group in enumerate(groups):
            curves = [validation_curve(run.curves, kind) for run in group]
            validation[i] = [curve for curve in curves if curve is not None] if all(
                curve is not None for curve in curves) else []
        try:
            choice = choose_setting(validation, round_idx)
        except ValueError as error:
            raise ValueError(f"{method}: {error} (val/{kind})") from None
        best = list(validation).index(choice.best)
        selections.append(MethodSelection(method, groups, searched(groups), choice, best))
    return selections
