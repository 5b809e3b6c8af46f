"""``fedrcl report RUNS_DIR``: your runs, their seed groups and where they stand against the paper, in markdown.

    fedrcl report runs                      # markdown to stdout
    fedrcl report runs --out report.md
    fedrcl report runs --paper              # also every table of the paper, our rows beneath its rows
    fedrcl report runs --rounds 100 300 500 # seeds and paired differences at these rounds
    fedrcl report runs --format latex       # the paper table alone: methods x settings (also markdown, csv)
    fedrcl report sweeps --select val       # each method's setting chosen on validation, its test accuracy

The report starts with your runs (a table: setting, rounds, last EMA; a run that logged fewer rounds than
its ``trainer.rounds`` is marked as not finished, one whose logs could not be read whole says so), then the
seed groups and the methods paired by seed (below), then what was left out and why (a version folder without
``config.yaml`` or without logs, a log file cut short or corrupt, a repeat of a run with the same seeds), then
the cells of the paper's tables that your runs fill (all the tables with ``--paper``).

Which runs there are, what each trained and its curves is the run catalogue's
(``fedrcl.analysis.catalogue``: run folders at any depth under ``RUNS_DIR``, versions of one folder merged
only when they continue each other, a run's setting read from its ``config.yaml``, never from its name, its
backend from what it logged). Runs of several backends (``fedrcl fit`` and Flower) are never grouped or
paired with each other: the report then adds a Backend column and says so.

The paper's numbers live in ``fedrcl/paper_results.json``: per table its fixed setting, its blocks (e.g. data
sets), columns (e.g. alpha; a block may list its own) and rows (methods), each with the setting keys (those
of ``fedrcl.analysis.settings.run_setting``) a run must match, and the values at the table's rounds, with an
optional note. A run fills a cell when its setting matches the table's, the block's, the column's and the
row's; one run can fill cells of several tables. Our value is the ``val/acc_ema`` curve (the accuracy EMA the
paper reports) at the round, or at the last round logged, marked ``*``, when the run stopped earlier; where the
run has siblings under other seeds (below), the cell shows their mean ± sample std and n.

Seeds (``fedrcl.analysis.grouping``): runs whose saved configs are equal except for the seeds and for keys
that do not change what is trained (``fedrcl.analysis.settings.EXPERIMENT_IGNORES``, ``ROUND_LOOP_VALUES``)
are one experiment under several seeds, as ``fedrcl seeds`` makes them. The "Seeds" section gives, per
experiment and per tag (``--tags``, default ``val/acc_ema val/acc``), the mean ± sample std over its runs, n
and the 95% Student-t interval, at the last round all its runs logged (``fedrcl.analysis.seed_stats``), and
with ``--rounds`` also at each of those rounds, over the runs that logged it.

Paired by seed: seed groups that differ only in the method are compared, each against its family's FedAvg
group (the paper's baseline), else the first group, run by run under the same seeds (``comparisons``,
``pair_by_seed``). Per run, raw / EMA test accuracy at the rounds (``--rounds``; default the
last round all paired runs logged); per seed the challenger minus the reference, and over seeds its mean ±
std, 95% interval and n (``fedrcl.analysis.seed_stats.paired_differences``); per seed the round from which
the challenger's EMA stays above the reference's (``fedrcl.analysis.crossing``, curves cut at the last of
those rounds).

Test and validation accuracy (``fedrcl.analysis.tags``): a run with a validation split (``data.val_fraction >
0``) logs its test accuracy as ``test/acc*`` and its validation accuracy as ``val/acc*``; a run without one
logs its test accuracy as ``val/acc*``. Every table reads the test accuracy (the Seeds section's default tags
become ``test/acc_ema test/acc`` where a run has a validation split; otherwise they read as before).

Paper table (``--format markdown|latex|csv``, ``fedrcl.analysis.paper_table``): the table alone, methods x
settings (``settings_table``), each cell the test accuracy EMA, mean ± the 95% interval's half-width over seeds,
the best of each column in bold, the paper's number beside where a cell of its tables has the setting.

Selection on validation (``--select val [--select_tag acc_ema|acc] [--select_round R] [--reference M]``,
``fedrcl.analysis.selection``): per method, the setting (seed group) with the best mean validation accuracy over
its seeds at round R (default: the last round all the method's runs logged), chosen from validation curves
only; then that setting's test accuracy (EMA and raw) over seeds with the 95% interval and n, and its EMA minus
the reference method's paired by seed. The protocol comes with the table: what was searched per method, its
settings x seeds x rounds, and a warning when those budgets differ. A run without a validation split is refused
in one line (selecting on its ``val/acc``, the test accuracy, would tune on the test set).

Reading runs needs neither Lightning nor torch (``fedrcl report`` starts in well under a second of imports).
``--out`` is checked before anything is read: a folder it cannot be written in is one line naming it.
"""
from __future__ import annotations

