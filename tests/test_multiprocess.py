"""A round's clients over two processes (gloo on CPU): one process's results, no hang, no plain DDP.

The end-to-end tests run ``fedrcl fit`` as a subprocess with ``--trainer.devices 2 --trainer.strategy ddp``
(Lightning's launcher starts the second process), each under a timeout so that a hang fails the test.
Five clients per round split 3 / 2 over the processes, so the processes run different step counts.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import REPO, assert_same_state, run_cli, run_in_process_group
from fedrcl.data.datamodule import eval_slices
from fedrcl.federated.aggregation import WeightedSum
from fedrcl.federated.federation import Federation
from fedrcl.federated.sampling import sample_clients
from fedrcl.federated.strategy import FederatedStrategy
from fedrcl.federated.trainer import FederatedTrainer

TIMEOUT_S = 420  # a two-process run used ~15 s of CPU (100 s wall under load 8); a hang is killed here
FIVE_CLIENTS = ("--trainer.clients_per_round", "5", "--data.eval_batch_size", "100")


def fit_two_processes(data_root: Path, save_dir: Path, *extra: str, rounds: int, model: str) -> str:
    """``fedrcl fit`` on the shrunk quickstart with 2 CPU processes; returns its output (fails on a hang)."""
    args = [sys.executable, "-m", "fedrcl.cli", "fit", "--config", str(REPO / "configs" / "quickstart.yaml"),
            "--model", model, "--data.root", str(data_root), "--data.num_clients", "10",
            "--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.strategy", "ddp",
            "--trainer.logger.init_args.save_dir", str(save_dir), "--trainer.enable_model_summary", "false",
            "--trainer.rounds", str(rounds), "--trainer.local_epochs", "1", *FIVE_CLIENTS, *extra]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    output = run_in_process_group(args, TIMEOUT_S, save_dir.parent, env)
    assert "Starting with 2 processes" in output
    return output


def last_run(save_dir: Path) -> tuple[dict, EventAccumulator]:
    log_dir = sorted(save_dir.glob("quickstart/version_*"))[-1]
    events = EventAccumulator(str(log_dir))
    events.Reload()
    return torch.load(log_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True), events


def curve(events: EventAccumulator, tag: str) -> list[tuple[int, float]]:
    return [(e.step, e.value) for e in events.Scalars(tag)]


@pytest.mark.slow
def test_two_processes_give_one_process_results(data_root, tmp_path):
    """FedRCL with FedAvgM and a validation split: the same final global weights (bitwise), server momentum and
    logged accuracies (validation and test sets, each cut over the processes); train losses equal up to float
    rounding. This covers plain FedAvg's path too (the same sampling, split and all-reduce); SCAFFOLD and FedDyn
    (``test_scaffold_feddyn.py``) and MOON (below) add client state."""
    extra = ("--config", str(REPO / "configs" / "server" / "fedavgm.yaml"), "--data.val_fraction", "0.2")
    model = "fedrcl.algorithms.FedRCL"
    one = run_cli(data_root, tmp_path / "one", *FIVE_CLIENTS, *extra, rounds=3, model=model)
    fit_two_processes(data_root, tmp_path / "two", *extra, rounds=3, model=model)
    ckpt, events = last_run(tmp_path / "two")
    assert ckpt["epoch"] == 2
    assert ckpt["global_step"] == one.trainer.global_step  # every client's local steps, in both
    assert_same_state(one.model.state_dict(), ckpt["state_dict"])
    memory = one.trainer.federation.server.state_dict()  # the server's momentum went through the checkpoint
    saved = next(v for k, v in ckpt["callbacks"].items() if "Federation" in k)["server"]
    for name, buffers in memory.items():
        assert_same_state(buffers, saved[name])
    expected = EventAccumulator(one.trainer.logger.log_dir)
    expected.Reload()
    for tag in ("val/acc", "val/acc_ema", "test/acc", "test/acc_ema", "train/lr"):
        assert curve(events, tag) == curve(expected, tag), tag
    for tag in ("train/loss", "train/loss_ce"):
        assert [s for s, _ in curve(events, tag)] == [1, 2, 3]
        expected_losses = [v for _, v in curve(expected, tag)]
        assert [v for _, v in curve(events, tag)] == pytest.approx(expected_losses, rel=1e-6)


@pytest.mark.slow
def test_moon_over_two_processes_resumes_as_one_process(data_root, tmp_path):
    """MOON's per-client files are written by both processes, found by the other one when a client changes
    process, listed in rank 0's checkpoint, and read back by both after ``--ckpt_path last``."""
    moon = ("--config", str(REPO / "configs" / "methods" / "moon.yaml"))
    plans = [sample_clients(10, 5, 0, r) for r in range(3)]
    rank_of = [{k: i % 2 for i, k in enumerate(p)} for p in plans]
    # The test means something: a client of rounds 0-1 trains again in round 2, on the other process.
    assert any(k in rank_of[r] and rank_of[r][k] != rank_of[2][k] for r in (0, 1) for k in plans[2])
    one = run_cli(data_root, tmp_path / "one", *FIVE_CLIENTS, *moon, rounds=3, model="fedrcl.algorithms.MOON")
    save_dir = tmp_path / "two"
    fit_two_processes(data_root, save_dir, *moon, rounds=2, model="fedrcl.algorithms.MOON")
    stopped, _ = last_run(save_dir)
    assert set(stopped["client_state"]["files"]) == set(plans[0]) | set(plans[1])
    output = fit_two_processes(data_root, save_dir, *moon, "--ckpt_path", "last", rounds=3,
                               model="fedrcl.algorithms.MOON")
    assert "Round 3/3" in output
    resumed, events = last_run(save_dir)
    assert_same_state(one.model.state_dict(), resumed["state_dict"])
    assert set(resumed["client_state"]["files"]) == set().union(*plans)
    assert [s for s, _ in curve(events, "val/acc")] == [3]


