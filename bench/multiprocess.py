"""Seconds per round of one process with 2 threads against 2 processes with 1 thread each (CPU, gloo).

Workload W of ``bench/round_overhead.py``: small CNN, 5 clients x 50 local steps (5 local epochs x 10) of
batch 50 on CIFAR-shaped random data, FedAvg. The 2-process run is ``FederatedTrainer(devices=2,
strategy="ddp")`` (``FederatedStrategy``): 3 clients on rank 0, 2 on rank 1, one all-reduce per tensor at
the round's end. Each configuration runs as a worker command of its own (Lightning's launcher starts the
second process), the two alternate ``--blocks`` times in one run, and a round is timed on rank 0 from its
start (after Lightning's per-round barrier) to its end (after the aggregation, which waits for every
process); the first round of each worker is a warm-up. Prints the median seconds per round of each and,
last, ``speedup=<1 process / 2 processes>``.

    python bench/multiprocess.py [--blocks 3] [--rounds 4]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CONFIGS = {"1 process x 2 threads": (1, 2), "2 processes x 1 thread": (2, 1)}


def worker(root: Path, devices: int, rounds: int, out: Path) -> None:
    """Train ``rounds`` rounds of workload W on ``devices`` CPU processes; rank 0 writes the round times."""
    import lightning as L
    import torch

    from fedrcl.algorithms import FedAvg
    from fedrcl.data.datamodule import FederatedDataModule
    from fedrcl.federated.trainer import FederatedTrainer
    from fedrcl.models import SmallCNN
    from round_overhead import RoundTimer

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    L.seed_everything(0, verbose=False)
    timer = RoundTimer()
    dm = FederatedDataModule(dataset="cifar10", root=str(root), num_clients=50, partition="iid",
                             batch_size=50, local_iters_per_epoch=10)
    trainer = FederatedTrainer(rounds=rounds, clients_per_round=5, local_epochs=5, eval_every=10 ** 6,
                               accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto",
                               logger=False, enable_checkpointing=False, enable_progress_bar=False,
                               enable_model_summary=False, limit_val_batches=0, callbacks=[timer])
    trainer.fit(FedAvg(backbone=SmallCNN, num_classes=10), datamodule=dm)
    if trainer.is_global_zero:
        out.write_text(json.dumps({"seconds": timer.seconds[1:], "world_size": trainer.world_size}))


def run_worker(root: Path, devices: int, threads: int, rounds: int) -> list[float]:
    out = root / "times.json"
    out.unlink(missing_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    subprocess.run([sys.executable, __file__, "--worker", "--root", str(root), "--devices", str(devices),
                    "--rounds", str(rounds)], env=env, check=True, timeout=1800,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    result = json.loads(out.read_text())
    assert result["world_size"] == devices
    return result["seconds"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=3, help="alternations of the two configurations")
    parser.add_argument("--rounds", type=int, default=4, help="rounds per worker (the first is a warm-up)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--devices", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.root, args.devices, args.rounds, args.root / "times.json")
        return
    from round_overhead import write_fake_cifar

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_fake_cifar(root)
        seconds: dict[str, list[float]] = {name: [] for name in CONFIGS}
        for _ in range(args.blocks):
            for name, (devices, threads) in CONFIGS.items():
                seconds[name] += run_worker(root, devices, threads, args.rounds)
    medians = {name: statistics.median(s) for name, s in seconds.items()}
    for name, median in medians.items():
        print(f"{name}: {median:.3f} s/round (median of {len(seconds[name])} rounds: "
              f"{', '.join(f'{s:.2f}' for s in seconds[name])})")
    one, two = medians.values()
    print(f"speedup={one / two:.3f}")


if __name__ == "__main__":
    main()
