"""Paper tables of runs: methods x settings, or each method's setting chosen on validation, with the paper's
numbers beside ours where a cell of ``fedrcl/paper_results.json`` has the run's setting.

``settings_table``: a row per method variant (the method, and its own arguments where its seed groups differ in
them: a learning rate, a loss weight), a column per benchmark setting (the data set, split and anything else
the runs of different methods share) and round; each cell the test accuracy EMA over the seed group's runs.
``selected_table``: a row per method at the setting ``fedrcl.analysis.selection`` chose on validation, columns
its test accuracy EMA, raw test accuracy and the difference to a reference method paired by seed;
``protocol`` says what was searched, how many settings, seeds and rounds each method got, and warns when
those budgets differ. The cells are ``fedrcl.analysis.tables.Cell`` (95% Student-t interval), rendered by
that module.

The paper's tables are matched as ``fedrcl report``'s paper section matches them (``paper_cells``,
``setting_matches``): a run's ``run_setting`` must equal the table's, the block's, the column's and the row's
setting keys; the paper's number is at our round where the paper reports that round, else at its last round
(shown with it).
"""
from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from typing import Any, Optional, cast

from fedrcl.analysis.catalogue import RunResult
from fedrcl.analysis.grouping import pair_by_seed, seed_groups
from fedrcl.analysis.selection import MethodSelection, method_label, searched
from fedrcl.analysis.seed_stats import align, paired_differences, summarize_seeds, value_at
from fedrcl.analysis.settings import method_key
from fedrcl.analysis.tables import Cell, Table
from fedrcl.analysis.tags import tag_of_test

__all__ = ["columns_of", "paper_cells", "paper_number", "protocol", "selected_table", "setting_matches",
           "settings_table"]

METHOD_FACTS = ("method", "server", "beta", "levels")
"""``run_setting`` facts of the method; the others are the benchmark's (a column of a settings table)."""
SOURCE = "Seo et al. (Relaxed Contrastive Learning for Federated Learning, CVPR 2024)"


def setting_matches(setting: dict[str, Any], required: dict[str, Any]) -> bool:
    """Whether a run's ``run_setting`` has every key of ``required`` at its value (floats to 1e-9, JSON lists
    as tuples)."""
    for key, want in required.items():
        have = setting.get(key)
        if isinstance(want, list):  # JSON has no tuples: levels
            want = tuple(want)
        if isinstance(want, float) and isinstance(have, (int, float)) and not isinstance(have, bool):
            if not math.isclose(have, want, rel_tol=1e-9):
                return False
        elif have != want:
            return False
    return True


def columns_of(table: dict[str, Any], block: dict[str, Any]) -> list[dict[str, Any]]:
    """A block's own columns where it lists them (e.g. the shard counts of Table A), else the table's."""
    return block["columns"] if "columns" in block else table["columns"]


def paper_cells(table: dict[str, Any]) -> Iterator[tuple[str, str, str, dict[str, Any]]]:
    """``(block, row, column, required setting)`` for every cell of a paper table."""
    for block in table["blocks"]:
        for row in table["rows"]:
            for column in columns_of(table, block):
                yield block["name"], row["name"], column["name"], \
                    {**table["setting"], **block["setting"], **column["setting"], **row["setting"]}


def paper_number(paper: dict[str, Any], setting: dict[str, Any], round_idx: int) -> Optional[tuple[float, int]]:
    """``(the paper's number, its round)`` for the first cell of its tables whose setting ``setting`` has: at
    ``round_idx`` where the table reports that round, else at the table's last round; ``None`` where none."""
    for table in paper["tables"]:
        for block, row, column, required in paper_cells(table):
            if not setting_matches(setting, required):
                continue
            values = table["values"].get(block, {}).get(row, {}).get(column)
            if not values:
                continue
            rounds = list(table["rounds"])
            at = rounds.index(round_idx) if round_idx in rounds else len(rounds) - 1
            if values[at] is not None:
                return float(values[at]), int(rounds[at])
    return None


def _value(run: RunResult, kind: str, round_idx: int) -> Optional[float]:
    """The run's test accuracy (``kind``: ``acc`` or ``acc_ema``) in % at ``round_idx``; ``None`` if not logged."""
    curve = run.curves.get(tag_of_test(run.curves, kind))
    value = value_at(curve, round_idx) if curve is not None else None
    return None if value is None else 100.0 * value


