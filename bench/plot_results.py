"""Curves and a markdown table of test accuracy (and its EMA) from TensorBoard runs.

    python bench/plot_results.py FedAvg=runs/cifar10_a01_cnn_fedavg FedRCL=runs/cifar10_a01_cnn_fedrcl \
        --out docs/cnn.png --rounds 25 50 100 200

Each LABEL=PATH names a run folder (its versions merged, as after a resume) or a single event file. Prints one markdown
row per run: EMA(0.9) accuracy at the given rounds ("-" where the run did not reach them) and the last
round reached.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from fedrcl.analysis import load_scalars  # noqa: E402


def read_curve(path: Path, tag: str) -> dict[int, float]:
    """``{round: value}`` of a scalar tag of a run folder (versions merged) or a single event file."""
    rounds, values = load_scalars(path)[tag]
    return dict(zip(rounds.tolist(), values.tolist()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="LABEL=PATH")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rounds", type=int, nargs="+", default=[25, 50, 100, 200])
    parser.add_argument("--title", default="")
    args = parser.parse_args()
    fig, (ax_acc, ax_ema) = plt.subplots(1, 2, figsize=(11, 4))
    print("| method | " + " | ".join(f"EMA acc @ {r}" for r in args.rounds) + " | rounds run |")
    print("|---" * (len(args.rounds) + 2) + "|")
    for spec in args.runs:
        label, path = spec.split("=", 1)
        acc, ema = read_curve(Path(path), "val/acc"), read_curve(Path(path), "val/acc_ema")
        ax_acc.plot(list(acc), [100 * v for v in acc.values()], label=label, lw=1)
        ax_ema.plot(list(ema), [100 * v for v in ema.values()], label=label, lw=1.5)
        cells = [f"{100 * ema[r]:.2f}" if r in ema else "-" for r in args.rounds]
        print(f"| {label} | " + " | ".join(cells) + f" | {max(ema)} |")
    for ax, name in ((ax_acc, "test accuracy (%)"), (ax_ema, "EMA(0.9) test accuracy (%)")):
        ax.set_xlabel("round")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(args.title)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)


if __name__ == "__main__":
    main()
