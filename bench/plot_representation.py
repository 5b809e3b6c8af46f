"""Effective rank and VCI per feature level from runs logged with RepresentationMonitor (Figures 2-3).

    python bench/plot_representation.py FedAvg=runs/cifar10_a01_cnn_fedavg_monitor \
        FedSCL=runs/cifar10_a01_cnn_fedscl_monitor --out docs/repr_cnn.png --rounds 5 25 50 100 200

writes docs/repr_cnn_effective_rank.png, docs/repr_cnn_vci.png (and ``_local`` ones).

Draws one row per (metric, model): effective rank and VCI of the global model's features, and, where the
runs logged them, of the round's last local model; one panel per level, one curve per run. Prints a
markdown table per metric: the value at each given round, per run and level ("-" where not logged).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from fedrcl.analysis import load_scalars, plot_levels  # noqa: E402


def table(runs: dict, prefix: str, metric: str, rounds: list[int]) -> str:
    """Markdown rows: ``| run | level | value @ round ... |`` for ``{prefix}{l}/{metric}``."""
    lines = [f"| {metric} ({'local' if 'local' in prefix else 'global'}) | level | "
             + " | ".join(f"@ {r}" for r in rounds) + " |", "|---" * (len(rounds) + 2) + "|"]
    for name, curves in runs.items():
        tags = sorted(t for t in curves if t.startswith(prefix) and t.endswith("/" + metric))
        for tag in tags:
            by_round = dict(zip(curves[tag][0].tolist(), curves[tag][1].tolist()))
            level = tag[len(prefix):].split("/")[0]
            cells = [f"{by_round[r]:.3f}" if r in by_round else "-" for r in rounds]
            lines.append(f"| {name} | {level} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="LABEL=PATH (a run folder or a single event file)")
    parser.add_argument("--out", type=Path, required=True,
                        help="PNG name stem: writes <stem>_<metric>[_local].png beside it")
    parser.add_argument("--rounds", type=int, nargs="+", default=[5, 25, 50, 100, 200])
    args = parser.parse_args()
    runs = {label: load_scalars(Path(path)) for label, path in (spec.split("=", 1) for spec in args.runs)}
    has_local = any(tag.startswith("repr/local/") for curves in runs.values() for tag in curves)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for metric in ("effective_rank", "vci"):
        for local in (False, True) if has_local else (False,):
            fig = plot_levels(runs, metric, local=local)
            fig.suptitle(f"{metric} of the {'last local' if local else 'global'} model's features")
            out = args.out.with_name(f"{args.out.stem}_{metric}{'_local' if local else ''}.png")
            fig.savefig(out, dpi=100)
            plt.close(fig)
            print(f"\n{out}\n")
            print(table(runs, "repr/local/level" if local else "repr/level", metric, args.rounds))


if __name__ == "__main__":
    main()