def _cell(values: Sequence[Optional[float]], paper: Optional[tuple[float, int]] = None) -> Optional[Cell]:
    kept = [v for v in values if v is not None]
    if not kept:
        return None
    return Cell(summarize_seeds(kept), *(paper if paper is not None else (None, None)))


def _short(values: dict[str, Any]) -> str:
    """``lr=0.01, mu=0.1``: each key by its last part."""
    return ", ".join(f"{key.rsplit('.', 1)[-1]}={json.dumps(value, default=str).strip(chr(34))}"
                     for key, value in values.items())


def _last_common_round(runs: Sequence[RunResult]) -> Optional[int]:
    curves = [c for run in runs if (c := run.curves.get(tag_of_test(run.curves))) is not None and len(c[0])]
    if not curves:
        return None
    common, _ = align(curves)
    return int(common[-1]) if len(common) else None


def _column_labels(families: list[list[list[RunResult]]]) -> list[str]:
    """A label per benchmark setting: data set and split, and the other benchmark facts that differ."""
    firsts = [family[0][0].setting for family in families]
    differ = [key for key in firsts[0] if key not in METHOD_FACTS + ("dataset", "partition", "alpha")
              and len({repr(s.get(key)) for s in firsts}) > 1]
    labels = []
    for s in firsts:
        label = f"{s['dataset']} {s['partition']}" + (f" α={s['alpha']:g}" if s["alpha"] is not None else "")
        labels.append(", ".join([label, *(f"{key}={s[key]}" for key in differ)]))
    return [f"{label} ({i + 1})" if labels.count(label) > 1 else label for i, label in enumerate(labels)]


def settings_table(runs: Sequence[RunResult], paper: dict[str, Any], rounds: Sequence[int] = ()) -> Table:
    """Methods x settings: a row per method variant, a column per benchmark setting and round (``rounds``, else
    the last round all the setting's runs logged), each cell the test accuracy EMA in % over the seed group."""
    groups = [g for g in seed_groups(runs) if _last_common_round(g) is not None]
    if not groups:
        raise ValueError("no run logged a test accuracy EMA")
    families: dict[tuple[str, str], list[list[RunResult]]] = {}
    for group in groups:
        families.setdefault((method_key(group[0].config), group[0].backend), []).append(group)
    family_list = list(families.values())
    labels = _column_labels(family_list)
    columns: list[tuple[int, int, str]] = []
    for f, family in enumerate(family_list):
        at = list(rounds) or [_last_common_round([run for group in family for run in group]) or 0]
        columns += [(f, r, f"{labels[f]}, round {r}") for r in at]
    by_method: dict[str, list[list[RunResult]]] = {}
    for group in groups:
        by_method.setdefault(method_label(group[0].setting), []).append(group)
    rows: list[tuple[str, tuple[Optional[Cell], ...]]] = []
    for method, method_groups in by_method.items():
        own = {key: values for key, values in searched(method_groups).items()
               if key.startswith("model.") and not key.startswith("model.init_args.backbone")}
        variants: dict[str, list[list[RunResult]]] = {}
        for i, group in enumerate(method_groups):
            name = method + (f" ({_short({key: values[i] for key, values in own.items()})})" if own else "")
            variants.setdefault(name, []).append(group)
        for name, variant in variants.items():
            cells: list[Optional[Cell]] = []
            for f, r, _ in columns:
                here = [g for g in variant if any(g is other for other in family_list[f])]
                cells.append(_cell([_value(run, "acc_ema", r) for run in here[0]],
                                   paper_number(paper, here[0][0].setting, r)) if here else None)
            rows.append((name, tuple(cells)))
    caption = ("Test accuracy EMA (%) at the round of each column: mean ± half-width of the 95% Student-t "
               "interval of the mean over seeds (one seed: its value alone); bold: best of its column"
               + _paper_note(rows) + ".")
    return Table(caption, "Method", tuple(c[2] for c in columns), tuple(rows))


def _paper_note(rows: Sequence[tuple[str, Sequence[Optional[Cell]]]]) -> str:
    """What "paper" beside a cell means, for a caption; empty when no cell has the paper's number."""
    if not any(cell is not None and cell.paper is not None for _, cells in rows for cell in cells):
        return ""
    return f"; paper: the number reported by {SOURCE} for the same setting, at the round shown"


def _reference(selections: Sequence[MethodSelection], reference: Optional[str]) -> MethodSelection:
    names = [s.method for s in selections]
    if reference is not None and reference not in names:
        raise ValueError(f"--reference {reference}: no such method among the runs; methods: {', '.join(names)}")
    wanted = reference or ("FedAvg" if "FedAvg" in names else names[0])
    return selections[names.index(wanted)]