# -- strategy selection ---------------------------------------------------------------------------------
NAMES = [("ddp", "popen"), ("auto", "popen"), ("ddp_spawn", "spawn"), ("federated", "popen"),
         ("federated_spawn", "spawn")]


@pytest.mark.parametrize("strategy, start_method", NAMES)
def test_ddp_and_auto_select_the_federated_strategy(strategy, start_method):
    trainer = FederatedTrainer(strategy=strategy, devices=2, accelerator="cpu", logger=False)
    assert type(trainer.strategy) is FederatedStrategy and trainer.world_size == 2
    assert trainer.strategy._start_method == start_method
    # Only inside FederatedTrainer: a plain Lightning Trainer keeps Lightning's DDP.
    assert type(L.Trainer(strategy="ddp", devices=2, accelerator="cpu", logger=False).strategy) is DDPStrategy


@pytest.mark.parametrize("strategy", [DDPStrategy(), "ddp_find_unused_parameters_true"])
def test_plain_ddp_is_refused(strategy):
    with pytest.raises(ValueError, match="trainer.strategy .* use trainer.strategy ddp"):
        FederatedTrainer(strategy=strategy, devices=2, accelerator="cpu", logger=False)


def test_sync_batchnorm_is_refused():
    trainer = FederatedTrainer(devices=2, accelerator="cpu", logger=False, sync_batchnorm=True)
    with pytest.raises(ValueError, match="trainer.sync_batchnorm"):
        trainer.strategy.setup(trainer)


def test_every_process_needs_a_client(data_root):
    from fedrcl.algorithms import FedAvg
    from fedrcl.data.datamodule import FederatedDataModule
    from fedrcl.models import SmallCNN

    dm = FederatedDataModule(dataset="digits", root=str(data_root), num_clients=10)
    model = FedAvg(backbone=SmallCNN, num_classes=10)
    federation = Federation(clients_per_round=3, participation=None, local_epochs=1, server=None, seed=0)
    with pytest.raises(ValueError, match="clients_per_round=3 is smaller than the 4 processes"):
        federation.setup(SimpleNamespace(datamodule=dm, world_size=4, callbacks=[]), model, "fit")


# -- the pieces -----------------------------------------------------------------------------------------
def test_eval_slices_split_the_test_set_in_one_process_batches():
    assert eval_slices(360, 100) == [(0, 100), (100, 200), (200, 300), (300, 360)]
    assert eval_slices(360, 100, 0, 2) == [(0, 100), (100, 200)]
    assert eval_slices(360, 100, 1, 2) == [(200, 300), (300, 360)]
    assert eval_slices(360, 100, 2, 3) == [(200, 300), (300, 360)]
    assert [eval_slices(360, 1000, r, 2) for r in range(2)] == [[(0, 180)], [(180, 360)]]
    for n, batch, world in ((1000, 64, 3), (17, 5, 4), (10, 100, 7), (5, 1, 5)):
        covered = [i for r in range(world) for a, b in eval_slices(n, batch, r, world) for i in range(a, b)]
        assert covered == list(range(n))
        assert all(eval_slices(n, batch, r, world) for r in range(world))
    with pytest.raises(ValueError, match="3 samples cannot be split over 4 processes"):
        eval_slices(3, 1, 0, 4)


def test_client_mean_does_not_depend_on_the_split_over_processes():
    """float64 sums: clients 0, 2, 4 on one process and 1, 3 on another give the one-process mean bitwise."""
    gen = torch.Generator().manual_seed(0)
    states = [{"w": torch.randn(1000, generator=gen) * 10 ** torch.empty(1000).uniform_(-4, 1, generator=gen),
               "n": torch.tensor(3)} for _ in range(5)]
    weights = [500.0, 500.0, 437.0, 12.0, 500.0]
    whole, a, b = (WeightedSum(states[0]) for _ in range(3))
    for k, (state, weight) in enumerate(zip(states, weights)):
        whole.add(state, weight)
        (a if k % 2 == 0 else b).add(state, weight)
    # mean() reduces the weight first, then each tensor in key order: add b's partial sums in that order.
    pending = iter([torch.tensor(b.weight, dtype=torch.float64), *b.total.values()])
    split = a.mean(lambda t: t + next(pending))
    assert torch.equal(split["w"], whole.mean()["w"]) and split["w"].dtype == torch.float32
