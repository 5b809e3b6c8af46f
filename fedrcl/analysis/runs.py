"""Reading runs back from their TensorBoard logs (for notebooks and reports).

A run is a folder ``<save_dir>/<name>`` written by Lightning's TensorBoardLogger, with one ``version_k``
sub-folder per start; a run resumed with ``--ckpt_path last`` continues in a new version. A run's curve
is the union of its versions' points, a later version's point replacing an earlier one at the same round.
``fedrcl validate`` / ``test`` log beside them in ``<subcommand>_k`` folders, which are not versions: they
never enter a run's curves.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Optional

import numpy as np
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

__all__ = ["Curve", "find_runs", "load_scalars"]

Curve = tuple[np.ndarray, np.ndarray]
"""``(rounds, values)``: int64 and float64 arrays, rounds ascending."""


def _version_number(path: Path) -> int:
    suffix = path.name.removeprefix("version_")
    return int(suffix) if suffix.isdigit() else -1


def find_runs(root: str | Path, names: Optional[Sequence[str]] = None) -> dict[str, Path]:
    """The runs under ``root`` (a logger's ``save_dir``): ``{name: folder}``, sorted by name.

    Args:
        root: the folder holding one sub-folder per run name.
        names: keep only these runs, in this order; a missing one is an error naming what exists.
    """
    root = Path(root)
    found = {p.name: p for p in sorted(root.iterdir()) if p.is_dir() and any(p.glob("version_*/events.*"))} \
        if root.is_dir() else {}
    if names is None:
        return found
    missing = [n for n in names if n not in found]
    if missing:
        raise ValueError(f"no TensorBoard run named {', '.join(missing)} under {root}; found: "
                         f"{', '.join(found) or 'none'}")
    return {n: found[n] for n in names}


def load_scalars(run: str | Path) -> dict[str, Curve]:
    """Every scalar tag of a run (all its versions merged): ``{tag: (rounds, values)}``.

    Args:
        run: a run folder (holding ``version_*``) or a single version folder.
    """
    run = Path(run)
    versions = sorted(run.glob("version_*"), key=_version_number) or [run]
    points: dict[str, dict[int, float]] = {}
    for version in versions:
        acc = EventAccumulator(str(version), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            points.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})
    curves: dict[str, Curve] = {}
    for tag, by_step in sorted(points.items()):
        steps = np.array(sorted(by_step), dtype=np.int64)
        curves[tag] = steps, np.array([by_step[s] for s in steps], dtype=np.float64)
    return curves
