"""``fedrcl plot RUNS ...``: accuracy and EMA curves of your runs, one per method, mean and 95% band over seeds.

    fedrcl plot runs/compare --out compare                 # compare.png and compare.svg
    fedrcl plot FedAvg=runs/fedavg FedRCL=runs/fedrcl --out compare --rounds 25 50
    fedrcl plot --run FedAvg "runs/a,b" --run FedAvg runs/c --out compare   # one curve of two folders
    fedrcl plot runs/compare --tags test/acc_ema train/loss --band std

Each argument is a folder of runs, read by the run catalogue that ``fedrcl report`` reads
(``fedrcl.analysis.catalogue``): its runs are grouped into experiments that differ only in seeds
(``fedrcl.analysis.grouping``), one curve each, labelled by method (and server, where it is not FedAvg's),
with the run folder added where two experiments share a label (and the backend, a Flower run beside a
``fedrcl fit`` run of the same config). ``LABEL=PATH`` makes every run under ``PATH`` one curve named
``LABEL``: the seeds of one experiment, one run folder, or event files without a saved config
(``fedrcl.analysis.catalogue.seed_runs``); ``LABEL=PATH,PATH...`` makes one curve of the runs under several
such paths (seeds run at different times, say, whose configs differ in more than the seed: their rounds). An
argument that is an existing path is a path, even with ``=`` in its name (``runs/lr=0.1``); ``--run LABEL
PATH`` names one path whatever its characters (a comma), and repeated with the same ``LABEL`` adds paths to
that curve; ``--run`` curves come after the positional ones. An empty label, or one label for two curves, is
refused.

A figure holds runs of one data set: runs of several are refused in one line naming them (plot each data
set on its own). A curve is the mean over its runs at the rounds all of them logged; with two runs or more a
band shows the 95% Student-t interval of the mean (``--band ci``) or one sample std (``--band std``). A NaN or
infinite point is not drawn (the mean has a gap there); each is noted under the figure and in the printed
table. Prints a markdown table: per curve, n and the test accuracy EMA (mean ± std) at ``--rounds`` (default:
the last round all its runs logged) and that round. Runs left out (without the tags, logs that cannot be read
whole, version folders without a config) are named on stderr, each with why.

The test accuracy is ``test/acc`` and ``test/acc_ema`` for every run (the default panels): a run with a
validation split logged them so, a run without one logged its test accuracy as ``val/acc*``, which are read
as ``test/acc*`` too (``fedrcl.analysis.tags.with_test_tags``); ``val/acc*`` stay as logged (a run with a
validation split: its validation accuracy).

Needs neither Lightning nor torch; matplotlib draws off-screen (Agg).
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Optional, Union

import numpy as np

from fedrcl.analysis.catalogue import RunResult, collect_runs, seed_runs, unread_versions
from fedrcl.analysis.output import make_parent, out_file_problem
from fedrcl.analysis.runs import Curve, read_scalars
from fedrcl.analysis.grouping import differences, seed_groups
from fedrcl.analysis.seed_stats import align, summarize_seeds
from fedrcl.analysis.tags import with_test_tags
from fedrcl.errors import command_error

__all__ = ["curve_groups", "nonfinite_notes", "summary_table", "main"]

Groups = dict[str, list[Mapping[str, Curve]]]
"""``{label: [scalars of each run]}``: what ``fedrcl.analysis.plots.plot_seed_groups`` draws."""
Spec = Union[str, tuple[str, Sequence[str]]]
"""A positional argument (``PATH``, ``LABEL=PATH[,PATH...]``) or a ``--run`` curve ``(LABEL, [PATH, ...])``."""
TEST_TAGS = ("test/acc", "test/acc_ema")
"""The default panels: every run's test accuracy, raw and EMA."""


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


_LABELS = (
    lambda group, root: _label(group),
    lambda group, root: f"{_label(group)} ({_folder(group, root)})",
    lambda group, root: f"{_label(group)} ({_folder(group, root)}, {group[0].backend})",
    lambda group, root: f"{_label(group)} ({_folder(group, root)}, {group[0].backend}, "
                        f"{', '.join(group[0].versions)})",
)
"""A curve's label, each more precise than the one before: the first that tells it apart is used."""