import argparse
import json
import sys
from importlib import resources
from pathlib import Path
from typing import Any, Optional, Sequence

from fedrcl.analysis.catalogue import RunResult, collect_runs, unread_versions
from fedrcl.analysis.grouping import (
    comparison_rounds,
    comparisons,
    differences,
    group_seeds,
    pair_by_seed,
    paired_crossings,
    seed_groups,
    seed_order,
)
from fedrcl.analysis.output import out_file_problem, write_text
from fedrcl.analysis.paper_table import columns_of as _columns
from fedrcl.analysis.paper_table import paper_cells as _cells
from fedrcl.analysis.paper_table import protocol, selected_table, settings_table
from fedrcl.analysis.paper_table import setting_matches as _matches
from fedrcl.analysis.selection import method_label, select_on_validation
from fedrcl.analysis.tables import render_csv, render_latex, render_markdown
from fedrcl.analysis.runs import Curve
from fedrcl.analysis.seed_stats import align, paired_differences, summarize_seeds, value_at
from fedrcl.analysis.settings import SEED_KEYS
from fedrcl.analysis.tags import logged_validation, tag_of_test, with_test_tags
from fedrcl.errors import command_error

__all__ = ["load_paper_results", "render_seed_table", "render_paired", "render_report", "main"]

DEFAULT_SEED_TAGS = ("val/acc_ema", "val/acc")
"""The Seeds section's default scalars where no run has a validation split (then ``val/acc*`` are the test
accuracy); where one has, ``TEST_SEED_TAGS`` (``default_seed_tags``)."""
TEST_SEED_TAGS = ("test/acc_ema", "test/acc")
"""Every run's test accuracy (``fedrcl.analysis.tags.with_test_tags``)."""
PAIRED_TAGS = {"EMA": "acc_ema", "raw": "acc"}
"""The test accuracies the "Paired by seed" section compares (``tag_of_test`` kinds), by the name it shows them
under."""


def default_seed_tags(runs: Sequence[RunResult]) -> tuple[str, ...]:
    """``DEFAULT_SEED_TAGS`` where no run logged a validation accuracy apart from its test accuracy (the report
    reads as it always did), else ``TEST_SEED_TAGS``: the test accuracy of every run, never a validation one."""
    return TEST_SEED_TAGS if any(logged_validation(run.curves) for run in runs) else DEFAULT_SEED_TAGS


PAPER = 'Seo et al., "Relaxed Contrastive Learning for Federated Learning", CVPR 2024'
"""How the report cites the paper: by title and venue, which a reader can find."""


def load_paper_results(path: Optional[str | Path] = None) -> dict[str, Any]:
    """The paper's tables (``fedrcl/paper_results.json`` unless ``path`` is given)."""
    if path is not None:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    return json.loads(resources.files("fedrcl").joinpath("paper_results.json").read_text(encoding="utf-8"))


def _seed_label(runs: Sequence[RunResult], key: str) -> str:
    values = sorted({str(r.seeds[key]) for r in runs})
    return ",".join(values)


