"""What the step mask costs: batched rounds of unequal clients (masked) against rounds of equal steps, per client step.

Two settings of the quickstart (digits, small CNN, 5 of 10 clients a round, 2 local epochs, batch 24): clients of
unequal sizes with one pass over their data per epoch (``--data.partition dirichlet_unbalanced``,
``--data.local_iters_per_epoch null``: steps and last batch sizes differ, the rounds run under the step mask) and
equal clients with 3 steps an epoch (``dirichlet``, ``local_iters_per_epoch 3``: the plain stacked step). Each is
fitted batched and sequential, alternating, in one process; the figure is seconds per client step (a fit's wall
time over its ``global_step``, which counts every client's own steps), median over repeats. Prints each, the
masked over equal ratio of batched seconds per client step, and batched over sequential in each setting.

    OMP_NUM_THREADS=1 python bench/step_mask.py [--rounds 3] [--repeats 3] [--accelerator cpu]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from fedrcl.lightning_cli import build_cli

REPO = Path(__file__).resolve().parents[1]
SETTINGS = {
    "masked": ("--data.partition", "dirichlet_unbalanced", "--data.local_iters_per_epoch", "null"),
    "equal": ("--data.partition", "dirichlet", "--data.local_iters_per_epoch", "3"),
}


def seconds_per_client_step(folder: Path, setting: str, batching: str, rounds: int, accelerator: str) -> float:
    cli = build_cli(["--config", str(REPO / "configs" / "quickstart.yaml"), "--model", "fedrcl.algorithms.FedAvg",
                     "--data.root", str(REPO / "data"), "--data.num_clients", "10", "--trainer.callbacks", "[]",
                     "--trainer.accelerator", accelerator, "--trainer.logger.init_args.save_dir", str(folder),
                     "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
                     "--trainer.rounds", str(rounds), "--trainer.local_epochs", "2",
                     "--trainer.clients_per_round", "5", "--trainer.eval_every", str(rounds),
                     "--trainer.client_batching", batching, *SETTINGS[setting]], run=False)
    start = time.perf_counter()
    cli.trainer.fit(cli.model, cli.datamodule)
    return (time.perf_counter() - start) / cli.trainer.global_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--accelerator", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(1)
    runs = [(setting, batching) for setting in SETTINGS for batching in ("on", "off")]
    times: dict[tuple[str, str], list[float]] = {run: [] for run in runs}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats + 1):
            for run in runs:
                seconds = seconds_per_client_step(Path(tmp) / f"{repeat}", *run, args.rounds, args.accelerator)
                if repeat:  # the first repeat is a warm-up
                    times[run].append(seconds)
    median = {run: statistics.median(values) for run, values in times.items()}
    for (setting, batching), value in median.items():
        print(f"{setting} steps, batched {batching}: {value * 1e3:.2f} ms per client step")
    print(f"masked_over_equal (batched, per client step)={median['masked', 'on'] / median['equal', 'on']:.2f}")
    for setting in SETTINGS:
        print(f"{setting}: batched_over_sequential={median[setting, 'on'] / median[setting, 'off']:.2f}")


if __name__ == "__main__":
    main()
