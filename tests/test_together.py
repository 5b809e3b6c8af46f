"""Seeds together (``fedrcl seeds --together``): each seed is the run its own ``fedrcl fit`` would be."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import REPO, assert_same_state, signal_in_round_1
from fedrcl import seeds
from fedrcl.federated import batched

SEEDS = ("0", "1", "2")


def args(data_root: Path, save_dir: Path, *extra: str, rounds: int = 3, model: str = "fedrcl.algorithms.FedAvg"
         ) -> list[str]:
    """The quickstart shrunk to seconds: 10 clients, 3 a round, 2 local epochs of 3 steps."""
    return ["--config", str(REPO / "configs" / "quickstart.yaml"), "--model", model, "--data.root", str(data_root),
            "--data.num_clients", "10", "--trainer.accelerator", "cpu",
            "--trainer.logger.init_args.save_dir", str(save_dir), "--trainer.callbacks", "[]",
            "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
            "--trainer.rounds", str(rounds), "--trainer.local_epochs", "2", "--data.local_iters_per_epoch", "3",
            "--trainer.clients_per_round", "3", *extra]


def last(save_dir: Path, seed: int, version: int = 0) -> dict:
    path = save_dir / "quickstart" / f"seed{seed}" / f"version_{version}" / "checkpoints" / "last.ckpt"
    return torch.load(path, weights_only=True)


def relative_difference(a: dict, b: dict) -> float:
    """The largest per-tensor ``max|a - b| / max|b|`` over the floating-point entries of two state dicts."""
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max() / b[k].double().abs().max())
               for k in b if b[k].is_floating_point())


def scalars(save_dir: Path, seed: int) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(save_dir / "quickstart" / f"seed{seed}" / "version_0"))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


@pytest.mark.parametrize("model,precision,tolerance", [("FedAvg", "32-true", 1e-5), ("FedRCL", "64-true", 1e-12)])
def test_each_seed_equals_its_own_fit(data_root, tmp_path, capsys, model, precision, tolerance):
    """Three seeds trained together: each seed's weights after 3 rounds within ``tolerance`` (relative) of the
    same seed's ``fedrcl fit``, its step count, accuracy EMA and scalars (the same tags, so report and plot read
    it) too. FedRCL in float64 (measured 1.3e-15; an lr rounded to float32 gave 2.6e-8): its loss jumps where a
    pair's similarity crosses the threshold, so in float32 a pair that rounds to the other side changes a step
    by a jump that the rounds carry on (2e-3 after 3 rounds, docs/seeds.md)."""
    common = args(data_root, tmp_path / "x", "--model", f"fedrcl.algorithms.{model}", "--trainer.precision", precision)
    seeds.main(["--seeds", *SEEDS, "--together", *common,
                "--trainer.logger.init_args.save_dir", str(tmp_path / "together")])
    captured = capsys.readouterr()
    assert "--together:" not in captured.out  # no fallback
    assert captured.err.count("seed 2: Round 3/3") == 1  # each seed's fit's round lines, labelled
    seeds.main(["--seeds", *SEEDS, *common, "--trainer.logger.init_args.save_dir", str(tmp_path / "alone")])
    for seed in range(3):
        together, alone = last(tmp_path / "together", seed), last(tmp_path / "alone", seed)
        assert relative_difference(together["state_dict"], alone["state_dict"]) <= tolerance, seed
        assert (together["epoch"], together["global_step"]) == (alone["epoch"], alone["global_step"]) == (2, 54)
        assert together["acc_ema"] == pytest.approx(alone["acc_ema"], abs=1e-6)
        a, b = scalars(tmp_path / "together", seed), scalars(tmp_path / "alone", seed)
        assert a.keys() == b.keys()
        for tag in ("train/loss", "train/lr", "val/acc"):
            assert [s for s, _ in a[tag]] == [1, 2, 3]
            assert [v for _, v in a[tag]] == pytest.approx([v for _, v in b[tag]], rel=1e-5), tag
    assert relative_difference(last(tmp_path / "together", 0)["state_dict"],
                               last(tmp_path / "together", 1)["state_dict"]) > 1e-2  # seeds differ


def test_killed_and_resumed_equals_uninterrupted(data_root, tmp_path):
    """``kill -9`` of a 3-seed run once every seed has checkpointed round 2 (possibly some round 3 as well), then
    ``--ckpt_path last``: each seed ends where the run that never stopped ends, bitwise (CPU)."""
    common = args(data_root, tmp_path / "killed", "--trainer.checkpoint_every", "1", rounds=4)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "fedrcl.cli", "seeds", "--seeds", *SEEDS, "--together", *common],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    round2 = [tmp_path / "killed" / "quickstart" / f"seed{s}" / "version_0" / "checkpoints" / "round0001.ckpt"
              for s in range(3)]
    try:
        deadline = time.monotonic() + 120
        while not all(p.exists() for p in round2):
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            assert time.monotonic() < deadline, "no round-2 checkpoints in 120 s"
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
    assert not (tmp_path / "killed" / "quickstart" / "seed0" / "version_0" / "checkpoints" / "round0003.ckpt").exists()
    seeds.main(["--seeds", *SEEDS, "--together", *common, "--ckpt_path", "last"])
    seeds.main(["--seeds", *SEEDS, "--together", *args(data_root, tmp_path / "whole", "--trainer.checkpoint_every",
                                                        "1", rounds=4)])
    for seed in range(3):
        resumed, whole = last(tmp_path / "killed", seed, version=1), last(tmp_path / "whole", seed)
        assert resumed["epoch"] == whole["epoch"] == 3
        assert_same_state(resumed["state_dict"], whole["state_dict"])
        assert resumed["global_step"] == whole["global_step"]


def test_sigterm_checkpoints_every_seed_and_resumes(data_root, tmp_path, monkeypatch, capsys):
    """SIGTERM in round 1 of 3: the round ends, both seeds are checkpointed (not due: every 10 rounds), the exit
    status is 128 + 15 with the resume command; that command ends where an uninterrupted run ends (bitwise)."""
    from fedrcl.federated.preemption import Preemption

    original = Preemption.on_train_epoch_end
    signal_in_round_1(monkeypatch)
    common = args(data_root, tmp_path / "stopped", "--trainer.checkpoint_every", "10")
    with pytest.raises(SystemExit) as stopped:
        seeds.main(["--seeds", "0", "1", "--together", *common])
    assert stopped.value.code == 128 + signal.SIGTERM
    err = capsys.readouterr().err
    assert "stopped by SIGTERM (seed 0 after round 1/3, seed 1 after round 1/3)" in err
    assert "resume: fedrcl seeds --seeds 0 1 --together" in err and err.rstrip().endswith("--ckpt_path last")
    monkeypatch.setattr(Preemption, "on_train_epoch_end", original)
    seeds.main(["--seeds", "0", "1", "--together", *common, "--ckpt_path", "last"])
    seeds.main(["--seeds", "0", "1", "--together", *args(data_root, tmp_path / "whole")])
    for seed in (0, 1):
        assert last(tmp_path / "stopped", seed)["epoch"] == 0
        assert_same_state(last(tmp_path / "stopped", seed, version=1)["state_dict"],
                          last(tmp_path / "whole", seed)["state_dict"])


def test_resumes_seeds_at_different_rounds_and_starts_new_ones(data_root, tmp_path, capsys):
    """``--ckpt_path last`` with seed 0 checkpointed after round 2 and seed 1 never run: seed 1 starts (said), both
    train together, and each ends as its own uninterrupted fit."""
    seeds.main(["--seeds", "0", "--together", *args(data_root, tmp_path / "a", rounds=2)])
    seeds.main(["--seeds", "0", "1", "--together", *args(data_root, tmp_path / "a"), "--ckpt_path", "last"])
    assert "seed 1: no checkpoint in" in capsys.readouterr().out
    seeds.main(["--seeds", "0", "1", *args(data_root, tmp_path / "b")])
    assert relative_difference(last(tmp_path / "a", 0, version=1)["state_dict"],
                               last(tmp_path / "b", 0)["state_dict"]) <= 1e-5
    assert relative_difference(last(tmp_path / "a", 1)["state_dict"], last(tmp_path / "b", 1)["state_dict"]) <= 1e-5


@pytest.mark.parametrize("model,reason", [
    ("MOON", "seed 0: MOON keeps a previous local model per client"),
    ("step_methods.CountsLrPerStep", "seed 0: model CountsLrPerStep overrides on_before_optimizer_step"),
])
def test_a_method_that_cannot_train_together_falls_back(data_root, tmp_path, capsys, model, reason):
    """MOON cannot be batched; a method that counts its lr in a per-step Lightning hook, which the stacked step
    does not call (SCAFFOLD did, before its lr sum came from its context): one line says so before anything
    starts and the seeds train one after another, into the same folders (nothing was written by the attempt)."""
    seeds.main(["--seeds", "0", "1", "--together", *args(data_root, tmp_path, rounds=1,
                                                            model=model if "." in model else f"fedrcl.algorithms.{model}")])
    out = capsys.readouterr().out
    assert f"fedrcl seeds: --together: {reason}" in out and "one after another instead" in out
    for seed in (0, 1):
        folder = tmp_path / "quickstart" / f"seed{seed}"
        assert sorted(p.name for p in folder.iterdir()) == ["version_0"]
        assert (folder / "version_0" / "checkpoints" / "last.ckpt").exists()


@pytest.mark.parametrize("model,rounds,reason", [
    ("FedNTD", 2, "from round 1: model FedNTD: seed 1's clients compute another loss part 'ntd'"),
    ("FedProc", 3, "from round 2: model FedProc: seed 1's clients compute another loss part 'proto'"),
])
def test_a_method_whose_seeds_part_goes_on_alone(data_root, tmp_path, capsys, model, rounds, reason):
    """FedNTD's clients get their seed's global model as teacher, and FedProc's their seed's class prototypes from
    round 2 on (none in round 1), which one stacked step cannot give each seed: the round's check finds it before
    its first step, one line says so, and each seed's fit goes on alone in its own folder; each ends within 1e-5 of
    its own fit (float32)."""
    model = f"fedrcl.algorithms.{model}"
    seeds.main(["--seeds", "0", "1", "--together", *args(data_root, tmp_path / "a", model=model, rounds=rounds)])
    out = capsys.readouterr().out
    assert f"fedrcl seeds: --together: {reason}" in out and "each seed goes on alone, in its own fit" in out
    seeds.main(["--seeds", "0", "1", *args(data_root, tmp_path / "b", model=model, rounds=rounds)])
    for seed in (0, 1):
        assert sorted(p.name for p in (tmp_path / "a" / "quickstart" / f"seed{seed}").iterdir()) == ["version_0"]
        alone = last(tmp_path / "a", seed)
        assert alone["epoch"] == rounds - 1
        assert relative_difference(alone["state_dict"], last(tmp_path / "b", seed)["state_dict"]) <= 1e-5


def test_the_whole_client_step_is_one_graph_without_host_syncs(data_root, tmp_path, monkeypatch):
    """With ``trainer.compile_clients`` the stacked step (forward, FedRCL's loss, backward, clip, SGD) compiles
    with ``fullgraph=True`` to one graph, not recompiled over 3 rounds (aot_eager on the CPU; each seed's fit
    evaluates its own model); and after the
    first round's checks no step reads a value back to the host (``item``, ``bool``, ``tolist``, ``float``)."""
    from torch._dynamo.utils import counters

    from fedrcl.federated.stacked import StackedRound

    monkeypatch.setattr(batched, "COMPILE_BACKEND", "aot_eager")
    reads: list[str] = []
    train = StackedRound.step

    def counted(self, *a, **k):
        if self._check:  # the first round's first step checks the loss (it compares values)
            return train(self, *a, **k)
        originals = {name: getattr(torch.Tensor, name) for name in ("item", "__bool__", "tolist", "__float__")}
        for name, original in originals.items():
            def read(tensor, *rest, _name=name, _original=original):
                reads.append(_name)
                return _original(tensor, *rest)
            setattr(torch.Tensor, name, read)
        try:
            return train(self, *a, **k)
        finally:
            for name, original in originals.items():
                setattr(torch.Tensor, name, original)

    monkeypatch.setattr(StackedRound, "step", counted)
    counters.clear()
    seeds.main(["--seeds", "0", "1", "--together", *args(data_root, tmp_path, "--trainer.compile_clients", "true",
                                                            model="fedrcl.algorithms.FedRCL")])
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] == 1  # the joined step
    assert last(tmp_path, 1)["epoch"] == 2
    assert reads == []
    monkeypatch.setattr(StackedRound, "step", train)
    seeds.main(["--seeds", "0", "1", "--together", *args(data_root, tmp_path / "eager", model="fedrcl.algorithms.FedRCL")])
    for seed in (0, 1):  # the compiled step (torch.func.grad) trains as the eager one (autograd's grad)
        assert relative_difference(last(tmp_path, seed)["state_dict"],
                                   last(tmp_path / "eager", seed)["state_dict"]) <= 1e-5