def render_seed_table(runs: Sequence[RunResult], tags: Optional[Sequence[str]] = None,
                      root: Optional[Path] = None, rounds: Sequence[int] = ()) -> list[str]:
    """The "Seeds" section: per experiment, per tag, mean ± std over its runs, n and the 95% interval.

    ``tags`` default to ``default_seed_tags(runs)``; ``test/acc*`` are read as every run's test accuracy
    (``with_test_tags``). Values are in % for tags of accuracies (``.../acc...``), as logged otherwise; each at
    the last round every run of the experiment logged the tag (``@`` that round), and in a second table at each of
    ``rounds``, over the runs that logged it. Paths are shown relative to ``root``.
    """
    out = ["## Seeds", "",
           "Runs that differ only in seeds, grouped: mean ± sample std over the runs, n, and the 95% "
           "interval of the mean (Student t), each at the last round all the runs logged (@). Accuracies "
           "in %.", ""]
    tags = default_seed_tags(runs) if tags is None else tags
    groups = [g for g in seed_groups(runs) if any(r.curves for r in g)]
    if not groups:
        return out + ["No runs with logged scalars.", ""]
    if "privacy/epsilon" not in tags and any("privacy/epsilon" in r.curves for r in runs):
        tags = [*tags, "privacy/epsilon"]  # runs with trainer.privacy: their epsilon beside their accuracy
    mixed = len(_backends(runs)) > 1
    header = ["Experiment", "Method", "Server", "n", "seeds (init / sampling / split)"]
    for tag in tags:
        header += [f"{tag} mean ± std", f"{tag} 95% CI"]
    out += ["| " + " | ".join(header) + " |", "|:--|:--|:--|--:|:--|" + "--:|--:|" * len(tags)]
    for group in groups:
        s = group[0].setting
        seeds = " / ".join(_seed_label(group, k) for k in SEED_KEYS)
        cells = [_md(_group_where(group, root, mixed)), _md(s["method"]), _md(s["server"]), str(len(group)), seeds]
        for tag in tags:
            cells += _seed_cells(group, tag)
        out.append("| " + " | ".join(cells) + " |")
    out.append("")
    out += _shared_folders(groups, root)
    if not rounds:
        return out
    out += ["The same at the rounds asked for (`--rounds`), each over the runs that logged that round: mean ± "
            "sample std [95% interval] (n); \"-\" where none did.", "",
            "| Experiment | Method | Tag | " + " | ".join(f"round {r}" for r in rounds) + " |",
            "|:--|:--|:--|" + "--:|" * len(rounds)]
    for group in groups:
        for tag in tags:
            values = [[v for run in group if tag in (curves := with_test_tags(run.curves))
                       and (v := value_at(curves[tag], r)) is not None] for r in rounds]
            cells = [_summary_cell([_scale(tag) * v for v in at_round]) for at_round in values]
            out.append(f"| {_md(_group_where(group, root, mixed))} | {_md(group[0].setting['method'])} | {_md(tag)} | "
                       + " | ".join(cells) + " |")
    return out + [""]


def _group_where(group: Sequence[RunResult], root: Optional[Path], backend: bool = False) -> str:
    """The folders of a seed group's runs (``<name>`` for ``<name>/seed<k>`` runs), relative to ``root``, and
    ``on <backend>`` when ``backend`` (a report of several backends)."""
    where = ", ".join(sorted({_where(r.path.parent if r.path.name.startswith("seed") else r.path, root)
                              for r in group}))
    return f"{where} on {group[0].backend}" if backend else where


def _shared_folders(groups: Sequence[Sequence[RunResult]], root: Optional[Path]) -> list[str]:
    """A line per folder whose runs are several experiments (a second method or a Flower run written into it),
    saying what tells them apart, so that one name in the table above is not read as one experiment."""
    by_folder: dict[str, list[RunResult]] = {}
    for group in groups:
        by_folder.setdefault(_group_where(group, root), []).append(group[0])
    notes = [f"- `{_md(where)}` holds {len(firsts)} experiments, differing in {', '.join(differences(firsts))}."
             for where, firsts in by_folder.items() if len(firsts) > 1]
    return notes + [""] if notes else []


def _backends(runs: Sequence[RunResult]) -> dict[str, int]:
    """``{backend: number of runs}``, in the order of the runs."""
    counts: dict[str, int] = {}
    for run in runs:
        counts[run.backend] = counts.get(run.backend, 0) + 1
    return counts


def _scale(tag: str) -> float:
    """100 for accuracies (``.../acc...``, and per domain ``val/acc/<domain>``, shown in %), else 1."""
    return 100.0 if "acc" in tag.rsplit("/", 1)[-1] or "/acc/" in tag else 1.0


def _summary_cell(values: Sequence[float]) -> str:
    """``mean ± std [low, high] (n=k)``; ``mean (n=1)`` for one value; "-" for none."""
    if not values:
        return "-"
    s = summarize_seeds(values)
    if s.n < 2:
        return f"{s.mean:.2f} (n=1)"
    return f"{s.format()} {s.interval()} (n={s.n})"


def _seed_cells(group: Sequence[RunResult], tag: str) -> list[str]:
    curves: list[Curve] = []
    for r in group:
        curve = with_test_tags(r.curves).get(tag)
        if curve is None or not len(curve[0]):
            return ["", ""]
        curves.append(curve)
    common, values = align(curves)
    if not len(common):
        return ["", ""]
    at = int(common[-1])
    summary = summarize_seeds(values[:, -1])
    scale = _scale(tag)
    return [f"{summary.format(scale)} @{at}", summary.interval(scale)]


