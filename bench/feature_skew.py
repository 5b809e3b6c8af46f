"""The cost of feature skew in the batch path: a local training step with each shift against one without.

Builds a CIFAR-shaped data module (random uint8 images, 10 classes, 5 clients) once per shift, on the device,
and times a client's step as the round makes it: the batch gathered by index, augmented and shifted on the device
(``FederatedDataModule.client_batches``), then forward, loss, backward and SGD of the small CNN (batch 50). The
shifts and the plain data alternate in blocks within one process; prints per shift the median milliseconds per
step by this process's CPU time (``time.process_time``: less shaken by other work on shared cores than wall time),
the median milliseconds of making the batch alone (gather, augmentation, shift), ``ratio=<shift / none>`` of the
step, and last ``mean_ratio=`` over the shifts.

    OMP_NUM_THREADS=1 python bench/feature_skew.py [--device cpu|cuda] [--repeats 5] [--severity 3]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from fedrcl.data.datamodule import FederatedDataModule
from fedrcl.data.feature_skew import SEVERITIES
from fedrcl.models import SmallCNN


def steps_seconds(dm: FederatedDataModule, model: torch.nn.Module, device: str, steps: int,
                  train: bool = True) -> float:
    """CPU seconds per step over ``steps`` steps of client 0 (batches made as in a round); ``train=False``:
    making the batches alone. On CUDA, wall seconds."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = dm.client_batches(0, round_idx=0, local_epochs=100, seed=0)
    clock = time.perf_counter if device == "cuda" else time.process_time
    if device == "cuda":
        torch.cuda.synchronize()
    start = clock()
    for _ in range(steps):
        x, y = next(batches)
        if train:
            loss = F.cross_entropy(model(x).logits, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    if device == "cuda":
        torch.cuda.synchronize()
    return (clock() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=5, help="timed blocks of each shift (alternating)")
    parser.add_argument("--steps", type=int, default=20, help="steps per block")
    parser.add_argument("--severity", type=int, default=3)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "cifar_shaped.npz"
        y = np.repeat(np.arange(10), 100)
        np.savez(path, x_train=rng.integers(0, 256, (1000, 32, 32, 3), dtype=np.uint8), y_train=y,
                 x_test=rng.integers(0, 256, (100, 32, 32, 3), dtype=np.uint8), y_test=y[::10])
        kinds = [k for k in SEVERITIES if k != "none"]
        modules = {}
        for kind in ["none", *kinds]:
            dm = FederatedDataModule("npz", str(path), num_clients=5, partition="iid", batch_size=50,
                                     feature_skew=[kind], feature_skew_severity=args.severity)
            dm.setup("validate")
            for name in ("x_train", "y_train", "x_test", "y_test"):
                setattr(dm, name, getattr(dm, name).to(args.device))
            dm.client_indices = [p.to(args.device) for p in dm.client_indices]
            if dm.shifts is not None and dm.shifts[0].offset is not None:
                dm.shifts = [type(s)(s.kind, s.severity, s.offset.to(args.device), s.sign) for s in dm.shifts]
            modules[kind] = dm
    torch.manual_seed(0)
    model = SmallCNN(10).to(args.device)
    for dm in modules.values():  # warm-up
        steps_seconds(dm, model, args.device, 3)
    times: dict[str, list[float]] = {k: [] for k in modules}
    batch_times: dict[str, list[float]] = {k: [] for k in modules}
    for _ in range(args.repeats):
        for kind, dm in modules.items():
            times[kind].append(steps_seconds(dm, model, args.device, args.steps))
            batch_times[kind].append(steps_seconds(dm, model, args.device, args.steps, train=False))
    base = statistics.median(times["none"])
    print(f"none: {1000 * base:.2f} ms/step, batch {1000 * statistics.median(batch_times['none']):.2f} ms (small "
          f"CNN, batch 50, 32x32x3, severity {args.severity}, {args.device}, {torch.get_num_threads()} threads)")
    ratios = []
    for kind in kinds:
        t = statistics.median(times[kind])
        ratios.append(t / base)
        print(f"{kind}: {1000 * t:.2f} ms/step, batch {1000 * statistics.median(batch_times[kind]):.2f} ms, "
              f"ratio={t / base:.3f}")
    print(f"mean_ratio={statistics.mean(ratios):.3f}")


if __name__ == "__main__":
    main()
