"""Seconds per round of the quickstart through Flower, over ``fedrcl fit``, measured in one run of this script.

Runs of the same config (``configs/quickstart.yaml``: FedRCL, small CNN, digits, shrunk by default to 10
clients, 3 per round, 1 local epoch, 5 rounds; its analysis callback off; each in a fresh process so
start-up counts alike): ``fedrcl fit``; Flower's simulation (``python -m fedrcl.flower``, Ray, one actor); a
localhost deployment (``fedrcl.flower.localhost``: a SuperLink and ``--nodes`` SuperNodes as processes,
``flwr run``; one ``train`` message per node and round). All give the same weights (tests/test_flower.py;
checked here for the deployment). Per run: the whole wall time (start-up included) and the median
``time/round_wall_seconds`` of rounds 2.. (the steady state: Ray's and the first ClientApp's start-up fall
in round 1); both as ratios over ``fedrcl fit``. Then where a deployed round's seconds go, from the nodes'
worker logs (``fedrcl.flower.worker``): once per node, the worker's imports and the run's build (at the
``query``); per ``train`` message, the ClientApp process's start-up (its age when it forwarded the message)
and the worker's answer (training included); the rest of a round is Flower's (its polling and transfers,
the server's aggregation and evaluation). Last ``deploy_overhead_s=<median deployed minus median fit
seconds per round>``.

    OMP_NUM_THREADS=1 python bench/flower_cost.py [--rounds 5] [--clients 10] [--per-round 3]
        [--local-epochs 1] [--nodes 2] [--no-simulation]
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from fedrcl.analysis.runs import load_scalars
from fedrcl.flower.localhost import QUIET, LocalDeployment

REPO = Path(__file__).resolve().parents[1]


def args_for(tmp: Path, folder: str, opts: argparse.Namespace) -> list[str]:
    return ["--config", str(REPO / "configs" / "quickstart.yaml"), "--data.root", str(tmp / "data"),
            "--trainer.rounds", str(opts.rounds), "--data.num_clients", str(opts.clients),
            "--trainer.clients_per_round", str(opts.per_round), "--trainer.local_epochs", str(opts.local_epochs),
            "--trainer.callbacks", "[]", "--trainer.enable_progress_bar", "false",
            "--trainer.logger.init_args.save_dir", str(tmp / folder)]


def steady_round(run: Path) -> float:
    rounds, seconds = load_scalars(run / "quickstart" / "version_0")["time/round_wall_seconds"]
    return statistics.median(s for r, s in zip(rounds, seconds) if r > 1)


def final_weights(run: Path) -> dict[str, torch.Tensor]:
    path = run / "quickstart" / "version_0" / "checkpoints" / "last.ckpt"
    return torch.load(path, map_location="cpu", weights_only=True)["state_dict"]


def worker_seconds(temp: Path) -> dict[str, list[float]]:
    """Seconds from the deployment's worker logs (under the nodes' temp folder ``temp``), by kind."""
    patterns = {"imports": r"imported fedrcl's node handlers in ([\d.]+) s",
                "build": r"built the client run of Flower run \d+ \(\w+\) in ([\d.]+) s",
                "clientapp start-up": r"train message of run \d+ answered in [\d.]+ s \(its ClientApp sent it "
                                      r"([\d.]+) s after starting\)",
                "worker answer": r"train message of run \d+ answered in ([\d.]+) s"}
    text = "".join(log.read_text() for log in sorted(temp.glob("fedrcl-flower/worker-*/worker.log")))
    return {kind: [float(s) for s in re.findall(pattern, text)] for kind, pattern in patterns.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--per-round", type=int, default=3)
    parser.add_argument("--local-epochs", type=int, default=1)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--no-simulation", action="store_true", help="only fedrcl fit and the deployment")
    opts = parser.parse_args()
    env = {**os.environ, **QUIET}
    results: dict[str, tuple[float, float]] = {}
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        commands = {"fit": ("fedrcl fit", [sys.executable, "-m", "fedrcl.cli", "fit"]),
                    "simulation": ("flower simulation", [sys.executable, "-m", "fedrcl.flower"])}
        if opts.no_simulation:
            del commands["simulation"]
        for folder, (mode, command) in commands.items():
            started = time.perf_counter()
            subprocess.run([*command, *args_for(tmp, folder, opts)], check=True, env=env, cwd=tmp,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=3600)
            results[mode] = time.perf_counter() - started, steady_round(tmp / folder)
        deployed = f"flower localhost ({opts.nodes} SuperNodes)"
        started = time.perf_counter()
        (tmp / "node_temp").mkdir()  # the nodes' temp folder: their state-dir, their workers' logs
        node_env = {"TMPDIR": str(tmp / "node_temp")}
        with LocalDeployment(opts.nodes, workdir=tmp / "deployment", env=node_env) as deployment:
            deployment.run(args_for(tmp, "localhost", opts), timeout=3600)
        results[deployed] = time.perf_counter() - started, steady_round(tmp / "localhost")
        seconds = worker_seconds(tmp / "node_temp")
        a, b = final_weights(tmp / "fit"), final_weights(tmp / "localhost")
        equal = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    wall0, round0 = results["fedrcl fit"]
    print(f"quickstart, {opts.clients} clients, {opts.per_round} per round, {opts.local_epochs} local epochs, "
          f"{opts.rounds} rounds, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    print(f"{'run':<34} {'wall s':>8} {'s/round':>8} {'wall ratio':>10} {'round ratio':>11}")
    for mode, (wall, per_round) in results.items():
        print(f"{mode:<34} {wall:8.1f} {per_round:8.2f} {wall / wall0:10.2f} {per_round / round0:11.2f}")
    print(f"deployment's final weights equal fedrcl fit's: {equal}")
    print("where a deployed round's seconds go (nodes' worker logs; median over messages, once: per node):")
    for kind in ("imports", "build"):
        print(f"  once per node, the worker's {kind}: {', '.join(f'{s:.2f}' for s in seconds[kind])} s")
    per_message = {kind: statistics.median(seconds[kind]) if seconds[kind] else float("nan")
                   for kind in ("clientapp start-up", "worker answer")}
    for kind, value in per_message.items():
        print(f"  per train message, {kind}: {value:.2f} s ({len(seconds[kind])} messages)")
    rest = results[deployed][1] - sum(per_message.values())
    print(f"  the rest of a round (Flower's polling and transfers, aggregation, evaluation): {rest:.2f} s")
    print(f"deploy_overhead_s={results[deployed][1] - round0:.2f}")


if __name__ == "__main__":
    main()