def render_paired(runs: Sequence[RunResult], rounds: Sequence[int] = (), root: Optional[Path] = None) -> list[str]:
    """The "Paired by seed" section: per challenger of ``comparisons``, its runs and the reference's (raw /
    EMA accuracy at each of ``comparison_rounds`` and the rounds run), the paired differences per seed and
    over seeds (``PAIRED_TAGS``), and per seed where the challenger's EMA passes the reference's for good."""
    out = ["## Paired by seed", "",
           "Seed groups that differ only in the method, its server half included (the same data, split, clients, "
           "rounds schedule and network) are compared with the FedAvg group among them (FedAvg's server; else the "
           "first), run by run under the same "
           "seeds (init, sampling and split: the same split, client sampling and batches). Per run, test "
           "accuracy raw / EMA (%) at the rounds asked for (`--rounds`; default: the last round all paired runs "
           "logged), \"-\" where not logged; then the challenger minus the reference in points, per seed "
           "(s<seed>) and over the seeds where both logged the round: mean ± sample std [95% Student-t "
           "interval] (n); last, per seed, where the challenger's EMA passes the reference's for good, on their "
           "common rounds up to the last of those rounds.", ""]
    compared = comparisons(seed_groups(runs))
    if not compared:
        return out + ["No seed groups that differ only in the method.", ""]
    mixed = len(_backends(runs)) > 1
    for reference, challenger in compared:
        ref_name, ch_name = method_label(reference[0].setting), method_label(challenger[0].setting)
        ref_where, ch_where = _group_where(reference, root, mixed), _group_where(challenger, root, mixed)
        if ref_name == ch_name:  # the same method under other arguments: the folders tell them apart
            ref_name, ch_name = ref_where, ch_where
        out += [f"### {_md(ch_name)} ({_md(ch_where)}) against {_md(ref_name)} ({_md(ref_where)})", ""]
        pairs = pair_by_seed(reference, challenger)
        at = comparison_rounds(pairs, rounds)
        if not pairs or not at:
            out += ["No seeds in common." if not pairs else "No round all the paired runs logged.", ""]
            continue
        header = " | ".join(f"round {r}" for r in at)
        out += [f"| method | seed | run | {header} | rounds run |", "|:--|--:|:--|" + "--:|" * (len(at) + 1)]
        for name, group in ((ref_name, reference), (ch_name, challenger)):
            for run in sorted(group, key=lambda r: seed_order(tuple(r.seeds.values()))):
                cells = [_raw_ema(run, r) for r in at]
                out.append(f"| {_md(name)} | {run.seeds['seed_everything']} | {_md(_where(run.path, root))} | "
                           + " | ".join(cells) + f" | {run.rounds_logged} |")
        out += ["", f"| {_md(ch_name)} minus {_md(ref_name)} | {header} |", "|:--|" + "--:|" * len(at)]
        for label, kind in PAIRED_TAGS.items():
            curves = {seeds: (ref.curves[ref_tag], ch.curves[ch_tag]) for seeds, (ref, ch) in pairs.items()
                      if (ref_tag := tag_of_test(ref.curves, kind)) in ref.curves
                      and (ch_tag := tag_of_test(ch.curves, kind)) in ch.curves}
            diffs = [{seeds: 100 * d for seeds, d in paired_differences(curves, r).items()} for r in at]
            per_seed = [", ".join(f"s{seeds[0]} {d:+.2f}" for seeds, d in by_seeds.items()) or "-"
                        for by_seeds in diffs]
            out.append(f"| {label}, per seed | " + " | ".join(per_seed) + " |")
            out.append(f"| {label}, mean | " + " | ".join(_summary_cell(list(d.values())) for d in diffs) + " |")
        out.append("")
        for seeds, c in paired_crossings(pairs, at[-1]).items():
            first = "never above" if c.first_above is None else f"first above at round {c.first_above}"
            stays = "not above" if c.above_from is None else f"above for good from round {c.above_from}"
            out.append(f"- seed {seeds[0]}, {ch_name} vs {ref_name} EMA: {first}; {stays} through round "
                       f"{c.last_common} (last common round, gap {100 * c.gap_at_last:+.2f})")
        out.append("")
    return out


def _raw_ema(run: RunResult, round_idx: int) -> str:
    """``raw / EMA`` test accuracy in % at ``round_idx``, "-" for a value not logged there (alone when neither
    is)."""
    tags = [tag_of_test(run.curves, PAIRED_TAGS[name]) for name in ("raw", "EMA")]
    values = [value_at(run.curves[tag], round_idx) if tag in run.curves else None for tag in tags]
    if all(v is None for v in values):
        return "-"
    return " / ".join("-" if v is None else f"{100 * v:.2f}" for v in values)


