"""The run catalogue: which folders under a path are runs, what each run trained and its curves.

One idea of "a run" for ``fedrcl report``, ``fedrcl plot`` and the notebooks. A run folder is any folder under
the path (``<save_dir>/<name>``, ``fedrcl seeds``' ``<name>/seed<k>``, at any depth) whose ``version_k``
folders hold logs (TensorBoard event files or a CSVLogger ``metrics.csv``); ``find_runs`` lists them.
``named_runs`` gives the runs by name for a notebook.
``collect_runs`` reads each version's ``config.yaml`` (what it trained: ``fedrcl.analysis.settings``) and
curves (``fedrcl.analysis.runs``), never the folder's name, and makes runs of them:

- Versions of one folder are one run when they have the same setting and seeds and each continues the one
  before (a resume starts after the round of its checkpoint; a later version's point replaces an earlier one
  at the same round). A version that starts over (its first round at or before the run's first) is another
  run, as is a version of another setting or seeds: a second method, data set or backend written into the
  same folder never merges into the first.
- Each run knows its backend: ``Flower`` when it logged ``flower/`` scalars (the bytes Flower's ArrayRecords
  carried, which ``fedrcl.flower.server`` logs every round and ``fedrcl fit`` never does), else
  ``fedrcl fit``; a run resumed on the other backend is both (``"fedrcl fit, Flower"``).
- A log file that cannot be read whole stays with its run (``RunResult.problems``, why it stopped and the
  rounds it still gave); ``unread_versions`` names the version folders read not at all, with why.

Reading needs neither Lightning nor torch.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import yaml

from fedrcl.analysis.runs import Curve, LogProblem, has_logs, read_scalars, version_number
from fedrcl.analysis.settings import SEED_KEYS, lookup, run_setting
from fedrcl.analysis.tags import tag_of_test

__all__ = ["EMA_TAG", "FIT", "FLOWER", "RunResult", "backend_of", "collect_runs", "find_runs", "named_runs",
           "seed_runs", "unread_versions"]

EMA_TAG = "val/acc_ema"
"""The accuracy EMA the paper's tables report, as a run without a validation split logs its test accuracy (a run
with one logs it as ``test/acc_ema``: ``fedrcl.analysis.tags.tag_of_test``)."""
FIT = "fedrcl fit"
"""The backend of a run of ``fedrcl fit`` (sequential, batched clients or several processes)."""
FLOWER = "Flower"
"""The backend of a run of fedrcl's Flower ServerApp (simulation or deployment)."""


@dataclass
class RunResult:
    """One run: its folder, the version folders merged into it, its setting and its test accuracy EMA curve in
    percent (``fedrcl.analysis.tags.tag_of_test``); its saved config, every curve as logged, its backend and the log
    files not read whole."""

    path: Path
    versions: tuple[str, ...]
    setting: dict[str, Any]
    rounds: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    ema: np.ndarray = field(default_factory=lambda: np.zeros(0))
    config: dict[str, Any] = field(default_factory=dict)
    curves: dict[str, Curve] = field(default_factory=dict)
    backend: str = FIT
    problems: tuple[LogProblem, ...] = ()

    @property
    def seeds(self) -> dict[str, Any]:
        """``{"seed_everything": ..., "trainer.seed": ..., "data.seed": ...}`` from the saved config."""
        return {key: lookup(self.config, key) for key in SEED_KEYS}

    @property
    def last_round(self) -> int:
        """The last round with a test accuracy EMA point (0 before any)."""
        return int(self.rounds[-1]) if len(self.rounds) else 0

    @property
    def rounds_logged(self) -> int:
        """The last round a ``train/`` or ``val/`` scalar was logged at (training logs every round, evaluation
        maybe not; old runs logged ``comm/`` and ``time/`` one step late)."""
        return max((int(rounds[-1]) for tag, (rounds, _) in self.curves.items()
                    if tag.startswith(("train/", "val/")) and len(rounds)), default=0)

    @property
    def rounds_planned(self) -> Optional[int]:
        """``trainer.rounds`` of the saved config (``None`` when it has none)."""
        return lookup(self.config, "trainer.rounds")

    @property
    def unfinished(self) -> bool:
        """Whether the run logged fewer rounds than it was configured for (killed, stopped early, running)."""
        return isinstance(self.rounds_planned, int) and self.rounds_logged < self.rounds_planned

    def ema_at(self, round_idx: int) -> Optional[tuple[float, bool]]:
        """``(EMA accuracy in %, reached)`` at ``round_idx`` (its last evaluation at or before it), or at
        the last round logged with ``reached=False`` when the run stopped earlier; ``None`` before any."""
        if not len(self.rounds):
            return None
        if self.last_round < round_idx:
            return float(self.ema[-1]), False
        return float(self.ema[np.searchsorted(self.rounds, round_idx, side="right") - 1]), True


