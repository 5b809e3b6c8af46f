"""Seconds per paper round: ResNet-18-GN, CIFAR-10 shapes, 5 clients x 50 steps of batch 50, one evaluation.

Three versions of the same round, each for FedAvg and FedRCL (random CIFAR-shaped data, the same on-device
batches and augmentation, SGD with weight decay and clipping, sample-weighted averaging, then top-1 accuracy
of the global model on the test images):

    (a) raw:        a minimal raw-PyTorch eager loop, clients one after another (what a user would write);
    (b) sequential: fedrcl, ``trainer.client_batching off``;
    (c) batched:    fedrcl, ``trainer.client_batching on`` and ``compile_clients`` (unless ``--no-compile``).

Prints the median seconds per round after ``--warmup`` rounds, the ratios to (a), the achieved TFLOP/s (model
FLOPs of the round counted once with ``torch.utils.flop_counter``, over the seconds) and the compile seconds;
the last line is ``speedup=<(a)/(c) for FedRCL>``. The paper's round:

    python bench/gpu_round.py --device cuda --precision bf16-mixed
    python bench/gpu_round.py --device cpu --width 2 --clients 2 --steps 5 --batch 4 --test 64 --rounds 1 \
        --warmup 0 --no-compile --methods FedRCL      # the test suite's smoke run
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from fedrcl.algorithms import FedAvg, FedRCL
from fedrcl.data.augment import to_normalized
from fedrcl.data.datamodule import FederatedDataModule
from fedrcl.federated import batched
from fedrcl.federated.trainer import FederatedTrainer
from fedrcl.losses.relaxed_contrastive import relaxed_contrastive_terms
from fedrcl.models import ResNet18


def write_fake_cifar(root: Path, train: int, test: int) -> None:
    rng = np.random.default_rng(0)
    np.savez(root / "cifar10.npz",
             x_train=rng.integers(0, 256, (train, 32, 32, 3), dtype=np.uint8),
             y_train=rng.integers(0, 10, train).astype(np.int64),
             x_test=rng.integers(0, 256, (test, 32, 32, 3), dtype=np.uint8),
             y_test=rng.integers(0, 10, test).astype(np.int64),
             classes=np.array([str(c) for c in range(10)]))


def datamodule(args, root: Path) -> FederatedDataModule:
    """The data of both loops, in the default layout: ``auto``'s choice on CUDA; on the CPU (the smoke run)
    the raw loop has no trainer to tell ``auto`` that widths below 8 break channels-last."""
    return FederatedDataModule(dataset="cifar10", root=str(root), num_clients=args.clients * 2,
                               partition="iid", batch_size=args.batch,
                               local_iters_per_epoch=args.steps // 5 or 1,
                               eval_batch_size=args.eval_batch, channels_last="off")


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class RoundTimer(L.Callback):
    """Seconds from a round's start to the end of its evaluation."""

    def __init__(self, device: str):
        self.device, self.seconds = device, []

    def on_train_epoch_start(self, trainer, pl_module):
        sync(self.device)
        self._start = time.perf_counter()

    def on_train_epoch_end(self, trainer, pl_module):
        sync(self.device)
        self.seconds.append(time.perf_counter() - self._start)


def fedrcl_rounds(method: type, args, root: Path, batching: str) -> tuple[list[float], float | None]:
    timer = RoundTimer(args.device)
    model = method(backbone=partial(ResNet18, width=args.width), num_classes=10)
    compile_clients = batching == "on" and not args.no_compile
    trainer = FederatedTrainer(
        rounds=args.warmup + args.rounds, clients_per_round=args.clients, local_epochs=5, eval_every=1,
        client_batching=batching, compile_clients=compile_clients, accelerator=args.device, devices=1,
        precision=args.precision, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[timer])
    trainer.fit(model, datamodule=datamodule(args, root))
    return timer.seconds[args.warmup:], trainer.federation.batching.compile_seconds


def raw_loss(net, x, y, rcl: bool):
    out = net(x)
    loss = F.cross_entropy(out.logits, y)
    if rcl:
        terms = [relaxed_contrastive_terms(f, y) for f in out.features]
        loss = loss + sum(s + p for s, p in terms) / len(terms)
    return loss


