"""Runs grouped as the seeds of one experiment, and methods paired seed by seed.

``seed_groups``: runs whose saved configs are equal except for the seeds (``seed_everything``,
``trainer.seed``, ``data.seed``) and for keys that do not change what is trained
(``fedrcl.analysis.settings.experiment_key``), on the same backend, are one experiment under several seeds, as
``fedrcl seeds`` makes them; of two runs with the same seeds too (a repeat), the one that got further counts.
``comparisons``: seed groups that differ only in the method (``method_key``: the same data, split, clients,
rounds schedule and network), on the same backend, each against its family's FedAvg group (the paper's
baseline), else the first group; ``pair_by_seed``: their runs under the same seeds (the same split, client
sampling and batches). ``differences``: what tells runs apart, for a reader. The statistics are
``fedrcl.analysis.seed_stats``'.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from fedrcl.analysis.catalogue import RunResult
from fedrcl.analysis.compare import Crossing, crossing
from fedrcl.analysis.runs import Curve
from fedrcl.analysis.seed_stats import align
from fedrcl.analysis.settings import experiment_key, method_key
from fedrcl.analysis.tags import tag_of_test

__all__ = ["comparison_rounds", "comparisons", "differences", "group_seeds", "pair_by_seed", "paired_crossings",
           "seed_groups", "seed_order"]


def _seed_tuple(run: RunResult) -> tuple:
    return tuple(repr(v) for v in run.seeds.values())


def group_seeds(runs: Sequence[RunResult]) -> tuple[list[list[RunResult]], list[tuple[RunResult, RunResult]]]:
    """``seed_groups`` and the repeats it leaves out: ``(left out, kept)`` pairs."""
    groups: dict[Any, dict[tuple, RunResult]] = {}
    repeats = []
    for run in runs:
        key = (experiment_key(run.config), run.backend) if run.config else ("run", id(run))
        by_seeds = groups.setdefault(key, {})
        other = by_seeds.get(_seed_tuple(run))
        if other is not None:
            kept, dropped = (run, other) if run.last_round > other.last_round else (other, run)
            repeats.append((dropped, kept))
            run = kept
        by_seeds[_seed_tuple(run)] = run
    return [list(by_seeds.values()) for by_seeds in groups.values()], repeats


def seed_groups(runs: Sequence[RunResult]) -> list[list[RunResult]]:
    """Runs that differ only in seeds (same ``experiment_key`` and backend), in the order of their first run; of
    runs with the same seeds too (a repeat), the one that got furthest. A run without a saved config is alone."""
    return group_seeds(runs)[0]


def comparisons(groups: Sequence[Sequence[RunResult]]) -> list[tuple[Sequence[RunResult], Sequence[RunResult]]]:
    """``(reference, challenger)`` seed groups of ``seed_groups`` that differ only in the method, its server half
    included (the same ``method_key`` and backend): in each such family the reference is its FedAvg group with
    FedAvg's server (the paper's baseline; the first one when several), else its first FedAvg group, else its
    first group, and every other group is a challenger, in the order of ``groups``. A run without a saved config
    is in no family."""
    families: dict[tuple[str, str], list[Sequence[RunResult]]] = {}
    for group in groups:
        if group[0].config:
            families.setdefault((method_key(group[0].config), group[0].backend), []).append(group)
    compared = []
    for family in families.values():
        fedavg = [g for g in family if g[0].setting["method"] == "FedAvg"]
        reference = next((g for g in fedavg if g[0].setting["server"] == "FedAvg"), (fedavg or family)[0])
        compared += [(reference, group) for group in family if group is not reference]
    return compared


def seed_order(seeds: tuple) -> tuple:
    """Seeds in numeric order (seed 10 after seed 2), ``None`` or text after numbers."""
    return tuple((0, v, "") if isinstance(v, int) else (1, 0, str(v)) for v in seeds)


def pair_by_seed(reference: Sequence[RunResult],
                 challenger: Sequence[RunResult]) -> dict[tuple, tuple[RunResult, RunResult]]:
    """``{seeds: (reference run, challenger run)}`` for the seeds (``seed_everything``, ``trainer.seed``,
    ``data.seed``, all three equal) both groups ran, in seed order: each pair shares its split, client
    sampling and batches."""
    by_seeds = {tuple(r.seeds.values()): r for r in reference}
    pairs = {seeds: (by_seeds[seeds], run) for run in challenger
             if (seeds := tuple(run.seeds.values())) in by_seeds}
    return dict(sorted(pairs.items(), key=lambda item: seed_order(item[0])))


def comparison_rounds(pairs: dict[tuple, tuple[RunResult, RunResult]], rounds: Sequence[int] = ()) -> list[int]:
    """``rounds`` when given, else the last round all paired runs logged their test accuracy EMA at
    (``tag_of_test``; none when they share no round)."""
    if rounds:
        return list(rounds)
    curves = [run.curves[tag] for pair in pairs.values() for run in pair
              if (tag := tag_of_test(run.curves)) in run.curves]
    if not pairs or len(curves) < 2 * len(pairs):
        return []
    common, _ = align(curves)
    return [int(common[-1])] if len(common) else []


def _through(curve: Curve, last: int) -> Curve:
    """``curve`` up to round ``last``."""
    rounds, values = curve
    return rounds[rounds <= last], values[rounds <= last]


def paired_crossings(pairs: dict[tuple, tuple[RunResult, RunResult]], through: int) -> dict[tuple, Crossing]:
    """Per seed pair, where the challenger's test accuracy EMA (``tag_of_test``) passes the reference's
    (``crossing``) on their common rounds up to ``through``: a run that went further is cut there, so every seed
    is read over the same rounds. Pairs without such a common round are left out."""
    out = {}
    for seeds, (reference, challenger) in pairs.items():
        ref_curve = reference.curves.get(tag_of_test(reference.curves))
        ch_curve = challenger.curves.get(tag_of_test(challenger.curves))
        if ref_curve is None or ch_curve is None:
            continue
        ref_curve, ch_curve = _through(ref_curve, through), _through(ch_curve, through)
        if len(np.intersect1d(ref_curve[0], ch_curve[0])):
            out[seeds] = crossing(ref_curve, ch_curve)
    return out


def differences(runs: Sequence[RunResult]) -> list[str]:
    """What differs between ``runs``, for a reader: the ``run_setting`` keys whose values differ (``dataset``,
    ``method``, ...), then ``backend``; ``other config keys`` when their experiments differ in nothing of these
    (a learning rate, say); empty when they are one experiment."""
    keys = [key for key in (runs[0].setting if runs else {})
            if len({repr(run.setting.get(key)) for run in runs}) > 1]
    if len({run.backend for run in runs}) > 1:
        keys.append("backend")
    if not keys and len({experiment_key(run.config) for run in runs}) > 1:
        keys.append("other config keys")
    return keys
