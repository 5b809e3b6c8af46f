"""Seconds per round of fedrcl against a minimal raw-PyTorch loop doing the same work.

Same work: small CNN, 5 clients x 50 local steps (5 local epochs x 10) of batch 50 on CIFAR-shaped random
data, the same on-device batch gather and augmentation, SGD with weight decay and clipping, sample-weighted
averaging; FedAvg (cross-entropy) and FedRCL (cross-entropy + relaxed contrastive loss on every level).
The machine is noisy (2 shared vCPUs move a single ratio by 0.05-0.1), so the measurement is made of
*pairs*: a pair runs one block of framework rounds and one block of raw rounds for each method, the order
alternating from pair to pair (framework first, then raw first), and the first round of every block is a
warm-up. Each pair gives one ratio, framework seconds over raw seconds summed over both methods, by wall
clock and by CPU time of this process (``time.process_time``: what other jobs on the cores take is not
counted). Prints every pair, then per method and overall the median ratio over pairs with its spread
(min-max), and last ``overhead_ratio=<median wall ratio>``.

    python bench/round_overhead.py [--device cpu|cuda] [--pairs 5] [--rounds 3] [--client-batching on|off]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F

from fedrcl.algorithms import FedAvg, FedRCL
from fedrcl.data.datamodule import FederatedDataModule
from fedrcl.federated.trainer import FederatedTrainer
from fedrcl.losses.relaxed_contrastive import relaxed_contrastive_terms
from fedrcl.models import SmallCNN


def write_fake_cifar(root: Path) -> None:
    rng = np.random.default_rng(0)
    np.savez(root / "cifar10.npz",
             x_train=rng.integers(0, 256, (25000, 32, 32, 3), dtype=np.uint8),
             y_train=rng.integers(0, 10, 25000).astype(np.int64),
             x_test=rng.integers(0, 256, (100, 32, 32, 3), dtype=np.uint8),
             y_test=rng.integers(0, 10, 100).astype(np.int64),
             classes=np.array([str(c) for c in range(10)]))


def clocks() -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds)."""
    return time.perf_counter(), time.process_time()


def elapsed(start: tuple[float, float], device: str) -> tuple[float, float]:
    """Wall and CPU seconds since ``start`` (after the GPU's queued work is done)."""
    if device == "cuda":
        torch.cuda.synchronize()
    wall, cpu = clocks()
    return wall - start[0], cpu - start[1]


class RoundTimer(L.Callback):
    def __init__(self):
        self.seconds: list[tuple[float, float]] = []

    def on_train_epoch_start(self, trainer, pl_module):
        self._start = clocks()

    def on_train_epoch_end(self, trainer, pl_module):
        self.seconds.append(elapsed(self._start, trainer.strategy.root_device.type))


def timed(method: type) -> type:
    """``method`` timing each round from its own round hooks (after the callbacks' round start, before its
    round-end logging). A timing callback would cost the framework side Lightning's dispatch of six hooks
    per step (about 60 Python calls), which the raw loop does not pay."""

    class Timed(method):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.round_seconds: list[tuple[float, float]] = []

        def on_train_epoch_start(self):
            super().on_train_epoch_start()
            self._round_start = clocks()

        def on_train_epoch_end(self):
            self.round_seconds.append(elapsed(self._round_start, self.device.type))
            super().on_train_epoch_end()

    return Timed


def framework_rounds(method: type, root: Path, device: str, rounds: int,
                     client_batching: str) -> list[tuple[float, float]]:
    dm = FederatedDataModule(dataset="cifar10", root=str(root), num_clients=50, partition="iid", batch_size=50,
                             local_iters_per_epoch=10)
    model = timed(method)(backbone=SmallCNN, num_classes=10)
    trainer = FederatedTrainer(rounds=rounds, clients_per_round=5, local_epochs=5, eval_every=10 ** 6,
                               client_batching=client_batching, accelerator=device, devices=1, logger=False,
                               enable_checkpointing=False, enable_progress_bar=False,
                               enable_model_summary=False, limit_val_batches=0)
    trainer.fit(model, datamodule=dm)
    return model.round_seconds[1:]