def _assign(tables: list[dict[str, Any]], runs: list[RunResult]) -> dict[tuple, list[RunResult]]:
    """The runs shown in each cell ``(table label, block, row, column)``: of the matching runs, the one
    that got furthest (the later one on a tie), with the runs of its experiment under other seeds."""
    groups = {id(r): group for group in seed_groups(runs) for r in group}
    shown: dict[tuple, list[RunResult]] = {}
    for table in tables:
        for block, row, column, required in _cells(table):
            matching = [r for r in runs if len(r.rounds) and _matches(r.setting, required)]
            if matching:
                best = max(reversed(matching), key=lambda r: r.last_round)
                siblings = [r for r in groups.get(id(best), [best]) if r is not best and len(r.rounds)]
                shown[(table["label"], block, row, column)] = [best, *siblings]
    return shown


def _our_cell(group: Sequence[RunResult], round_idx: int, theirs: Optional[float]) -> str:
    """``value`` (one run) or ``mean ± std (n=k)`` over seeds, ``*`` if a run stopped earlier, and the
    difference to the paper's number."""
    points = [p for p in (run.ema_at(round_idx) for run in group) if p is not None]
    if not points:
        return ""
    summary = summarize_seeds([value for value, _ in points])
    cell = f"{summary.mean:.2f}"
    if summary.n > 1:
        cell += f" ± {summary.std:.2f} (n={summary.n})"
    cell += "" if all(reached for _, reached in points) else "*"
    return cell if theirs is None else f"{cell} ({summary.mean - theirs:+.2f})"


def _md(text: Any) -> str:
    return str(text).replace("|", "\\|")


def _split_name(setting: dict[str, Any]) -> str:
    name = str(setting["partition"])
    if setting["alpha"] is not None:
        name += f" α={setting['alpha']:g}"
    if setting["shards_per_client"] is not None:
        name += f" γ={setting['shards_per_client']}"
    if setting["partition_file"]:
        name += f" (file {Path(setting['partition_file']).name})"
    return name


def _render_table(table: dict[str, Any], shown: dict[tuple, list[RunResult]]) -> list[str]:
    out = [f"## {table['title']} (`{table['label']}`)", "",
           "Setting of every cell: " + ", ".join(f"{k} {v}" for k, v in table["setting"].items()) + ".", ""]
    if "note" in table:
        out += [table["note"], ""]
    for block in table["blocks"]:
        columns = _columns(table, block)
        header = [f"{c['name']} {r}R" for c in columns for r in table["rounds"]]
        out += [f"### {block['name']}", "", "| Method | " + " | ".join(header) + " |",
                "|:--|" + "--:|" * len(header)]
        for row in table["rows"]:
            paper_row = table["values"].get(block["name"], {}).get(row["name"], {})
            paper_cells, our_cells = [], []
            for column in columns:
                paper = paper_row.get(column["name"], [None] * len(table["rounds"]))
                group = shown.get((table["label"], block["name"], row["name"], column["name"]), [])
                for round_idx, theirs in zip(table["rounds"], paper):
                    paper_cells.append("" if theirs is None else f"{theirs:.2f}")
                    our_cells.append(_our_cell(group, round_idx, theirs))
            out.append(f"| {_md(row['name'])} (paper) | " + " | ".join(paper_cells) + " |")
            out.append(f"| {_md(row['name'])} (ours) | " + " | ".join(our_cells) + " |")
        out.append("")
    return out


def _where(path: Path, root: Optional[Path]) -> str:
    """``path`` relative to ``root`` where it lies under it."""
    return str(path.relative_to(root)) if root is not None and path.is_relative_to(root) else str(path)


