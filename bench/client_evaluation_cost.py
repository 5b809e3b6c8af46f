"""Cost of ClientEvaluation and of the byte count, against local training, on CIFAR-shaped random data.

    OMP_NUM_THREADS=1 python bench/client_evaluation_cost.py [--test 10000] [--repeats 3]

The small CNN of configs/cpu (3x32x32, 10 classes); 100 clients with random class mixes; a test set of
``--test`` random images. Times (median of ``--repeats``, seconds): one global-model evaluation over all
clients' label mixes (one test pass + the mixes), one local-model evaluation, and the byte count of one
client; and one CPU-scale round of local training (5 clients x 50 SGD steps of batch 50) for the ratio.
A measured round of ClientEvaluation costs 1 global + 5 local evaluations.
"""
from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from fedrcl.analysis import ClientEvaluation, label_mix_accuracy
from fedrcl.data.datasets import dataset_info
from fedrcl.federated.communication import client_traffic
from fedrcl.models import SmallCNN


def median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--test", type=int, default=10000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    info = dataset_info("cifar10")
    model = SmallCNN(10, 3, 32)
    y_train = torch.randint(0, 10, (50000,))
    dm = SimpleNamespace(x_test=torch.randint(0, 256, (args.test, 32, 32, 3), dtype=torch.uint8),
                         y_test=torch.randint(0, 10, (args.test,)), info=info, eval_batch_size=250,
                         num_classes=10, y_train=y_train, client_indices=list(torch.randperm(50000).split(500)))
    callback = ClientEvaluation()
    counts = callback.class_counts(dm)
    state = {k: v.clone() for k, v in model.state_dict().items()}

    def global_eval():
        correct, total = callback.class_counts_correct(model, dm)
        label_mix_accuracy(correct, total, counts)

    def local_eval():
        correct, total = callback.class_counts_correct(model, dm, state)
        label_mix_accuracy(correct, total, counts[0])

    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(50, 3, 32, 32), torch.randint(0, 10, (50,))

    def train_round():
        for _ in range(5 * 50):
            optimizer.zero_grad()
            F.cross_entropy(model(x).logits, y).backward()
            optimizer.step()

    global_eval()  # warm-up (test set normalised once, class counts built once)
    g, loc = median_seconds(global_eval, args.repeats), median_seconds(local_eval, args.repeats)
    count = median_seconds(lambda: client_traffic([state], [state]), 100)
    round_s = median_seconds(train_round, max(1, args.repeats // 2))
    measured = g + 5 * loc
    print(f"test images {args.test}, threads {torch.get_num_threads()}")
    print(f"global model on 100 clients' mixes: {g:.3f} s; one local model: {loc:.3f} s; "
          f"byte count of one client: {1e6 * count:.1f} us")
    print(f"local training round (5 x 50 steps of 50): {round_s:.2f} s")
    print(f"measured round (1 global + 5 local): {measured:.2f} s = {measured / round_s:.3f} x a training "
          f"round; every 5 rounds: {100 * measured / (5 * round_s):.1f}% of training time")


if __name__ == "__main__":
    main()