def _parse(spec: Spec) -> tuple[Optional[str], list[Path], str]:
    """``(label or None, paths, the argument as typed)``: an existing path is a path, whatever its name."""
    if not isinstance(spec, str):
        label, paths = spec
        typed = f"--run {label} {' '.join(paths)}"
        if not label:
            raise ValueError(f"{typed}: empty label; give the curve a name")
        return label, [Path(p) for p in paths], typed
    if Path(spec).exists() or "=" not in spec:
        return None, [Path(spec)], spec
    label, _, paths_text = spec.partition("=")
    if not label:
        raise ValueError(f"{spec}: empty label; give LABEL=PATH (or --run LABEL PATH), or PATH alone to label "
                         "its runs by method")
    paths = [paths_text] if Path(paths_text).exists() else paths_text.split(",")
    return label, [Path(p) for p in paths], spec


def _runs_with(spec: str, path: Path, tags: Sequence[str], left_out: list[str]
               ) -> tuple[list[RunResult], list[RunResult]]:
    """``(every run under path, those that logged all of tags)``; each run, log or version left out gets a line
    in ``left_out``."""
    if not path.exists():
        raise ValueError(f"{spec}: {path} does not exist")
    found, runs = collect_runs(path) if path.is_dir() else [], []
    for run in found:
        left_out += [f"{log}: {why}" for log, why in run.problems]
        missing = [tag for tag in tags if tag not in with_test_tags(run.curves)]
        if missing:
            left_out.append(f"{run.path} ({', '.join(run.versions)}): no {', '.join(missing)} logged")
        runs += [] if missing else [run]
    if path.is_dir():
        left_out += [f"{version}: {why}" for version, why in unread_versions(path)]
    return found, runs


def _no_runs(spec: str, path: Path, tags: Sequence[str], notes: Sequence[str]) -> ValueError:
    """The error of a path without a run that logged ``tags``, naming what was left out and why."""
    why = f" (left out: {'; '.join(notes)})" if notes else ""
    return ValueError(f"{spec}: no run under {path} logged all of {', '.join(tags)}{why}")


def _one_experiment(spec: str, path: Path, tags: Sequence[str], left_out: list[str]
                    ) -> tuple[list[Mapping[str, Curve]], list[RunResult]]:
    """The curves of the runs under ``path``, which must be seeds of one experiment (or event files without a
    saved config), each with all of ``tags``; and those runs (none for event files)."""
    notes: list[str] = []
    found, runs = _runs_with(spec, path, tags, notes)
    experiments = seed_groups(runs)
    if len(experiments) > 1:
        raise ValueError(f"{spec}: {path} holds runs of {len(experiments)} experiments (they differ in "
                         f"{', '.join(differences(runs)) or 'more than seeds'}); give each its own LABEL=PATH, or "
                         f"{path} alone to label them by method")
    if experiments:
        left_out += notes
        return [with_test_tags(r.curves) for r in experiments[0]], experiments[0]
    if found:
        raise _no_runs(spec, path, tags, notes)
    curves: list[Mapping[str, Curve]] = []  # event files without a saved config
    notes = []
    for run in seed_runs(path):
        scalars, problems = read_scalars(run)
        notes += [f"{log}: {why}" for log, why in problems]
        scalars = with_test_tags(scalars)
        if all(tag in scalars for tag in tags):
            curves.append(scalars)
    if not curves:
        raise _no_runs(spec, path, tags, notes)
    left_out += notes
    return curves, []


def _one_data_set(datasets: dict[str, set[str]]) -> None:
    """Refuses curves of several data sets on one pair of axes, naming which curve has which."""
    by_dataset: dict[str, list[str]] = {}
    for label, names in datasets.items():
        for name in sorted(names):
            by_dataset.setdefault(name, []).append(label)
    if len(by_dataset) > 1:
        listed = "; ".join(f"{name}: {', '.join(labels)}" for name, labels in by_dataset.items())
        raise ValueError(f"runs of {len(by_dataset)} data sets ({listed}); one figure holds one data set: plot "
                         "each on its own")