def backend_of(curves: dict[str, Curve]) -> str:
    """``FLOWER`` for curves with a ``flower/`` tag (the Flower ServerApp's byte counts), else ``FIT``."""
    return FLOWER if any(tag.startswith("flower/") for tag in curves) else FIT


def _version_folders(root: Path) -> list[Path]:
    """Every ``version_*`` folder under ``root``, sorted by path."""
    return sorted(v for v in root.rglob("version_*") if v.is_dir())


def find_runs(root: str | Path, names: Optional[Sequence[str]] = None) -> dict[str, Path]:
    """The run folders under ``root`` (a logger's ``save_dir``): ``{name: folder}``, the name being the folder
    relative to ``root`` (``quickstart``, ``quickstart/seed0``), sorted by folder.

    Args:
        root: the folder holding the runs, at any depth.
        names: keep only these runs, in this order; a missing one is an error naming what exists.
    """
    root = Path(root)
    folders = sorted({v.parent for v in _version_folders(root) if has_logs(v)}) if root.is_dir() else []
    found = {(p.relative_to(root).as_posix() if p != root else p.name): p for p in folders}
    if names is None:
        return found
    missing = [n for n in names if n not in found]
    if missing:
        raise ValueError(f"no run named {', '.join(missing)} under {root}; found: "
                         f"{', '.join(found) or 'none'}")
    return {n: found[n] for n in names}


def seed_runs(path: str | Path) -> list[Path]:
    """The run folders of a seed folder (``fedrcl seeds`` writes ``<name>/seed<k>/version_*``), sorted;
    ``[path]`` when ``path`` is itself one run (it holds ``version_*``) or an event file."""
    path = Path(path)
    if path.is_file() or any(path.glob("version_*")):
        return [path]
    runs = list(find_runs(path).values())
    if not runs:
        raise ValueError(f"{path} holds no run (version_* folders) and no seed runs (<seed>/version_*)")
    return runs


def _read_config(version: Path) -> tuple[Optional[dict[str, Any]], Optional[str]]:
    """``(config, None)`` of a version folder's ``config.yaml``, or ``(None, why it is not read)``."""
    path = version / "config.yaml"
    if not path.is_file():
        return None, ("no config.yaml (not written by `fedrcl fit`, or stopped before it saved its config), so "
                      "its setting is unknown")
    try:
        config = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as error:
        return None, f"config.yaml not readable ({str(error).splitlines()[0]})"
    if not isinstance(config, dict):
        return None, "config.yaml is not a LightningCLI config (not a mapping)"
    if not has_logs(version):
        return None, "no TensorBoard event file and no CSVLogger metrics.csv (only these two loggers are read)"
    return config, None


def unread_versions(root: str | Path) -> list[tuple[Path, str]]:
    """The ``version_*`` folders under ``root`` that ``collect_runs`` reads no curve from, each with why."""
    unread = []
    for version in _version_folders(Path(root)):
        config, why = _read_config(version)
        if config is None and why is not None:
            unread.append((version, why))
    return unread