def test_sgd_update_and_clip_are_torch_sgd_per_client():
    """``sgd_update`` after ``clipped`` is, for every client slice, ``clip_grad_norm_`` then ``torch.optim.SGD``
    (weight decay, momentum) at that client's lr, over 3 steps (float64: equal to rounding)."""
    from fedrcl.federated.client_step import clipped, sgd_update

    torch.manual_seed(0)
    params = {"w": torch.randn(3, 4, 5, dtype=torch.float64), "b": torch.randn(3, 5, dtype=torch.float64)}
    lr = torch.tensor([0.1, 0.05, 0.2], dtype=torch.float64)
    grads = [{k: torch.randn_like(v) * 4 for k, v in params.items()} for _ in range(3)]
    stacked, momenta = dict(params), {k: torch.zeros_like(v) for k, v in params.items()}
    for g in grads:
        stacked, momenta = sgd_update(stacked, clipped(g, 1.0), momenta, lr, momentum=0.9, weight_decay=1e-3)
    for n in range(3):
        own = [params[k][n].clone().requires_grad_() for k in params]
        sgd = torch.optim.SGD(own, lr=float(lr[n]), momentum=0.9, weight_decay=1e-3)
        for g in grads:
            for p, k in zip(own, params):
                p.grad = g[k][n].clone()
            torch.nn.utils.clip_grad_norm_(own, 1.0)
            sgd.step()
        for p, k in zip(own, params):
            torch.testing.assert_close(stacked[k][n], p.detach(), rtol=1e-12, atol=1e-12)
    assert not torch.equal(stacked["w"][0], params["w"][0])
