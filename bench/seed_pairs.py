"""Two methods over seeds, paired: what issue 34 asks of the width-8 runs (and of any two methods run with the
same seeds and split).

    python bench/seed_pairs.py FedAvg=docs/cpu_runs/r8_fedavg,docs/cpu_runs/r8_seeds/fedavg \
        FedRCL=docs/cpu_runs/r8_fedrcl,docs/cpu_runs/r8_seeds/fedrcl --rounds 100 200 300 500

Each ``LABEL=PATH[,PATH...]`` names one method's runs: a path is one run (a folder of ``version_*``, read as
one curve, resumes merged) or a folder of seed runs (``<seed>/version_*``,
``fedrcl.analysis.seed_stats.seed_runs``); a run's seed is its ``config.yaml``'s ``seed_everything``. The
first method is the reference. Prints markdown:

1. per run, raw / EMA test accuracy (%) at ``--rounds`` and the rounds it ran;
2. per method and round, over the seeds that reached it: mean ± sample std and the 95% Student-t interval of
   the mean (``fedrcl.analysis.seed_stats.summarize_seeds``), EMA and raw;
3. the paired difference (challenger minus reference, per seed: the same split, client sampling and batches),
   per seed and summarized the same way;
4. per seed, where the challenger's EMA passes the reference's for good, on their common rounds up to the last
   of ``--rounds`` (``fedrcl.analysis.crossing``: a run that went further is cut there).

"-" where a run has not reached a round.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import yaml

from fedrcl.analysis import crossing, load_scalars
from fedrcl.analysis.runs import Curve
from fedrcl.analysis.seed_stats import seed_runs, summarize_seeds
from long_horizon import at as value_at

TAGS = {"EMA": "val/acc_ema", "raw": "val/acc"}


def run_seed(run: Path) -> int:
    """``seed_everything`` of the run's first saved config."""
    config = sorted(run.glob("version_*/config.yaml"))
    if not config:
        raise ValueError(f"{run}: no version_*/config.yaml to read the seed from")
    return int(yaml.safe_load(config[0].read_text())["seed_everything"])


def method_runs(spec: str) -> tuple[str, dict[int, dict[str, Curve]]]:
    """``LABEL=PATH[,PATH...]`` -> ``(label, {seed: scalars})``."""
    label, _, paths = spec.partition("=")
    if not paths:
        raise SystemExit(f"{spec}: expected LABEL=PATH[,PATH...]")
    runs: dict[int, dict[str, Curve]] = {}
    for path in paths.split(","):
        for run in seed_runs(path):
            seed = run_seed(run)
            if seed in runs:
                raise SystemExit(f"{label}: seed {seed} given twice ({run})")
            runs[seed] = load_scalars(run)
    return label, dict(sorted(runs.items()))


def at(curve: Curve, round_idx: int) -> float | None:
    """The value logged at ``round_idx`` in %, or None (``long_horizon.at``)."""
    value = value_at(curve, round_idx)
    return None if value is None else 100 * value


def summary_cell(values: list[float]) -> str:
    """``mean ± std [low, high] (n)``; the mean alone for one seed; "-" for none."""
    if not values:
        return "-"
    s = summarize_seeds(values)
    if s.n < 2:
        return f"{s.mean:.2f} (n=1)"
    return f"{s.mean:.2f} ± {s.std:.2f} [{s.mean - s.ci95:.2f}, {s.mean + s.ci95:.2f}] (n={s.n})"


def per_run_rows(methods: dict[str, dict[int, dict[str, Curve]]], rounds: list[int]) -> list[str]:
    rows = ["| method | seed | " + " | ".join(f"round {r}" for r in rounds) + " | rounds run |",
            "|---" * (len(rounds) + 3) + "|"]
    for label, runs in methods.items():
        for seed, scalars in runs.items():
            cells = [f"{raw:.2f} / {at(scalars[TAGS['EMA']], r):.2f}"
                     if (raw := at(scalars[TAGS["raw"]], r)) is not None else "-" for r in rounds]
            last = scalars[TAGS["raw"]][0][-1]
            rows.append(f"| {label} | {seed} | " + " | ".join(cells) + f" | {last} |")
    return rows


def summary_rows(methods: dict[str, dict[int, dict[str, Curve]]], rounds: list[int]) -> list[str]:
    rows = ["| method | accuracy | " + " | ".join(f"round {r}" for r in rounds) + " |",
            "|---" * (len(rounds) + 2) + "|"]
    for label, runs in methods.items():
        for name, tag in TAGS.items():
            cells = [summary_cell([v for s in runs.values() if (v := at(s[tag], r)) is not None])
                     for r in rounds]
            rows.append(f"| {label} | {name} | " + " | ".join(cells) + " |")
    return rows


def paired(reference: dict[int, dict[str, Curve]], challenger: dict[int, dict[str, Curve]], tag: str,
           round_idx: int) -> dict[int, float]:
    """``{seed: challenger - reference}`` at ``round_idx`` (points), for the seeds both reached it with."""
    out = {}
    for seed in sorted(reference.keys() & challenger.keys()):
        a, b = at(reference[seed][tag], round_idx), at(challenger[seed][tag], round_idx)
        if a is not None and b is not None:
            out[seed] = b - a
    return out


def paired_rows(methods: dict[str, dict[int, dict[str, Curve]]], rounds: list[int]) -> list[str]:
    (ref_label, reference), *others = methods.items()
    rows = []
    for label, challenger in others:
        rows += [f"{label} minus {ref_label}, per seed (points) and over seeds:", "",
                 "| accuracy | " + " | ".join(f"round {r}" for r in rounds) + " |",
                 "|---" * (len(rounds) + 1) + "|"]
        for name, tag in TAGS.items():
            diffs = [paired(reference, challenger, tag, r) for r in rounds]
            cells = [", ".join(f"s{seed} {d:+.2f}" for seed, d in by_seed.items()) or "-"
                     for by_seed in diffs]
            rows.append(f"| {name}, per seed | " + " | ".join(cells) + " |")
            means = [summary_cell(list(d.values())) for d in diffs]
            rows.append(f"| {name}, mean | " + " | ".join(means) + " |")
        rows.append("")
    return rows


def up_to(curve: Curve, last: int) -> Curve:
    rounds, values = curve
    return rounds[rounds <= last], values[rounds <= last]


def crossing_lines(methods: dict[str, dict[int, dict[str, Curve]]], last: int) -> list[str]:
    (ref_label, reference), *others = methods.items()
    lines = []
    for label, challenger in others:
        for seed in sorted(reference.keys() & challenger.keys()):
            tag = TAGS["EMA"]
            c = crossing(up_to(reference[seed][tag], last), up_to(challenger[seed][tag], last))
            first = "never above" if c.first_above is None else f"first above at round {c.first_above}"
            stays = "not above" if c.above_from is None else f"above for good from round {c.above_from}"
            lines.append(f"- seed {seed}, {label} vs {ref_label} EMA: {first}; {stays} through round "
                         f"{c.last_common} (last common round, gap {100 * c.gap_at_last:+.2f})")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("methods", nargs="+", help="LABEL=PATH[,PATH...]; the first is the reference")
    parser.add_argument("--rounds", type=int, nargs="+", default=[100, 200, 300, 500])
    args = parser.parse_args()
    methods = dict(method_runs(spec) for spec in args.methods)
    print("\n".join([*per_run_rows(methods, args.rounds), "", *summary_rows(methods, args.rounds), "",
                     *paired_rows(methods, args.rounds), *crossing_lines(methods, max(args.rounds))]))


if __name__ == "__main__":
    main()