def curve_groups(specs: Sequence[Spec], tags: Sequence[str] = TEST_TAGS,
                 left_out: Optional[list[str]] = None) -> Groups:
    """The curves to draw from ``PATH``, ``LABEL=PATH`` and ``(LABEL, [PATH, ...])`` arguments (see the module
    docstring), in their order.

    A run that lacks one of ``tags`` (killed before its first evaluation, say), a log file not read whole and a
    version folder without a config are left out, each with a line in ``left_out``. Raises ``ValueError`` naming
    the argument when a path holds no run with them, when ``LABEL=PATH`` holds runs of several experiments
    (they would be averaged as seeds), for an empty or repeated label, or for runs of several data sets."""
    left_out = [] if left_out is None else left_out
    groups: Groups = {}
    datasets: dict[str, set[str]] = {}
    for spec in specs:
        label, paths, typed = _parse(spec)
        if label is not None:  # one curve from the runs under one or several paths
            if label in groups:
                raise ValueError(f"{typed}: a second curve named {label}; give each curve its own label")
            groups[label], datasets[label] = [], set()
            for path in paths:
                curves, runs = _one_experiment(typed, path, tags, left_out)
                groups[label] += curves
                datasets[label] |= {r.setting["dataset"] for r in runs if r.setting["dataset"] is not None}
            continue
        path = paths[0]
        notes: list[str] = []
        found, runs = _runs_with(typed, path, tags, notes)
        if not runs:
            raise ValueError(f"{typed}: no runs with {', '.join(tags)} under {path} (run folders with config.yaml "
                             "and TensorBoard or CSVLogger logs; no other logger's files are read: W&B's and MLflow's runs are "
                             "read in their own tools); name event files without a config as LABEL=PATH"
                             + (f"; left out: {'; '.join(notes)}" if notes else ""))
        left_out += notes
        experiments = seed_groups(runs)
        for group in experiments:
            for make in _LABELS:
                name = make(group, path)
                if sum(make(other, path) == name for other in experiments) == 1 and name not in groups:
                    break
            groups[name] = [with_test_tags(r.curves) for r in group]
            datasets[name] = {r.setting["dataset"] for r in group if r.setting["dataset"] is not None}
    _one_data_set(datasets)
    return groups


def _rounds_text(rounds: Sequence[int]) -> str:
    """``3, 4, 5`` for a few rounds, ``3, 4, 5, ... 40 (12 rounds)`` for many."""
    shown = ", ".join(str(r) for r in rounds[:3])
    return shown if len(rounds) <= 4 else f"{shown}, ... {rounds[-1]} ({len(rounds)} rounds)"


def nonfinite_notes(groups: Groups, tags: Sequence[str]) -> list[str]:
    """One line per curve and tag with a NaN or infinite point: the rounds and how many of its runs."""
    notes = []
    for label, runs in groups.items():
        for tag in tags:
            curves = [scalars[tag] for scalars in runs if tag in scalars]
            bad = [rounds[~np.isfinite(values)] for rounds, values in curves]
            hit = sorted({int(r) for rounds in bad for r in rounds})
            if hit:
                n = sum(len(rounds) > 0 for rounds in bad)
                notes.append(f"{label}: {tag} is NaN or infinite at round{'s' if len(hit) > 1 else ''} "
                             f"{_rounds_text(hit)} in {n} of its {len(curves)} runs; not drawn there")
    return notes


