"""The long-horizon comparison of docs/results.md: raw / EMA test accuracy at chosen rounds, where each method
passes the first (the reference), the loss parts per feature level, and the curves.

    python bench/long_horizon.py FedAvg=docs/cpu_runs/cnn_fedavg FedRCL=docs/cpu_runs/cnn_fedrcl \
        --rounds 50 100 200 300 500 1000 --out docs/results_cnn_long.png

Each LABEL=PATH is one run folder (its versions merged, as after resumes). Prints markdown: the accuracy table
(``raw / EMA`` in %, "-" where not reached), one line per method on its crossing of the reference
(``fedrcl.analysis.crossing`` on ``val/acc_ema`` and ``val/acc``), and, for runs that log per-level loss
parts (``train/loss_scl_level{l}``, ``train/loss_penalty_level{l}``), their values at the chosen rounds.
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from fedrcl.analysis import crossing, load_scalars, plot_runs  # noqa: E402
from fedrcl.analysis.runs import Curve  # noqa: E402
from fedrcl.analysis.seed_stats import value_at as at  # noqa: E402


def accuracy_rows(runs: dict[str, dict[str, Curve]], rounds: list[int]) -> list[str]:
    rows = ["| method | " + " | ".join(str(r) for r in rounds) + " | rounds run |",
            "|---" * (len(rounds) + 2) + "|"]
    for label, scalars in runs.items():
        cells = []
        for r in rounds:
            raw, ema = at(scalars["val/acc"], r), at(scalars["val/acc_ema"], r)
            cells.append("-" if raw is None else f"{100 * raw:.2f} / {100 * ema:.2f}")
        rows.append(f"| {label} | " + " | ".join(cells) + f" | {scalars['val/acc'][0][-1]} |")
    return rows


def crossing_lines(runs: dict[str, dict[str, Curve]]) -> list[str]:
    (ref_label, ref), *others = runs.items()
    lines = []
    for label, scalars in others:
        for tag in ("val/acc_ema", "val/acc"):
            c = crossing(ref[tag], scalars[tag])
            first = "never above" if c.first_above is None else f"first above at round {c.first_above}"
            stays = "not above" if c.above_from is None else f"above from round {c.above_from}"
            lines.append(f"- {label} vs {ref_label}, `{tag}`: {first}; {stays} at round {c.last_common} (last "
                         f"common round), gap there {100 * c.gap_at_last:+.2f} points")
    return lines


def loss_part_rows(label: str, scalars: dict[str, Curve], rounds: list[int]) -> list[str]:
    levels = sorted({int(m.group(1)) for t in scalars if (m := re.fullmatch(r"train/loss_scl_level(\d+)", t))})
    if not levels:
        return []
    rounds = [r for r in rounds if at(scalars["train/loss"], r) is not None]
    rows = [f"{label}, loss parts (mean over the round): CE; then SCL / penalty per level {levels[0]}..{levels[-1]}",
            "", "| round | CE | " + " | ".join(f"level {lv}" for lv in levels) + " |",
            "|---" * (len(levels) + 2) + "|"]
    for r in rounds:
        parts = [f"{at(scalars[f'train/loss_scl_level{lv}'], r):.3f} / "
                 f"{at(scalars[f'train/loss_penalty_level{lv}'], r):.3f}" for lv in levels]
        rows.append(f"| {r} | {at(scalars['train/loss_ce'], r):.3f} | " + " | ".join(parts) + " |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="LABEL=PATH; the first is the reference")
    parser.add_argument("--rounds", type=int, nargs="+", default=[50, 100, 200, 300, 500, 1000])
    parser.add_argument("--out", type=Path, help="PNG of raw and EMA accuracy")
    args = parser.parse_args()
    runs = {}
    for spec in args.runs:
        label, sep, path = spec.partition("=")
        if not sep:
            parser.error(f"runs are LABEL=PATH, got {spec!r}")
        runs[label] = load_scalars(path)
        if "val/acc_ema" not in runs[label]:
            parser.error(f"{path} has no val/acc_ema curve (not a fedrcl run folder?)")
    print("\n".join(accuracy_rows(runs, args.rounds)), end="\n\n")
    print("\n".join(crossing_lines(runs)), end="\n\n")
    for label, scalars in runs.items():
        rows = loss_part_rows(label, scalars, args.rounds)
        if rows:
            print("\n".join(rows), end="\n\n")
    if args.out:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4), layout="constrained")
        for ax, tag, name in zip(axes, ("val/acc", "val/acc_ema"), ("test accuracy", "EMA(0.9) test accuracy")):
            plot_runs(runs, tag, ax=ax, ylabel=name)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.out, dpi=110)


if __name__ == "__main__":
    main()
