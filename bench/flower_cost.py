"""Seconds per round of the quickstart through Flower, over ``fedrcl fit``, measured in one run of this script.

Three runs of the same config (``configs/quickstart.yaml``: FedRCL, small CNN, digits, 20 clients, 5 per
round, 2 local epochs; ``--rounds`` rounds, its analysis callback off, each in a fresh process so start-up
counts alike): ``fedrcl fit``; Flower's simulation (``python -m fedrcl.flower``, Ray, one actor); a localhost
deployment (``fedrcl.flower.localhost``: a SuperLink and ``--nodes`` SuperNodes as processes, ``flwr run``).
All three give the same weights (tests/test_flower.py). Per run: the whole wall time (start-up included)
and the median ``time/round_wall_seconds`` of rounds 2.. (the steady state: Ray's and the first ClientApp's
start-up fall in round 1); then both as ratios over ``fedrcl fit``.

    python bench/flower_cost.py [--rounds 4] [--nodes 2]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fedrcl.analysis.runs import load_scalars
from fedrcl.flower.localhost import QUIET, LocalDeployment

REPO = Path(__file__).resolve().parents[1]


def args_for(tmp: Path, folder: str, rounds: int) -> list[str]:
    return ["--config", str(REPO / "configs" / "quickstart.yaml"), "--data.root", str(tmp / "data"),
            "--trainer.rounds", str(rounds), "--trainer.callbacks", "[]", "--trainer.enable_progress_bar", "false",
            "--trainer.logger.init_args.save_dir", str(tmp / folder)]


def steady_round(run: Path) -> float:
    rounds, seconds = load_scalars(run / "quickstart" / "version_0")["time/round_wall_seconds"]
    return statistics.median(s for r, s in zip(rounds, seconds) if r > 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--nodes", type=int, default=2)
    opts = parser.parse_args()
    env = {**os.environ, **QUIET}
    results: dict[str, tuple[float, float]] = {}
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        commands = {"fit": ("fedrcl fit", [sys.executable, "-m", "fedrcl.cli", "fit"]),
                    "simulation": ("flower simulation", [sys.executable, "-m", "fedrcl.flower"])}
        for folder, (mode, command) in commands.items():
            started = time.perf_counter()
            subprocess.run([*command, *args_for(tmp, folder, opts.rounds)], check=True, env=env, cwd=tmp,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=3600)
            results[mode] = time.perf_counter() - started, steady_round(tmp / folder)
        mode = f"flower localhost ({opts.nodes} SuperNodes)"
        started = time.perf_counter()
        with LocalDeployment(opts.nodes, workdir=tmp / "deployment") as deployment:
            deployment.run(args_for(tmp, "localhost", opts.rounds), timeout=3600)
        results[mode] = time.perf_counter() - started, steady_round(tmp / "localhost")
    wall0, round0 = results["fedrcl fit"]
    print(f"quickstart, {opts.rounds} rounds, {os.cpu_count()} CPUs")
    print(f"{'run':<34} {'wall s':>8} {'s/round':>8} {'wall ratio':>10} {'round ratio':>11}")
    for mode, (wall, per_round) in results.items():
        print(f"{mode:<34} {wall:8.1f} {per_round:8.2f} {wall / wall0:10.2f} {per_round / round0:11.2f}")


if __name__ == "__main__":
    main()