def raw_rounds(rcl: bool, args, root: Path) -> list[float]:
    device = args.device
    dm = datamodule(args, root)
    dm.setup("fit")
    dm.x_train, dm.y_train, dm.x_test, dm.y_test = (t.to(device) for t in (dm.x_train, dm.y_train, dm.x_test,
                                                                            dm.y_test))
    dm.client_indices = [i.to(device) for i in dm.client_indices]
    net = ResNet18(10, width=args.width).to(device)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, weight_decay=1e-3)
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=args.precision == "bf16-mixed")
    global_state = {k: v.clone() for k, v in net.state_dict().items()}
    seconds = []
    for round_idx in range(args.warmup + args.rounds):
        sync(device)
        start = time.perf_counter()
        total = {k: torch.zeros_like(v) for k, v in global_state.items()}
        rng = np.random.default_rng([0, round_idx])
        for client in rng.choice(dm.num_clients, args.clients, replace=False).tolist():
            net.load_state_dict(global_state)
            opt.state.clear()
            for x, y in dm.client_batches(client, round_idx, 5, 0):
                with autocast:
                    loss = raw_loss(net, x, y, rcl)
                opt.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(net.parameters(), 10.0)
                opt.step()
            for k, v in net.state_dict().items():
                total[k] += v * dm.client_num_samples(client)
        global_state = {k: v / (args.clients * dm.client_num_samples(0)) for k, v in total.items()}
        net.load_state_dict(global_state)
        correct = torch.zeros((), device=device)
        with torch.inference_mode(), autocast:
            for i in range(0, len(dm.y_test), args.eval_batch):
                logits = net(to_normalized(dm.x_test[i:i + args.eval_batch], dm.info)).logits
                correct += (logits.argmax(1) == dm.y_test[i:i + args.eval_batch]).sum()
        correct.item()  # the accuracy a user would print
        sync(device)
        seconds.append(time.perf_counter() - start)
    return seconds[args.warmup:]


def round_flops(rcl: bool, args) -> float:
    """Model FLOPs of one round: clients x steps training steps (forward + backward) and one evaluation."""
    net = ResNet18(10, width=args.width)
    x, y = torch.randn(args.batch, 3, 32, 32), torch.randint(0, 10, (args.batch,))
    with FlopCounterMode(display=False) as train:
        raw_loss(net, x, y, rcl).backward()
    with FlopCounterMode(display=False) as evaluation, torch.no_grad():
        net(x[:1])
    steps = args.clients * 5 * (args.steps // 5 or 1)
    return steps * train.get_total_flops() + args.test * evaluation.get_total_flops()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--width", type=int, default=64, help="ResNet-18 width (paper: 64)")
    parser.add_argument("--clients", type=int, default=5)
    parser.add_argument("--steps", type=int, default=50, help="local steps per client (5 local epochs)")
    parser.add_argument("--batch", type=int, default=50)
    parser.add_argument("--test", type=int, default=10000, help="test images evaluated each round")
    parser.add_argument("--eval-batch", type=int, default=2500)
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (median)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first (compilation)")
    parser.add_argument("--precision", default="32-true", help="Lightning precision, e.g. bf16-mixed")
    parser.add_argument("--no-compile", action="store_true", help="(c) without torch.compile")
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend of (c)")
    parser.add_argument("--methods", default="FedAvg,FedRCL")
    args = parser.parse_args()
    batched.COMPILE_BACKEND = args.compile_backend
    torch.set_float32_matmul_precision("high")
    L.seed_everything(0, verbose=False)
    methods = {"FedAvg": (FedAvg, False), "FedRCL": (FedRCL, True)}
    print(f"ResNet-18-GN width {args.width}, {args.clients} clients x {args.steps} steps of batch "
          f"{args.batch}, {args.test} test images, {args.device}, {args.precision}, "
          f"median of {args.rounds} rounds")
    speedup = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_fake_cifar(root, train=args.clients * 2 * args.batch * (args.steps // 5 or 1), test=args.test)
        for name in args.methods.split(","):
            method, rcl = methods[name]
            flops = round_flops(rcl, args)
            raw = statistics.median(raw_rounds(rcl, args, root))
            seq = statistics.median(fedrcl_rounds(method, args, root, "off")[0])
            bat_rounds, compile_s = fedrcl_rounds(method, args, root, "on")
            bat = statistics.median(bat_rounds)
            speedup[name] = raw / bat
            label = "batched" + ("" if args.no_compile else "+compiled")
            print(f"{name}: (a) raw {raw:.3f} s/round; (b) sequential {seq:.3f} s/round = "
                  f"{seq / raw:.2f} x (a); (c) {label} {bat:.3f} s/round = {bat / raw:.2f} x (a)")
            print(f"{name}: {flops / 1e9:.3g} GFLOP/round; TFLOP/s (a) {flops / raw / 1e12:.3g} "
                  f"(b) {flops / seq / 1e12:.3g} (c) {flops / bat / 1e12:.3g}; compile "
                  f"{'-' if compile_s is None else f'{compile_s:.1f}'} s")
    print(f"speedup={speedup.get('FedRCL', float('nan')):.2f}")


if __name__ == "__main__":
    main()