def _render_runs(runs: Sequence[RunResult], placed: dict[int, list[tuple]], root: Optional[Path]) -> list[str]:
    """The "Runs" section: one row per run, a run that logged fewer rounds than planned marked."""
    out = ["## Your runs", ""]
    if not runs:
        return out + ["No runs found (a run is a folder of `version_*` folders holding `config.yaml` and "
                      "TensorBoard event files or a CSVLogger `metrics.csv`).", ""]
    out += ["Rounds: the last round logged, of `trainer.rounds`; \"not finished\": fewer (killed, stopped early, "
            "or still running). Last EMA: the test accuracy EMA at its last round, in % (`test/acc_ema` where the "
            "run holds out a validation split, else `val/acc_ema`, the test accuracy as the paper logs it).", ""]
    backends = _backends(runs)
    if len(backends) > 1:  # never grouped as seeds nor paired across backends: say so, and which run is which
        out += [f"Runs of {len(backends)} backends ("
                + ", ".join(f"{name}: {count}" for name, count in backends.items())
                + "): runs of different backends are never merged, grouped as seeds or paired; the Backend "
                "column says which is which (Flower: a run that logged `flower/` byte counts).", ""]
    columns = ["Run", "Versions", "Dataset", "Split", "Method", "Server", "Backbone", "Clients/round", "Rounds",
               "Last EMA", "Paper cells"]
    align = "|:--|:--|:--|:--|:--|:--|:--|--:|--:|--:|:--|"
    if len(backends) > 1:
        columns.insert(6, "Backend")
        align = "|:--|:--|:--|:--|:--|:--|:--|:--|--:|--:|--:|:--|"
    out += ["| " + " | ".join(columns) + " |", align]
    for run in runs:
        s = run.setting
        backbone = f"{s['backbone']}" + (f" (width {s['width']})" if s["width"] is not None else "")
        where = "; ".join(" / ".join(map(str, cell)) for cell in placed.get(id(run), [])) or "—"
        last = f"{run.ema[-1]:.2f}" if len(run.ema) else "no val/acc_ema yet"
        rounds = str(run.rounds_logged)
        if run.rounds_planned is not None:
            rounds += f" of {run.rounds_planned}"
        if run.problems:  # fewer rounds because a log is damaged, not because training stopped
            rounds += ", logs not read whole (see Left out)"
        elif run.unfinished:
            rounds += ", not finished"
        cells = [_md(_where(run.path, root)), _md(", ".join(run.versions)), _md(s["dataset"]),
                 _md(_split_name(s)), _md(s["method"]), _md(s["server"]), _md(backbone),
                 f"{s['clients_per_round']}/{s['num_clients']}", rounds, last, _md(where)]
        if len(backends) > 1:
            cells.insert(6, _md(run.backend))
        out.append(" | ".join(["", *cells, ""]).strip())
    return out + [""]


def _render_left_out(runs: Sequence[RunResult], unread: Sequence[tuple[Path, str]],
                     root: Optional[Path]) -> list[str]:
    """The "Left out" section: what is not in the tables above, and why."""
    notes = [f"- `{_where(path, root)}`: {why}." for path, why in unread]
    notes += [f"- `{_where(path, root)}` (of `{_where(run.path, root)}`, {', '.join(run.versions)}): {why}; the "
              "run is shown with what was read." for run in runs for path, why in run.problems]
    for dropped, kept in group_seeds(runs)[1]:
        notes.append(f"- `{_where(dropped.path, root)}` ({', '.join(dropped.versions)}): the same experiment and "
                     f"seeds as `{_where(kept.path, root)}` ({', '.join(kept.versions)}), which got further "
                     f"(round {kept.last_round} against {dropped.last_round}); seeds and paper cells use that "
                     "one. Runs that differ only in keys that do not change what is trained (logging, "
                     "callbacks, rounds, devices: `EXPERIMENT_IGNORES`) are repeats.")
    return ["## Left out", "", *(notes or ["Nothing: every version folder found is in the tables above."]), ""]


def _render_paper_cells(tables: list[dict[str, Any]], shown: dict[tuple, list[RunResult]]) -> list[str]:
    """The cells of the paper's tables that the runs fill, one row per cell and round."""
    out = ["## Beside the paper", "",
           f"Paper: {PAPER}; its numbers are in `fedrcl/paper_results.json`. The cells your runs fill: our "
           "`val/acc_ema` (EMA 0.9 of the test accuracy, %) at the table's round, mean ± sample std (n=...) "
           "over seeds, ours minus the paper's in parentheses; `*`: a run stopped earlier, its value is at its "
           "last round. `--paper` prints every table.", ""]
    rows = []
    for table in tables:
        for block in table["blocks"]:
            for row in table["rows"]:
                paper_row = table["values"].get(block["name"], {}).get(row["name"], {})
                for column in _columns(table, block):
                    group = shown.get((table["label"], block["name"], row["name"], column["name"]))
                    if not group:
                        continue
                    paper = paper_row.get(column["name"], [None] * len(table["rounds"]))
                    for round_idx, theirs in zip(table["rounds"], paper):
                        rows.append(" | ".join(["", _md(table["label"]), _md(block["name"]), _md(row["name"]),
                                                _md(column["name"]), str(round_idx),
                                                "" if theirs is None else f"{theirs:.2f}",
                                                _our_cell(group, round_idx, theirs), ""]).strip())
    if not rows:
        return out + ["No run has the setting of a cell of the paper's tables (data set, split, clients, local "
                      "epochs, method, server, backbone).", ""]
    return out + ["| Table | Block | Method | Column | Round | Paper | Ours |", "|:--|:--|:--|:--|--:|--:|--:|",
                  *rows, ""]