@dataclass
class _Run:
    """A run being put together from the versions of one folder."""

    versions: list[Path]
    config: dict[str, Any]
    first: Optional[int]
    points: dict[str, dict[int, float]] = field(default_factory=dict)
    backends: list[str] = field(default_factory=list)
    problems: list[LogProblem] = field(default_factory=list)

    def add(self, version: Path, config: dict[str, Any], curves: dict[str, Curve],
            problems: list[LogProblem]) -> None:
        self.versions.append(version)
        self.config = config  # the latest: a resume may extend trainer.rounds
        for tag, (rounds, values) in curves.items():
            self.points.setdefault(tag, {}).update(zip(rounds.tolist(), values.tolist()))
        backend = backend_of(curves)
        if backend not in self.backends:
            self.backends.append(backend)
        self.problems += problems

    def result(self, folder: Path) -> RunResult:
        curves = {tag: (np.array(sorted(p), dtype=np.int64), np.array([p[r] for r in sorted(p)]))
                  for tag, p in self.points.items()}
        rounds, ema = curves.get(tag_of_test(curves), (np.zeros(0, np.int64), np.zeros(0)))
        return RunResult(folder, tuple(v.name for v in self.versions), run_setting(self.config), rounds,
                         100.0 * ema, self.config, curves, ", ".join(self.backends or [FIT]),
                         tuple(self.problems))


def _first_round(curves: dict[str, Curve]) -> Optional[int]:
    """The first round a version logged anything at (``None`` when it logged nothing)."""
    return min((int(rounds[0]) for rounds, _ in curves.values() if len(rounds)), default=None)


def collect_runs(root: str | Path) -> list[RunResult]:
    """Every run under ``root`` (see the module docstring), sorted by folder, then first version."""
    root = Path(root)
    if not root.is_dir():
        raise ValueError(f"{root} is not a folder")
    runs = []
    for folder in find_runs(root).values():
        started: list[_Run] = []
        current: dict[tuple, _Run] = {}
        for version in sorted(folder.glob("version_*"), key=version_number):
            config, _ = _read_config(version)  # the others: see unread_versions
            if config is None:
                continue
            curves, problems = read_scalars(version)
            key = (tuple(sorted(run_setting(config).items())), tuple(repr(lookup(config, k)) for k in SEED_KEYS))
            first, run = _first_round(curves), current.get(key)
            if run is None or (first is not None and run.first is not None and first <= run.first):
                run = current[key] = _Run([], config, first)
                started.append(run)
            run.add(version, config, curves, problems)
        runs += [run.result(folder) for run in started]
    return runs


def named_runs(root: str | Path, names: Optional[Sequence[str]] = None) -> dict[str, RunResult]:
    """The runs under ``root`` by name, for a notebook: ``{name: run}``, the name being the run's folder relative
    to ``root`` (``quickstart``, ``quickstart/seed0``), with its versions in parentheses where the folder holds
    several runs (a Flower run beside a ``fedrcl fit`` run, a second method). A warning names each version
    folder not read and each log file not read whole.

    Args:
        root: the folder holding the runs, at any depth (a logger's ``save_dir``).
        names: keep only these runs, in this order; a missing one is an error naming what exists.
    """
    root = Path(root)
    runs = collect_runs(root) if root.is_dir() else []
    for path, why in [*unread_versions(root), *(problem for run in runs for problem in run.problems)]:
        warnings.warn(f"{path}: {why}", stacklevel=2)

    def folder(run: RunResult) -> str:
        return run.path.relative_to(root).as_posix() if run.path != root else run.path.name

    shared = [folder(run) for run in runs]
    found = {(name if shared.count(name) == 1 else f"{name} ({', '.join(run.versions)})"): run
             for name, run in zip(shared, runs)}
    if names is None:
        return found
    missing = [n for n in names if n not in found]
    if missing:
        raise ValueError(f"no run named {', '.join(missing)} under {root}; found: {', '.join(found) or 'none'}")
    return {n: found[n] for n in names}
