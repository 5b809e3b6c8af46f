"""``fedrcl plot RUNS ...``: accuracy and EMA curves of your runs, one per method, mean and 95% band over seeds.

    fedrcl plot runs/compare --out compare                 # compare.png and compare.svg
    fedrcl plot FedAvg=runs/fedavg FedRCL=runs/fedrcl --out compare --rounds 25 50
    fedrcl plot runs/compare --tags val/acc_ema train/loss --band std

Each argument is a folder of runs (``fedrcl report`` reads the same: run folders with ``config.yaml`` and
TensorBoard or CSVLogger logs): its runs are grouped into experiments that differ only in seeds
(``fedrcl.report.seed_groups``), one curve each, labelled by method (and server, where it is not FedAvg's),
with the run folder added where two experiments share a label. ``LABEL=PATH`` makes every run under ``PATH``
one curve named ``LABEL``: the seeds of one experiment, one run folder, or event files without a saved config
(``fedrcl.analysis.seed_stats.seed_runs``); ``LABEL=PATH,PATH...`` makes one curve of the runs under several
such paths (seeds run at different times, say, whose configs differ in more than the seed: their rounds). A
curve is the mean over its runs at the rounds all of them logged; with two runs or more a band shows the 95%
Student-t interval of the mean (``--band ci``) or one sample std (``--band std``). Prints a markdown table: per curve, n and ``val/acc_ema`` (mean ± std) at
``--rounds`` (default: the last round all its runs logged) and that round.

Needs neither Lightning nor torch; matplotlib draws off-screen (Agg).
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Optional

from fedrcl.analysis.runs import Curve, load_scalars
from fedrcl.analysis.seed_stats import align, seed_runs, summarize_seeds
from fedrcl.errors import command_error
from fedrcl.report import EMA_TAG, RunResult, collect_runs, seed_groups

__all__ = ["curve_groups", "summary_table", "main"]

Groups = dict[str, list[Mapping[str, Curve]]]
"""``{label: [scalars of each run]}``: what ``fedrcl.analysis.plots.plot_seed_groups`` draws."""


def _label(group: Sequence[RunResult]) -> str:
    setting = group[0].setting
    method, server = setting["method"], setting["server"]
    return method if server in ("FedAvg", method) else f"{server} + {method}"


def _folder(group: Sequence[RunResult], root: Path) -> str:
    """The group's run folder under ``root`` (the seeds' parent for ``fedrcl seeds``' ``<name>/seed<k>``)."""
    path = group[0].path
    if path.name.startswith("seed") and path != root:
        path = path.parent
    return path.name if path == root else str(path.relative_to(root))


def _runs_with(spec: str, path: Path, tags: Sequence[str], left_out: Optional[list[str]]
               ) -> tuple[list[RunResult], list[RunResult]]:
    """``(every run under path, those that logged all of tags)``; a run left out gets a line in ``left_out``."""
    if not path.exists():
        raise ValueError(f"{spec}: {path} does not exist")
    found, runs = collect_runs(path) if path.is_dir() else [], []
    for run in found:
        missing = [tag for tag in tags if tag not in run.curves]
        if missing and left_out is not None:
            left_out.append(f"{run.path} ({', '.join(run.versions)}): no {', '.join(missing)} logged")
        runs += [] if missing else [run]
    return found, runs


def _one_experiment(spec: str, path: Path, tags: Sequence[str], left_out: Optional[list[str]]
                    ) -> list[Mapping[str, Curve]]:
    """The curves of the runs under ``path``, which must be seeds of one experiment (or event files without a
    saved config), each with all of ``tags``."""
    found, runs = _runs_with(spec, path, tags, left_out)
    experiments = seed_groups(runs)
    if len(experiments) > 1:
        raise ValueError(f"{spec}: {path} holds runs of {len(experiments)} experiments (they differ in "
                         f"more than seeds); give each its own LABEL=PATH, or {path} alone to label them by "
                         "method")
    curve_sets: list[list[Mapping[str, Curve]]]
    if not experiments and not found:  # event files without a saved config
        curve_sets = [[load_scalars(run) for run in seed_runs(path)]]
    else:
        curve_sets = [[r.curves for r in group] for group in experiments]
    if not curve_sets or any(tag not in curves for curves in curve_sets[0] for tag in tags):
        raise ValueError(f"{spec}: no run under {path} logged all of {', '.join(tags)}")
    return curve_sets[0]


