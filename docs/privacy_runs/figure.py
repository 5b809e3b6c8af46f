"""The "Privacy (CPU)" figure: accuracy EMA at the last round against epsilon, per method, mean and std over seeds.

Reads the TensorBoard scalars of the runs of ``docs/privacy_runs/run.sh`` (``<method>_z<noise>/seed<k>``); the
runs without DP (``_znone``) are drawn as dashed lines. From the repository root:
``python docs/privacy_runs/figure.py docs/privacy_runs docs/results_privacy_cpu``; prints the table it draws.
"""
from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402


def last_value(run: Path, tag: str) -> float:
    """``tag`` at the last round the run (``<name>/seed<k>``, one version) logged."""
    events = EventAccumulator(str(next(run.glob("version_*"))))
    events.Reload()
    return float(events.Scalars(tag)[-1].value)


def rounds_run(run: Path) -> int:
    events = EventAccumulator(str(next(run.glob("version_*"))))
    events.Reload()
    return int(events.Scalars("val/acc")[-1].step)


def main(runs_dir: str, out: str) -> None:
    groups: dict[tuple[str, str], list[Path]] = {}
    for folder in sorted(Path(runs_dir).iterdir()):
        if folder.is_dir() and "_z" in folder.name:
            method, noise = folder.name.split("_z")
            groups[method, noise] = sorted(p for p in folder.glob("seed*") if p.is_dir())
    print("| method | noise multiplier | epsilon | val/acc_ema (%) | val/acc (%) | seeds |")
    print("|:--|--:|--:|--:|--:|--:|")
    figure, axis = plt.subplots(figsize=(6, 4))
    names = {"fedavg": "FedAvg", "fedrcl": "FedRCL"}
    for (method, color) in (("fedavg", "C0"), ("fedrcl", "C1")):
        points = []
        for (m, noise), seeds in sorted(groups.items()):
            if m != method:
                continue
            ema = np.array([100 * last_value(s, "val/acc_ema") for s in seeds])
            acc = np.array([100 * last_value(s, "val/acc") for s in seeds])
            eps = last_value(seeds[0], "privacy/epsilon") if noise != "none" else float("inf")
            print(f"| {names[method]} | {noise} | {eps:.2f} | {ema.mean():.2f} ± {ema.std(ddof=1):.2f} | "
                  f"{acc.mean():.2f} ± {acc.std(ddof=1):.2f} | {len(seeds)} |")
            if noise == "none":
                axis.axhline(ema.mean(), color=color, linestyle="--", label=f"{names[method]} without DP")
            else:
                points.append((eps, ema.mean(), ema.std(ddof=1)))
        points.sort()
        axis.errorbar([p[0] for p in points], [p[1] for p in points], yerr=[p[2] for p in points], color=color,
                      marker="o", capsize=3, label=f"{names[method]} + DP-FedAvg")
    axis.axhline(10, color="grey", linestyle=":", label="chance")
    axis.set_xscale("log")
    rounds = rounds_run(next(iter(groups.values()))[0])
    axis.set_xlabel(f"epsilon after {rounds} rounds (delta 1e-4)")
    axis.set_ylabel(f"val/acc_ema at round {rounds} (%)")
    axis.set_title("Digits, 479 clients, 48 a round, ResNet-18-GN width 2, 3 seeds")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(f"{out}.png", dpi=120)
    print(f"\n{out}.png")


if __name__ == "__main__":
    main(*sys.argv[1:3])