RENDERERS = {"markdown": render_markdown, "latex": render_latex, "csv": render_csv}
"""``--format``'s choices: a ``fedrcl.analysis.tables.Table`` as text."""


def render_selection(runs: Sequence[RunResult], paper: dict[str, Any], fmt: str = "markdown", kind: str = "acc_ema",
                     round_idx: Optional[int] = None, reference: Optional[str] = None,
                     title: str = "") -> tuple[str, str]:
    """``(text, protocol)`` of ``--select val``: each method's setting chosen on validation
    (``fedrcl.analysis.selection.select_on_validation``) and its test accuracy (``selected_table``) in ``fmt``,
    with the protocol (``protocol``): above the markdown table, as ``%`` lines above the LaTeX one; for CSV the
    protocol is returned apart (``fedrcl report`` prints it on stderr). ``ValueError`` in one line for a run
    without a validation split, runs of several benchmarks or an unknown ``reference``."""
    selections = select_on_validation(runs, kind, round_idx)
    table = selected_table(selections, paper, reference)
    lines = protocol(selections, kind)
    if fmt == "markdown":
        heading = [f"# fedrcl report{': ' + title if title else ''}, selected on validation", ""]
        return "\n".join(heading + ["## Protocol", "", *lines, "## Selected on validation", "",
                                    render_markdown(table)]), ""
    if fmt == "latex":
        comments = (f"% {line.replace('**', '').replace('`', '')}".rstrip() for line in lines)  # markdown marks
        return "\n".join(comments) + "\n" + render_latex(table), ""
    return RENDERERS[fmt](table), "\n".join(lines)


def render_report(runs: Sequence[RunResult], paper: Optional[dict[str, Any]] = None, title: str = "",
                  seed_tags: Optional[Sequence[str]] = None, paper_tables: bool = False,
                  unread: Sequence[tuple[Path, str]] = (), root: Optional[str | Path] = None,
                  rounds: Sequence[int] = ()) -> str:
    """The markdown report: the runs, the seeds table, the methods paired by seed, what was left out, then the
    paper's cells they fill (every table of the paper, with our rows, when ``paper_tables``).

    Args:
        runs: ``collect_runs(root)``.
        paper: the paper's tables (``load_paper_results()`` when None).
        title: after "fedrcl report: " in the heading.
        seed_tags: the scalars of the Seeds section (``default_seed_tags(runs)`` when None).
        paper_tables: print the paper's tables in full.
        unread: ``unread_versions(root)``, listed under "Left out".
        root: paths are shown relative to it.
        rounds: the rounds of the Seeds section's second table and of the paired comparisons.
    """
    paper = load_paper_results() if paper is None else paper
    root = Path(root) if root is not None else None
    tables = paper["tables"]
    shown = _assign(tables, list(runs))
    placed: dict[int, list[tuple]] = {}
    for cell, group in shown.items():
        for run in group:
            placed.setdefault(id(run), []).append(cell)
    out = [f"# fedrcl report{': ' + title if title else ''}", ""]
    out += _render_runs(runs, placed, root)
    out += render_seed_table(runs, seed_tags, root, rounds)
    out += render_paired(runs, rounds, root)
    out += _render_left_out(runs, unread, root)
    if not paper_tables:
        return "\n".join(out + _render_paper_cells(tables, shown))
    out += ["## The paper's tables", "",
            f"Paper: {PAPER}. Its numbers below are in `fedrcl/paper_results.json` (one entry per table).",
            "Each method has the paper's row and ours beneath it: our `val/acc_ema` (EMA 0.9 of the test "
            "accuracy, in %) at the round, with ours minus the paper's in parentheses; over several seeds of "
            "one experiment, mean ± sample std (n=...). `*`: a run stopped earlier; its value is at its last "
            "round (see Your runs). Empty: no finished round for that cell.", ""]
    for table in tables:
        out += _render_table(table, shown)
    return "\n".join(out)