def selected_table(selections: Sequence[MethodSelection], paper: dict[str, Any],
                   reference: Optional[str] = None) -> Table:
    """A row per method at its chosen setting (``select_on_validation``): its test accuracy EMA and raw test
    accuracy in % over seeds at its selection round, and its test EMA minus the reference method's, paired by
    seed (the same seeds of both; ``reference`` default FedAvg, else the first method) at the earlier of the
    two selection rounds."""
    ref = _reference(selections, reference)
    rows = []
    for s in selections:
        at = s.choice.round_idx
        values = s.chosen_values()
        name = s.method + (f" ({_short(values)})" if values else "")
        if len({other.choice.round_idx for other in selections}) > 1:
            name += f", round {at}"
        ema = _cell([_value(run, "acc_ema", at) for run in s.chosen],
                    paper_number(paper, s.chosen[0].setting, at))
        raw = _cell([_value(run, "acc", at) for run in s.chosen])
        diff = None
        if s is not ref:
            pairs = {seeds: (r.curves[tag_of_test(r.curves)], c.curves[tag_of_test(c.curves)])
                     for seeds, (r, c) in pair_by_seed(ref.chosen, s.chosen).items()
                     if tag_of_test(r.curves) in r.curves and tag_of_test(c.curves) in c.curves}
            both = min(at, ref.choice.round_idx)
            diff = _cell([100.0 * d for d in paired_differences(pairs, both).values()])
        rows.append((name, (ema, raw, diff)))
    caption = ("Each method at the setting with the best mean validation accuracy over its seeds (chosen on the "
               "validation split, never on the test set); its test accuracy (%) at the selection round: mean ± "
               "half-width of the 95% Student-t interval over seeds (one seed: its value alone); "
               f"Δ: its test EMA minus {ref.method}'s, paired by seed; bold: best of its column"
               + _paper_note(rows) + ".")
    columns = ("test acc EMA", "test acc", f"Δ EMA vs {ref.method} (paired)")
    return Table(caption, "Method", columns, tuple(rows), label="tab:fedrcl-selected")


def _values_text(values: Sequence[Any]) -> str:
    shown = []
    for value in values:
        text = json.dumps(value, default=str).strip('"')
        if text not in shown:
            shown.append(text)
    return "{" + ", ".join(shown) + "}"


def protocol(selections: Sequence[MethodSelection], kind: str = "acc_ema") -> list[str]:
    """The selection's protocol, a line each: how settings were chosen, then per method what was searched, its
    settings x seeds x rounds (run-rounds up to its selection round), the setting chosen and its validation
    score; a warning when the methods' budgets differ; the settings left out (not all their runs logged the
    selection round)."""
    out = [f"Selection on validation: per method, the setting with the best mean `val/{kind}` (the global "
           "model's accuracy on the validation split held out of the training clients) over its seeds at the "
           "selection round; the test accuracy of that setting is reported. Test accuracies are not read to "
           "choose.", ""]
    for s in selections:
        seeds = sorted({len(group) for group in s.scored})
        seeds_text = f"{seeds[0]} seeds" if len(seeds) == 1 else f"{seeds[0]}-{seeds[-1]} seeds"
        searched_text = "; ".join(f"`{key}` in {_values_text(values)}" for key, values in s.searched.items())
        scores = sorted(s.choice.scores.values())
        chosen = _short(s.chosen_values()) or "its one setting"
        out.append(f"- {s.method}: {len(s.scored)} settings x {seeds_text} x {s.choice.round_idx} rounds = "
                   f"{s.budget} run-rounds; searched: {searched_text or 'nothing (one setting)'}; chosen: "
                   f"{chosen} (validation {100 * s.choice.scores[s.choice.best]:.2f}; all settings "
                   f"{100 * scores[0]:.2f} to {100 * scores[-1]:.2f})")
        for key in s.choice.left_out:
            out.append(f"  - left out of {s.method}'s selection: setting "
                       f"{_short({k: v[cast(int, key)] for k, v in s.searched.items()})}, whose runs did not all "
                       f"log round {s.choice.round_idx}")
    budgets = {s.method: s.budget for s in selections}
    if len(set(budgets.values())) > 1:
        out += ["", "**Warning: unequal tuning budgets** (run-rounds = settings x seeds x rounds: "
                + ", ".join(f"{m} {b}" for m, b in budgets.items())
                + "): a method tuned over more settings, seeds or rounds had more chances to look best."]
    return out + [""]