def curve_groups(specs: Sequence[str], tags: Sequence[str] = ("val/acc", EMA_TAG),
                 left_out: Optional[list[str]] = None) -> Groups:
    """The curves to draw from ``PATH`` and ``LABEL=PATH`` arguments (see the module docstring).

    A run that lacks one of ``tags`` (killed before its first evaluation, say) is left out, with a line in
    ``left_out``. Raises ``ValueError`` naming the argument when a path holds no run with
    them, or when ``LABEL=PATH`` holds runs of several experiments (they would be averaged as seeds)."""
    groups: Groups = {}
    for spec in specs:
        label, sep, path_text = spec.partition("=")
        if sep:  # one curve from the runs under one or several paths
            groups[label] = [curves for text in path_text.split(",")
                             for curves in _one_experiment(spec, Path(text), tags, left_out)]
            continue
        path = Path(spec)
        found, runs = _runs_with(spec, path, tags, left_out)
        if not runs:
            raise ValueError(f"{spec}: no runs with {', '.join(tags)} under {path} (run folders with config.yaml "
                             "and TensorBoard or CSVLogger logs); name event files without a config as LABEL=PATH")
        experiments = seed_groups(runs)
        labels = [_label(g) for g in experiments]
        for group, name in zip(experiments, labels):
            if labels.count(name) > 1 or name in groups:
                name = f"{name} ({_folder(group, path)})"
            groups[name] = [r.curves for r in group]
    return groups


def summary_table(groups: Groups, rounds: Optional[Sequence[int]] = None, tag: str = EMA_TAG) -> list[str]:
    """Markdown rows: per curve, n, ``tag`` in % (mean ± sample std over its runs) at ``rounds`` ("-" where not
    all its runs logged it) and the last round all of them logged; without ``rounds``, at that round."""
    aligned = {label: align([scalars[tag] for scalars in runs]) for label, runs in groups.items()
               if all(tag in scalars for scalars in runs)}
    columns = list(rounds) if rounds else ["last"]
    out = ["| method | n | " + " | ".join(f"EMA acc @ {r}" for r in columns) + " | rounds run |",
           "|---" * (len(columns) + 3) + "|"]
    for label, (common, values) in aligned.items():
        cells = []
        for r in columns:
            at = len(common) - 1 if r == "last" else next(iter((common == r).nonzero()[0]), None)
            cells.append("-" if at is None or not len(common) else summarize_seeds(100 * values[:, at]).format())
        last = str(common[-1]) if len(common) else "-"
        out.append(f"| {label} | {values.shape[0]} | " + " | ".join(cells) + f" | {last} |")
    return out


def main(argv: Optional[list[str]] = None) -> None:
    """``fedrcl plot RUNS [RUNS ...] [--out PATH] [--tags TAG ...] [--band ci|std] [--rounds R ...]``."""
    parser = argparse.ArgumentParser(
        prog="fedrcl plot", description="Accuracy and EMA curves of your runs: one per method, mean and 95% band "
                                        "over seeds; PNG and SVG.")
    parser.add_argument("runs", nargs="+", metavar="RUNS",
                        help="a folder of runs, or LABEL=PATH[,PATH...] (one curve)")
    parser.add_argument("--out", default="curves",
                        help="write OUT.png and OUT.svg (a .png or .svg suffix is dropped; default: %(default)s)")
    parser.add_argument("--tags", nargs="+", default=["val/acc", EMA_TAG], help="one panel per scalar "
                                                                                "(default: %(default)s)")
    parser.add_argument("--band", choices=("ci", "std"), default="ci",
                        help="band over seeds: the 95%% Student-t interval of the mean, or one sample std")
    parser.add_argument("--rounds", type=int, nargs="+", help="rounds of the printed val/acc_ema table")
    parser.add_argument("--title", default="", help="a title above the panels")
    args = parser.parse_args(argv)
    left_out: list[str] = []
    try:
        groups = curve_groups(args.runs, args.tags, left_out)
    except ValueError as error:
        command_error("fedrcl plot", str(error))
    for note in left_out:
        print(f"fedrcl plot: left out {note}", file=sys.stderr)
    import matplotlib

    matplotlib.use("Agg")
    from fedrcl.analysis.plots import plot_seed_groups

    fig = plot_seed_groups(groups, args.tags, args.band)
    if args.title:
        fig.suptitle(args.title)
    out = Path(args.out)
    out = out.with_suffix("") if out.suffix in (".png", ".svg") else out
    out.parent.mkdir(parents=True, exist_ok=True)
    print("\n".join(summary_table(groups, args.rounds)), end="\n\n")
    for suffix in (".png", ".svg"):
        fig.savefig(out.with_name(out.name + suffix), dpi=110)
    print(f"fedrcl plot: wrote {out}.png and {out}.svg")


if __name__ == "__main__":
    main()
