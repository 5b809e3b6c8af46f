"""Curves and a markdown table of test accuracy (and its EMA) from TensorBoard runs, mean and band over seeds.

    python bench/plot_results.py FedAvg=runs/cifar10_a01_cnn_fedavg FedRCL=runs/cifar10_a01_cnn_fedrcl \
        --out docs/cnn.png --rounds 25 50 100 200
    python bench/plot_results.py FedAvg=runs/seeds_fedavg FedRCL=runs/seeds_fedrcl --out s.png --band ci

Each LABEL=PATH names a run folder (its versions merged, as after a resume), a single event file, or a
folder of runs of one experiment under several seeds (``fedrcl seeds`` writes ``<name>/seed<k>``): then the
curve is the mean over the seeds at the rounds all of them logged, with a band of +- one sample std
(``--band std``) or the 95% Student-t interval of the mean (``--band ci``). Prints one markdown row per
label: EMA(0.9) accuracy at the given rounds (mean ± std over seeds; "-" where not reached), n and the last
round reached by all.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from fedrcl.analysis import seed_curves, summarize_seeds, t_quantile  # noqa: E402
from fedrcl.analysis.seed_stats import seed_runs  # noqa: E402


def band(values: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """``(mean, half-width)`` per round of ``values[n_seeds, n_rounds]``: std (ddof 1) or 95% t interval."""
    mean = values.mean(axis=0)
    n = values.shape[0]
    if n < 2:
        return mean, np.zeros_like(mean)
    std = values.std(axis=0, ddof=1)
    return mean, (std if kind == "std" else t_quantile(n - 1) * std / np.sqrt(n))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="LABEL=PATH")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rounds", type=int, nargs="+", default=[25, 50, 100, 200])
    parser.add_argument("--band", choices=("std", "ci"), default="std",
                        help="band over seeds: +- sample std, or the 95%% t interval of the mean")
    parser.add_argument("--title", default="")
    args = parser.parse_args()
    fig, (ax_acc, ax_ema) = plt.subplots(1, 2, figsize=(11, 4))
    print("| method | n | " + " | ".join(f"EMA acc @ {r}" for r in args.rounds) + " | rounds run |")
    print("|---" * (len(args.rounds) + 3) + "|")
    seeded = False
    for spec in args.runs:
        label, path = spec.split("=", 1)
        runs = seed_runs(Path(path))
        seeded |= len(runs) > 1
        for ax, tag, width in ((ax_acc, "val/acc", 1.0), (ax_ema, "val/acc_ema", 1.5)):
            rounds, values = seed_curves(runs, tag)
            mean, half = band(100 * values, args.band)
            line, = ax.plot(rounds, mean, label=f"{label} (n={len(runs)})", lw=width)
            if len(runs) > 1:
                ax.fill_between(rounds, mean - half, mean + half, color=line.get_color(), alpha=0.2, lw=0)
        rounds, ema = seed_curves(runs, "val/acc_ema")
        cells = [summarize_seeds(100 * ema[:, list(rounds).index(r)]).format() if r in rounds else "-"
                 for r in args.rounds]
        print(f"| {label} | {len(runs)} | " + " | ".join(cells) + f" | {rounds[-1]} |")
    band_name = "± 1 std over seeds" if args.band == "std" else "95% interval of the mean over seeds"
    for ax, name in ((ax_acc, "test accuracy (%)"), (ax_ema, "EMA(0.9) test accuracy (%)")):
        ax.set_xlabel("round")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
        ax.legend(title=f"band: {band_name}" if seeded else None, fontsize=8, title_fontsize=8)
    fig.suptitle(args.title)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)


if __name__ == "__main__":
    main()
