"""One local step of K clients: one after another, or batched on a client axis (vmap), on this device.

The choice behind ``trainer.client_batching: auto``. Both do forward, backward, per-client gradient clip
and SGD with weight decay for K clients of batch B (CIFAR shapes, cross-entropy); the batched step is the
stacked engine's formulation (``fedrcl.federated.client_step``: stacked weights, vmap over functional_call, one
backward, its per-client ``clipped`` and ``sgd_update``).
Alternating repeats in one process; prints the median seconds of each and ``batched_over_sequential``.

    python bench/batched_step.py [--device cpu] [--clients 5] [--batch 50] [--repeats 5]
"""
from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch
import torch.nn.functional as F
from torch.func import functional_call, vmap

from fedrcl.federated.batched import stack_clients
from fedrcl.federated.client_step import clipped, sgd_update
from fedrcl.models import ResNet18, SmallCNN


def sequential_step(net, opt, xs, ys):
    for x, y in zip(xs, ys):
        opt.zero_grad()
        F.cross_entropy(net(x).logits, y).backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 10.0)
        opt.step()


def batched_step(net, state, lr, xs, ys):
    def one(p, x, y):
        return F.cross_entropy(functional_call(net, p, (x,)).logits, y)

    leaves = {n: p.detach().requires_grad_() for n, p in state["params"].items()}
    grads = torch.autograd.grad(vmap(one)(leaves, xs, ys).sum(), list(leaves.values()))
    state["params"], _ = sgd_update(state["params"], clipped(dict(zip(leaves, grads)), 10.0), {}, lr, 0.0, 1e-3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--clients", type=int, default=5)
    parser.add_argument("--batch", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    k, device = args.clients, args.device
    xs = torch.randn(k, args.batch, 3, 32, 32, device=device)
    ys = torch.randint(0, 10, (k, args.batch), device=device)
    for name, build in (("SmallCNN", SmallCNN), ("ResNet-18 width 8", partial(ResNet18, width=8))):
        net = build(10).to(device)
        state = {"params": {n: stack_clients(p.detach(), k) for n, p in net.named_parameters()}}
        lr = torch.full((k,), 0.01, device=device)
        seq_opt = torch.optim.SGD(net.parameters(), lr=0.01, weight_decay=1e-3)
        runs = {"sequential": lambda: sequential_step(net, seq_opt, xs, ys),
                "batched": lambda: batched_step(net, state, lr, xs, ys)}
        times = {key: [] for key in runs}
        for repeat in range(args.repeats + 1):
            for key, run in runs.items():
                if device == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                run()
                if device == "cuda":
                    torch.cuda.synchronize()
                if repeat:  # the first repeat is a warm-up
                    times[key].append(time.perf_counter() - start)
        seq, bat = statistics.median(times["sequential"]), statistics.median(times["batched"])
        print(f"{name}, {k} clients x batch {args.batch}, {device}: sequential {seq * 1e3:.1f} ms, "
              f"batched {bat * 1e3:.1f} ms, batched_over_sequential={bat / seq:.2f}")


if __name__ == "__main__":
    main()