def summary_table(groups: Groups, rounds: Optional[Sequence[int]] = None, tag: str = "test/acc_ema") -> list[str]:
    """Markdown rows: per curve, n, ``tag`` in % (mean ± sample std over its runs) at ``rounds`` ("-" where not
    all its runs logged it, "non-finite" where one logged NaN or infinity) and the last round all of them
    logged; without ``rounds``, at that round."""
    aligned = {label: align([scalars[tag] for scalars in runs]) for label, runs in groups.items()
               if all(tag in scalars for scalars in runs)}
    columns = list(rounds) if rounds else ["last"]
    out = ["| method | n | " + " | ".join(f"EMA acc @ {r}" for r in columns) + " | rounds run |",
           "|---" * (len(columns) + 3) + "|"]
    for label, (common, values) in aligned.items():
        cells = []
        for r in columns:
            at = len(common) - 1 if r == "last" else next(iter((common == r).nonzero()[0]), None)
            if at is None or not len(common):
                cells.append("-")
            elif not np.isfinite(values[:, at]).all():
                cells.append(f"non-finite in {int((~np.isfinite(values[:, at])).sum())} of {values.shape[0]}")
            else:
                cells.append(summarize_seeds(100 * values[:, at]).format())
        last = str(common[-1]) if len(common) else "-"
        out.append(f"| {label} | {values.shape[0]} | " + " | ".join(cells) + f" | {last} |")
    return out


def _out_files(out_arg: str) -> list[Path]:
    """``OUT.png`` and ``OUT.svg`` (a ``.png`` or ``.svg`` suffix of ``--out`` dropped)."""
    out = Path(out_arg)
    out = out.with_suffix("") if out.suffix in (".png", ".svg") else out
    return [out.with_name(out.name + suffix) for suffix in (".png", ".svg")]


def main(argv: Optional[list[str]] = None) -> None:
    """``fedrcl plot RUNS [RUNS ...] [--run LABEL PATH ...] [--out PATH] [--tags TAG ...] [--band ci|std]
    [--rounds R ...]``."""
    parser = argparse.ArgumentParser(
        prog="fedrcl plot", description="Accuracy and EMA curves of your runs: one per method, mean and 95% band "
                                        "over seeds; PNG and SVG.")
    parser.add_argument("runs", nargs="*", metavar="RUNS",
                        help="a folder of runs, or LABEL=PATH[,PATH...] (one curve); an existing path is a path")
    parser.add_argument("--run", nargs=2, action="append", default=[], metavar=("LABEL", "PATH"),
                        help="one curve LABEL of the runs under PATH (any characters); repeat with the same LABEL "
                             "to add paths to it")
    parser.add_argument("--out", default="curves",
                        help="write OUT.png and OUT.svg (a .png or .svg suffix is dropped; default: %(default)s)")
    parser.add_argument("--tags", nargs="+", default=list(TEST_TAGS), help="one panel per scalar (default: "
                        "%(default)s, the test accuracy of every run; val/acc* as logged)")
    parser.add_argument("--band", choices=("ci", "std"), default="ci",
                        help="band over seeds: the 95%% Student-t interval of the mean, or one sample std")
    parser.add_argument("--rounds", type=int, nargs="+", help="rounds of the printed test/acc_ema table")
    parser.add_argument("--title", default="", help="a title above the panels")
    args = parser.parse_args(argv)
    if not args.runs and not args.run:
        parser.error("give a folder of runs, LABEL=PATH or --run LABEL PATH")
    files = _out_files(args.out)
    for path in files:  # before anything is read or printed
        problem = out_file_problem(path)
        if problem is not None:
            command_error("fedrcl plot", f"--out {problem}")
    specs: list[Spec] = list(args.runs)
    by_label: dict[str, list[str]] = {}
    for label, path in args.run:
        by_label.setdefault(label, []).append(path)
    specs += list(by_label.items())
    left_out: list[str] = []
    try:
        groups = curve_groups(specs, args.tags, left_out)
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
    nonfinite = nonfinite_notes(groups, args.tags)
    if nonfinite:
        fig.supxlabel("\n".join(nonfinite), x=0.01, ha="left", fontsize="small", color="firebrick")
    try:
        make_parent(files[0])
    except ValueError as error:
        command_error("fedrcl plot", f"--out {error}")
    for path in files:
        try:
            fig.savefig(path, dpi=110)
        except OSError as error:
            command_error("fedrcl plot", f"--out {path} not written ({error.strerror or error})")
    table = summary_table(groups, args.rounds)
    if nonfinite:
        table += ["", *(f"- {note}" for note in nonfinite)]
    print("\n".join(table), end="\n\n")
    out = files[0].with_suffix("")
    print(f"fedrcl plot: wrote {out}.png and {out}.svg")


if __name__ == "__main__":
    main()
