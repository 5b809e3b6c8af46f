"""Seconds per round of fedrcl against a minimal raw-PyTorch loop doing the same work.

Same work: small CNN, 5 clients x 50 local steps (5 local epochs x 10) of batch 50 on CIFAR-shaped random
data, the same on-device batch gather and augmentation, SGD with weight decay and clipping, sample-weighted
averaging; FedAvg (cross-entropy) and FedRCL (cross-entropy + relaxed contrastive loss on every level).
Framework and raw rounds alternate in one process; the first round of each block is a warm-up. Prints the
median seconds per round of each and, last, ``overhead_ratio=<framework/raw>`` over both methods.

    python bench/round_overhead.py [--device cpu|cuda] [--blocks 4] [--rounds 3] [--client-batching on|off]
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


class RoundTimer(L.Callback):
    def __init__(self):
        self.seconds: list[float] = []

    def on_train_epoch_start(self, trainer, pl_module):
        self._start = time.perf_counter()

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()
        self.seconds.append(time.perf_counter() - self._start)


def framework_rounds(method: type, root: Path, device: str, rounds: int, client_batching: str) -> list[float]:
    timer = RoundTimer()
    dm = FederatedDataModule(dataset="cifar10", root=str(root), num_clients=50, partition="iid", batch_size=50,
                             local_iters_per_epoch=10)
    model = method(backbone=SmallCNN, num_classes=10)
    trainer = FederatedTrainer(rounds=rounds, clients_per_round=5, local_epochs=5, eval_every=10 ** 6,
                               client_batching=client_batching, accelerator=device, devices=1, logger=False,
                               enable_checkpointing=False, enable_progress_bar=False,
                               enable_model_summary=False, limit_val_batches=0, callbacks=[timer])
    trainer.fit(model, datamodule=dm)
    return timer.seconds[1:]


def raw_rounds(rcl: bool, root: Path, device: str, rounds: int) -> list[float]:
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
        start = time.perf_counter()
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
        if device == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return seconds[1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3, help="rounds per block (the first is a warm-up)")
    parser.add_argument("--client-batching", default="auto", help="fedrcl's trainer.client_batching")
    args = parser.parse_args()
    L.seed_everything(0, verbose=False)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_fake_cifar(root)
        times = {}
        for name, method, rcl in (("FedAvg", FedAvg, False), ("FedRCL", FedRCL, True)):
            fw, raw = [], []
            for _ in range(args.blocks):
                fw += framework_rounds(method, root, args.device, args.rounds, args.client_batching)
                raw += raw_rounds(rcl, root, args.device, args.rounds)
            times[name] = (statistics.median(fw), statistics.median(raw))
            print(f"{name}: framework {times[name][0]:.3f} s/round, raw {times[name][1]:.3f} s/round, "
                  f"ratio {times[name][0] / times[name][1]:.3f} ({len(fw)} rounds each, {args.device})")
    print(f"overhead_ratio={sum(f for f, _ in times.values()) / sum(r for _, r in times.values()):.3f}")


if __name__ == "__main__":
    main()