def main(argv: Optional[list[str]] = None) -> None:
    """``fedrcl report RUNS_DIR [--out FILE] [--tags TAG ...] [--rounds R ...] [--paper]``."""
    parser = argparse.ArgumentParser(
        prog="fedrcl report", description="Markdown tables of your runs, their seeds, their methods paired by "
                                          "seed, and the paper's cells they fill.")
    parser.add_argument("runs_dir", metavar="RUNS_DIR", help="folder holding the runs (a logger's save_dir)")
    parser.add_argument("--out", help="write the markdown here instead of printing it")
    parser.add_argument("--tags", nargs="+", default=None,
                        help="scalars summarised over seeds in the Seeds section (default: val/acc_ema val/acc, "
                             "or test/acc_ema test/acc where a run has a validation split: the test accuracy)")
    parser.add_argument("--rounds", type=int, nargs="+", default=[], metavar="R",
                        help="also summarise the seed groups at these rounds, and compare the methods paired by "
                             "seed at them (default: the last round all paired runs logged)")
    parser.add_argument("--paper", action="store_true",
                        help="print every table of the paper with our rows beneath its rows, not only the "
                             "cells our runs fill")
    parser.add_argument("--format", choices=tuple(RENDERERS), default=None,
                        help="print the paper table alone in this format: methods x settings, or with --select the "
                             "selected table (default: the markdown report; with --select, markdown)")
    parser.add_argument("--select", choices=("val",), default=None,
                        help="val: per method, the setting with the best mean validation accuracy over its "
                             "seeds (runs with data.val_fraction > 0 only), and its test accuracy")
    parser.add_argument("--select_tag", choices=("acc_ema", "acc"), default="acc_ema",
                        help="the validation accuracy selected on: val/acc_ema (default) or val/acc")
    parser.add_argument("--select_round", type=int, default=None, metavar="R",
                        help="the round selected at (default: the last round all of a method's runs logged)")
    parser.add_argument("--reference", default=None,
                        help="the method the selected ones are compared with, paired by seed (default: FedAvg, "
                             "else the first method)")
    args = parser.parse_args(argv)
    if args.select is None and (args.select_round is not None or args.reference is not None):
        parser.error("--select_round and --reference go with --select val")
    if args.select is not None and args.rounds:
        parser.error("--rounds does not go with --select val: give the round selected at as --select_round")
    if (args.select is not None or args.format is not None) and (args.paper or args.tags is not None):
        parser.error("--paper and --tags go with the markdown report, not with --select or --format")
    out = Path(args.out) if args.out else None
    problem = out_file_problem(out) if out is not None else None
    if problem is not None:  # before anything is read or printed
        command_error("fedrcl report", f"--out {problem}")
    if not Path(args.runs_dir).is_dir():
        command_error("fedrcl report", f"RUNS_DIR {args.runs_dir} is not a folder")
    runs, unread = collect_runs(args.runs_dir), unread_versions(args.runs_dir)
    if not runs:
        without_config = sum(why.startswith("no config.yaml") for _, why in unread)
        found = f"; {without_config} version folders without config.yaml" if without_config else ""
        if len(unread) > without_config:
            path, why = next((p, w) for p, w in unread if not w.startswith("no config.yaml"))
            found += f"; {len(unread) - without_config} version folders not read ({path}: {why})"
        command_error("fedrcl report", f"no runs under {args.runs_dir}{found} (a run is a folder of version_* "
                      "folders, each with the config.yaml of `fedrcl fit` and TensorBoard event files or a "
                      "CSVLogger metrics.csv; fedrcl report reads no other logger's files: W&B's and MLflow's runs "
                      "are read in their own tools)")
    aside = ""
    try:
        if args.select == "val":
            text, aside = render_selection(runs, load_paper_results(), args.format or "markdown", args.select_tag,
                                           args.select_round, args.reference, args.runs_dir)
        elif args.format is not None:
            text = RENDERERS[args.format](settings_table(runs, load_paper_results(), args.rounds))
        else:
            text = render_report(runs, title=args.runs_dir, seed_tags=args.tags, paper_tables=args.paper,
                                 unread=unread, root=Path(args.runs_dir), rounds=args.rounds)
    except ValueError as error:
        command_error("fedrcl report", str(error))
    if aside:
        print(aside, file=sys.stderr)
    if out is None:
        print(text, end="")
        return
    try:
        write_text(out, text)
    except ValueError as error:
        command_error("fedrcl report", f"--out {error}")


if __name__ == "__main__":
    main()
