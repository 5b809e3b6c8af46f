"""Reading runs back from their logs (for notebooks, ``fedrcl report`` and ``fedrcl plot``).

A run is a folder ``<save_dir>/<name>`` written by Lightning's TensorBoardLogger (event files) or CSVLogger
(``metrics.csv``), with one ``version_k`` sub-folder per start; a run resumed with ``--ckpt_path last``
continues in a new version. Both loggers get the round as their step, so both read back against the round. A run's curve
is the union of its versions' points, a later version's point replacing an earlier one at the same round.
``fedrcl validate`` / ``test`` log beside them in ``<subcommand>_k`` folders, which are not versions: they
never enter a run's curves.
"""
from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

import numpy as np

__all__ = ["Curve", "find_runs", "has_logs", "load_scalars"]

Curve = tuple[np.ndarray, np.ndarray]
"""``(rounds, values)``: int64 and float64 arrays, rounds ascending."""


def _version_number(path: Path) -> int:
    suffix = path.name.removeprefix("version_")
    return int(suffix) if suffix.isdigit() else -1


def _has_events(version: Path) -> bool:
    """Whether a folder holds a TensorBoard event file (TensorBoard reads any file with "tfevents" in its name)."""
    return any(version.glob("*tfevents*"))


def has_logs(version: Path) -> bool:
    """Whether a version folder holds a TensorBoard event file or a CSVLogger ``metrics.csv``."""
    return _has_events(version) or (version / "metrics.csv").is_file()


def find_runs(root: str | Path, names: Optional[Sequence[str]] = None) -> dict[str, Path]:
    """The runs under ``root`` (a logger's ``save_dir``): ``{name: folder}``, sorted by name.

    Args:
        root: the folder holding one sub-folder per run name.
        names: keep only these runs, in this order; a missing one is an error naming what exists.
    """
    root = Path(root)
    found = {p.name: p for p in sorted(root.iterdir())
             if p.is_dir() and any(has_logs(v) for v in p.glob("version_*"))} if root.is_dir() else {}
    if names is None:
        return found
    missing = [n for n in names if n not in found]
    if missing:
        raise ValueError(f"no run named {', '.join(missing)} under {root}; found: "
                         f"{', '.join(found) or 'none'}")
    return {n: found[n] for n in names}


def load_scalars(run: str | Path) -> dict[str, Curve]:
    """Every scalar tag of a run (all its versions merged): ``{tag: (rounds, values)}``.

    Args:
        run: a run folder (holding ``version_*``), a single version folder or an event file; a version's
            event files and its ``metrics.csv`` are both read.
    """
    run = Path(run)
    versions = sorted(run.glob("version_*"), key=_version_number) or [run]
    points: dict[str, dict[int, float]] = {}
    for version in versions:
        if run.is_file() or _has_events(version):
            # tensorboard is imported here: reading a CSVLogger run, or importing this module, needs none of it
            from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

            acc = EventAccumulator(str(version), size_guidance={"scalars": 0})
            acc.Reload()
            for tag in acc.Tags()["scalars"]:
                points.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})
        if (version / "metrics.csv").is_file():
            for tag, by_step in _read_metrics_csv(version / "metrics.csv").items():
                points.setdefault(tag, {}).update(by_step)
    curves: dict[str, Curve] = {}
    for tag, by_step in sorted(points.items()):
        steps = np.array(sorted(by_step), dtype=np.int64)
        curves[tag] = steps, np.array([by_step[s] for s in steps], dtype=np.float64)
    return curves


def _read_metrics_csv(path: Path) -> dict[str, dict[int, float]]:
    """``{tag: {step: value}}`` of a CSVLogger ``metrics.csv`` (one row per ``log_metrics`` call, a column per
    tag, empty where the call did not log it; ``epoch`` is Lightning's own column, not a scalar)."""
    points: dict[str, dict[int, float]] = {}
    with path.open(newline="", encoding="utf-8") as file:
        for row in csv.DictReader(file):
            step = row.pop("step", "")
            row.pop("epoch", None)
            if step == "":
                continue
            for tag, value in row.items():
                if value not in ("", None):
                    points.setdefault(tag, {})[int(float(step))] = float(value)
    return points
