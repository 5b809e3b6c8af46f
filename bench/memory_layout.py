"""Image batches in channels-last against the default layout (``data.channels_last on`` / ``off``).

For each backbone, times a local training step (forward, loss, backward; batch 50) and an evaluation forward
(batch 250, inference mode) on CIFAR-shaped random images, the two layouts alternating in one process; prints
the median milliseconds and ``speedup=<off/on>`` per measurement, and last ``round_speedup=<...>``: the small
CNN's paper round (250 training steps, 10,000 test images) at those medians.

    OMP_NUM_THREADS=1 python bench/memory_layout.py [--device cpu|cuda] [--repeats 5]
"""
from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch
import torch.nn.functional as F

from fedrcl.models import ResNet18, SmallCNN


def timed(fn, device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats of each layout (alternating)")
    args = parser.parse_args()
    torch.manual_seed(0)
    medians = {}
    for name, make in (("SmallCNN", partial(SmallCNN, 10)), ("ResNet-18 width 8", partial(ResNet18, 10, width=8))):
        model = make().to(args.device)
        y = torch.randint(0, 10, (50,), device=args.device)
        images = {"train": torch.randn(50, 3, 32, 32, device=args.device),
                  "eval": torch.randn(250, 3, 32, 32, device=args.device)}

        def train_step(x):
            loss = F.cross_entropy(model(x).logits, y)
            model.zero_grad()
            loss.backward()

        def evaluate(x):
            with torch.inference_mode():
                model(x)

        for what, fn in (("train", train_step), ("eval", evaluate)):
            inputs = {"off": images[what], "on": images[what].contiguous(memory_format=torch.channels_last)}
            seconds = {"off": [], "on": []}
            for layout in ("off", "on"):  # warm-up
                fn(inputs[layout])
            for _ in range(args.repeats):
                for layout in ("off", "on"):
                    seconds[layout].append(timed(lambda: [fn(inputs[layout]) for _ in range(3)], args.device) / 3)
            off, on = (statistics.median(seconds[k]) for k in ("off", "on"))
            medians[name, what] = off, on
            print(f"{name} {what}: off {off * 1e3:.1f} ms, on {on * 1e3:.1f} ms, speedup={off / on:.2f}")
    (train_off, train_on), (eval_off, eval_on) = medians["SmallCNN", "train"], medians["SmallCNN", "eval"]
    print(f"round_speedup={(250 * train_off + 40 * eval_off) / (250 * train_on + 40 * eval_on):.2f}")


if __name__ == "__main__":
    main()