def raw_rounds(rcl: bool, root: Path, device: str, rounds: int) -> list[tuple[float, float]]:
    dm = FederatedDataModule(dataset="cifar10", root=str(root), num_clients=50, partition="iid", batch_size=50,
                             local_iters_per_epoch=10)
    dm.setup("fit")
    dm.x_train, dm.y_train = dm.x_train.to(device), dm.y_train.to(device)
    dm.client_indices = [i.to(device) for i in dm.client_indices]
    net = SmallCNN(10).to(device)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, weight_decay=1e-3)
    global_state = {k: v.clone() for k, v in net.state_dict().items()}
    seconds = []
    for round_idx in range(rounds):
        start = clocks()
        total = {k: torch.zeros_like(v) for k, v in global_state.items()}
        rng = np.random.default_rng([0, round_idx])
        for client in rng.choice(dm.num_clients, 5, replace=False).tolist():
            net.load_state_dict(global_state)
            opt.state.clear()
            for x, y in dm.client_batches(client, round_idx, 5, 0):
                out = net(x)
                loss = F.cross_entropy(out.logits, y)
                if rcl:
                    terms = [relaxed_contrastive_terms(f, y) for f in out.features]
                    loss = loss + sum(s + p for s, p in terms) / len(terms)
                opt.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(net.parameters(), 10.0)
                opt.step()
            for k, v in net.state_dict().items():
                total[k] += v * dm.client_num_samples(client)
        global_state = {k: v / (5 * dm.client_num_samples(0)) for k, v in total.items()}
        seconds.append(elapsed(start, device))
    return seconds[1:]


def block_seconds(rounds: list[tuple[float, float]]) -> tuple[float, float]:
    """Median wall and CPU seconds per round of one block."""
    return statistics.median(w for w, _ in rounds), statistics.median(c for _, c in rounds)


def summary(ratios: list[float]) -> str:
    """Median over pairs with its spread."""
    low, high = min(ratios), max(ratios)
    return f"{statistics.median(ratios):.3f} (min {low:.3f}, max {high:.3f}, {len(ratios)} pairs)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--pairs", type=int, default=5, help="framework/raw pairs per method")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per block (the first is a warm-up)")
    parser.add_argument("--client-batching", default="auto", help="fedrcl's trainer.client_batching")
    args = parser.parse_args()
    if args.rounds < 2:
        parser.error("--rounds must be >= 2 (the first round of a block is a warm-up)")
    L.seed_everything(0, verbose=False)
    methods = (("FedAvg", FedAvg, False), ("FedRCL", FedRCL, True))
    ratios: dict[str, list[float]] = {f"{m} {clock}": [] for m in ("FedAvg", "FedRCL", "all")
                                      for clock in ("wall", "cpu")}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_fake_cifar(root)
        for pair in range(args.pairs):
            sums = {"fw": [0.0, 0.0], "raw": [0.0, 0.0]}
            for name, method, rcl in methods:
                order = ("fw", "raw") if pair % 2 == 0 else ("raw", "fw")
                seconds = {}
                for kind in order:
                    rounds = (framework_rounds(method, root, args.device, args.rounds, args.client_batching)
                              if kind == "fw" else raw_rounds(rcl, root, args.device, args.rounds))
                    seconds[kind] = block_seconds(rounds)
                for kind in ("fw", "raw"):
                    sums[kind][0] += seconds[kind][0]
                    sums[kind][1] += seconds[kind][1]
                for i, clock in enumerate(("wall", "cpu")):
                    ratios[f"{name} {clock}"].append(seconds["fw"][i] / seconds["raw"][i])
                print(f"pair {pair} {name} ({'framework first' if order[0] == 'fw' else 'raw first'}): "
                      f"framework {seconds['fw'][0]:.3f} s wall / {seconds['fw'][1]:.3f} s cpu, "
                      f"raw {seconds['raw'][0]:.3f} / {seconds['raw'][1]:.3f}", flush=True)
            for i, clock in enumerate(("wall", "cpu")):
                ratios[f"all {clock}"].append(sums["fw"][i] / sums["raw"][i])
    for key, values in ratios.items():
        print(f"{key} ratio: median {summary(values)}")
    print(f"cpu_ratio={statistics.median(ratios['all cpu']):.3f}")
    print(f"overhead_ratio={statistics.median(ratios['all wall']):.3f}")


if __name__ == "__main__":
    main()
