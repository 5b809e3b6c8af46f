"""``fedrcl sweep``: a grid's settings, each (setting, seed) the run its own ``fedrcl fit`` would be."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO, assert_same_state, signal_in_round_1
from fedrcl import sweep
from fedrcl.cli import build_cli
from fedrcl.sweep import Setting, SweepError, canonical_key, parse_axes, settings_of, short_names


def args(data_root: Path, save_dir: Path, *extra: str, model: str = "fedrcl.algorithms.FedProx") -> list[str]:
    """The quickstart shrunk to seconds (as tests/test_together.py): 10 clients, 3 a round, 2 local epochs of
    3 steps."""
    return ["--config", str(REPO / "configs" / "quickstart.yaml"), "--model", model, "--data.root", str(data_root),
            "--data.num_clients", "10", "--trainer.accelerator", "cpu",
            "--trainer.logger.init_args.save_dir", str(save_dir), "--trainer.callbacks", "[]",
            "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
            "--trainer.local_epochs", "2", "--data.local_iters_per_epoch", "3", "--trainer.clients_per_round", "3",
            *extra]


def last(save_dir: Path, run: str, version: int = 0) -> dict:
    path = save_dir / "quickstart" / run / f"version_{version}" / "checkpoints" / "last.ckpt"
    return torch.load(path, weights_only=True)


def relative_difference(a: dict, b: dict) -> float:
    """The largest per-tensor ``max|a - b| / max|b|`` over the floating-point entries of two state dicts."""
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max() / b[k].double().abs().max())
               for k in b if b[k].is_floating_point())


# -- the grid -----------------------------------------------------------------------------------------------
def test_parse_axes_and_setting_names():
    """Values split at commas; keys named by their last part, longer where two would clash; a setting's folder
    lists its values in the names' alphabetical order, whatever order the keys were given in."""
    axes = parse_axes(["model.init_args.mu=0.01,0.1", "model.init_args.lr=0.03"], "--grid")
    assert axes == {"model.init_args.mu": ["0.01", "0.1"], "model.init_args.lr": ["0.03"]}
    assert short_names(["model.init_args.lr", "trainer.server.init_args.lr", "data.alpha"]) == \
        {"model.init_args.lr": "model.lr", "trainer.server.init_args.lr": "server.lr", "data.alpha": "alpha"}
    names = short_names(list(axes))
    assert [s.name for s in settings_of(axes, names)] == ["lr=0.03,mu=0.01", "lr=0.03,mu=0.1"]
    swapped = {"model.init_args.lr": ["0.03"], "model.init_args.mu": ["0.01", "0.1"]}
    assert [s.name for s in settings_of(swapped, names)] == ["lr=0.03,mu=0.01", "lr=0.03,mu=0.1"]
    assert settings_of(axes, names)[1].overrides() == ["--model.init_args.mu", "0.1", "--model.init_args.lr", "0.03"]
    odd = settings_of({"model.class_path": ["a/b c"]}, {"model.class_path": "class_path"})
    assert odd == [Setting((("model.class_path", "a/b c"),), "class_path=a_b_c")]


def test_random_draws_distinct_settings_in_grid_order():
    """``--random 3`` of a 3 x 2 space: 3 different settings, kept in the grid's order, the same for the same
    ``--sample_seed`` and in general others for another."""
    axes = {"a": ["1", "2", "3"], "b": ["x", "y"]}
    grid = [s.name for s in settings_of(axes, {"a": "a", "b": "b"})]
    drawn = [s.name for s in settings_of(axes, {"a": "a", "b": "b"}, sample=3, sample_seed=0)]
    assert len(set(drawn)) == 3 and drawn == sorted(drawn, key=grid.index)
    assert drawn == [s.name for s in settings_of(axes, {"a": "a", "b": "b"}, sample=3, sample_seed=0)]
    others = {tuple(s.name for s in settings_of(axes, {"a": "a", "b": "b"}, sample=3, sample_seed=k))
              for k in range(10)}
    assert len(others) > 1
    with pytest.raises(SweepError, match="--random 7: the space has 6 settings"):
        settings_of(axes, {"a": "a", "b": "b"}, sample=7)


def test_canonical_key_finds_init_args():
    config = {"model": {"class_path": "x.FedProx", "init_args": {"mu": 0.1, "lr": 0.1}}, "data": {"alpha": 0.3}}
    assert canonical_key(config, "model.mu") == "model.init_args.mu"
    assert canonical_key(config, "model.init_args.mu") == "model.init_args.mu"
    assert canonical_key(config, "data.alpha") == "data.alpha"
    with pytest.raises(SweepError, match="model.beta: not a key"):
        canonical_key(config, "model.beta")


@pytest.mark.parametrize("grid,message", [
    (["model.init_args.nu=0.1,1"], "--grid model.init_args.nu: not a key of this run's config"),
    (["model.init_args.mu="], "--grid model.init_args.mu: no value"),
    (["model.init_args.mu=0.1,,1"], "--grid model.init_args.mu: no value (or an empty one)"),
    (["model.init_args.mu"], "--grid model.init_args.mu: write KEY=V1,V2"),
    (["model.mu=0.1", "model.init_args.mu=1"], "--grid model.init_args.mu: the key is given twice"),
    (["model.mu=0.1,0.1"], "--grid model.mu: repeated values"),
    (["model.init_args.mu=0.1,-1"], "fedrcl sweep: setting mu=-1: error: model.init_args.mu must be >= 0, got -1.0"),
])
def test_bad_grid_input_is_refused_before_anything_trains(data_root, tmp_path, capsys, grid, message):
    """Each bad grid is one line naming the key (a value the method refuses: the setting and the key), exit
    status 2, and no run folder is written: every setting is built before the first one trains."""
    with pytest.raises(SystemExit) as refused:
        sweep.main(["--grid", *grid, "--seeds", "0", "--rounds", "1", *args(data_root, tmp_path)])
    assert refused.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "quickstart").exists()


# -- training -----------------------------------------------------------------------------------------------
def test_each_setting_trained_together_equals_its_own_fit(data_root, tmp_path, capsys):
    """An lr grid by a FedProx mu grid, trained together as one cohort (float64, 2 rounds): each setting's
    weights within 1e-9 (relative) of its own ``fedrcl fit`` at those values, and the settings differ from
    each other (so each run's lr and mu reached its own clients, not the first run's)."""
    common = args(data_root, tmp_path / "x", "--trainer.precision", "64-true")
    sweep.main(["--grid", "model.lr=0.05,0.1", "model.init_args.mu=0.001,1", "--seeds", "0", "--rounds", "2",
                "--together", *common, "--trainer.logger.init_args.save_dir", str(tmp_path / "together")])
    captured = capsys.readouterr()
    out = captured.out
    assert "fedrcl sweep: 4 settings x 1 seeds = 4 runs of 2 rounds (8 run-rounds)" in out
    assert "--together:" not in out  # one cohort, no fallback
    assert captured.err.count("seed 0: Round 2/2") == 4  # each run's fit's round lines, labelled
    weights = {}
    for lr in ("0.05", "0.1"):
        for mu in ("0.001", "1"):
            setting = f"lr={lr},mu={mu}"
            build_cli(["fit", *common, "--model.init_args.lr", lr, "--model.init_args.mu", mu, "--trainer.rounds",
                       "2", "--trainer.logger.init_args.save_dir", str(tmp_path / "alone"),
                       "--trainer.logger.init_args.name", f"quickstart/{setting}"])
            alone = torch.load(tmp_path / "alone" / "quickstart" / setting / "version_0" / "checkpoints" / "last.ckpt",
                               weights_only=True)
            together = last(tmp_path / "together", f"{setting}/seed0")
            assert relative_difference(together["state_dict"], alone["state_dict"]) <= 1e-9, setting
            assert (together["epoch"], together["global_step"]) == (alone["epoch"], alone["global_step"])
            weights[setting] = together["state_dict"]
    assert relative_difference(weights["lr=0.05,mu=0.001"], weights["lr=0.1,mu=0.001"]) > 1e-2  # lr (0.25)
    assert relative_difference(weights["lr=0.1,mu=0.001"], weights["lr=0.1,mu=1"]) > 1e-2  # mu (0.13)


def test_a_run_that_diverges_stops_alone_and_the_others_go_on(data_root, tmp_path, capsys):
    """Two settings trained together, one at an lr that makes its first round diverge: that run stops, named, and
    the sweep's exit status is 1; the other run goes on to its last round alone, with its own fit's weights
    (float64, 1e-9)."""
    common = args(data_root, tmp_path / "x", "--trainer.precision", "64-true", "--model.init_args.grad_clip_norm",
                  "null")
    with pytest.raises(SystemExit) as failed:
        sweep.main(["--grid", "model.lr=0.05,1e8", "--seeds", "0", "--rounds", "2", "--together", *common,
                    "--trainer.logger.init_args.save_dir", str(tmp_path / "together")])
    assert failed.value.code == 1
    err = capsys.readouterr().err
    assert "training diverged in round 1" in err, err[-2000:]
    build_cli(["fit", *common, "--model.init_args.lr", "0.05", "--trainer.rounds", "2",
               "--trainer.logger.init_args.save_dir", str(tmp_path / "alone"),
               "--trainer.logger.init_args.name", "quickstart/lr=0.05"])
    alone = torch.load(tmp_path / "alone" / "quickstart" / "lr=0.05" / "version_0" / "checkpoints" / "last.ckpt",
                       weights_only=True)
    together = last(tmp_path / "together", "lr=0.05/seed0")
    assert together["epoch"] == alone["epoch"] == 1
    assert relative_difference(together["state_dict"], alone["state_dict"]) <= 1e-9


def test_sigterm_stops_every_run_and_resume_is_bitwise(data_root, tmp_path, monkeypatch, capsys):
    """SIGTERM in round 1 of 2 of a 2-setting x 2-seed sweep trained together: the round ends, every run is
    checkpointed, exit status 143 and the resume command (``--ckpt_path last``); that command ends every run
    where an uninterrupted sweep ends, bitwise (CPU)."""
    from fedrcl.federated.preemption import Preemption

    original = Preemption.on_train_epoch_end
    signal_in_round_1(monkeypatch)
    grid = ["--grid", "model.lr=0.05,0.1", "--seeds", "0", "1", "--rounds", "2", "--together"]
    with pytest.raises(SystemExit) as stopped:
        sweep.main([*grid, *args(data_root, tmp_path / "stopped")])
    assert stopped.value.code == 128 + signal.SIGTERM
    err = capsys.readouterr().err
    assert "stopped by SIGTERM (lr=0.05 seed 0 after round 1/2, lr=0.05 seed 1 after round 1/2" in err
    assert "resume: fedrcl sweep --grid model.lr=0.05,0.1 --seeds 0 1 --rounds 2 --together" in err
    assert err.rstrip().endswith("--ckpt_path last")
    monkeypatch.setattr(Preemption, "on_train_epoch_end", original)
    sweep.main([*grid, *args(data_root, tmp_path / "stopped"), "--ckpt_path", "last"])
    sweep.main([*grid, *args(data_root, tmp_path / "whole")])
    for run in ("lr=0.05/seed0", "lr=0.05/seed1", "lr=0.1/seed0", "lr=0.1/seed1"):
        assert last(tmp_path / "stopped", run)["epoch"] == 0
        resumed, whole = last(tmp_path / "stopped", run, version=1), last(tmp_path / "whole", run)
        assert resumed["epoch"] == whole["epoch"] == 1
        assert_same_state(resumed["state_dict"], whole["state_dict"])


def test_killed_and_resumed_sweep_equals_uninterrupted(data_root, tmp_path):
    """``kill -9`` of a 2-setting sweep trained together once both runs have checkpointed round 1, then the same
    command with ``--ckpt_path last``: each run ends where a sweep that never stopped ends, bitwise (CPU)."""
    grid = ["--grid", "model.lr=0.05,0.1", "--seeds", "0", "--rounds", "4", "--together"]
    common = args(data_root, tmp_path / "killed", "--trainer.checkpoint_every", "1")
    proc = subprocess.Popen([sys.executable, "-m", "fedrcl.cli", "sweep", *grid, *common], cwd=tmp_path,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    round1 = [tmp_path / "killed" / "quickstart" / s / "seed0" / "version_0" / "checkpoints" / "round0000.ckpt"
              for s in ("lr=0.05", "lr=0.1")]
    try:
        deadline = time.monotonic() + 120
        while not all(p.exists() for p in round1):
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            assert time.monotonic() < deadline, "no round-1 checkpoints in 120 s"
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
    assert not (round1[0].parent / "round0003.ckpt").exists()
    sweep.main([*grid, *common, "--ckpt_path", "last"])
    sweep.main([*grid, *args(data_root, tmp_path / "whole", "--trainer.checkpoint_every", "1")])
    for run in ("lr=0.05/seed0", "lr=0.1/seed0"):
        resumed, whole = last(tmp_path / "killed", run, version=1), last(tmp_path / "whole", run)
        assert resumed["epoch"] == whole["epoch"] == 3
        assert_same_state(resumed["state_dict"], whole["state_dict"])
        assert resumed["global_step"] == whole["global_step"]


def test_sigterm_one_after_another_starts_no_other_setting(data_root, tmp_path):
    """Without ``--together``: SIGTERM in the first setting's fit ends its round, checkpointed, and the second
    setting does not start (exit status 143, the line names both); the resume command finishes both."""
    grid = ["--grid", "model.lr=0.05,0.1", "--seeds", "0", "--rounds", "3"]
    common = args(data_root, tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "fedrcl.cli", "sweep", *grid, *common], cwd=tmp_path,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("Round 1/3"):
                proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 128 + signal.SIGTERM, "".join(lines[-20:])
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    said = "".join(lines)
    assert "stopped after a round: ['lr=0.05 seed 0'], not started: ['lr=0.1 seed 0']" in said
    assert said.rstrip().endswith("--ckpt_path last")
    assert not (tmp_path / "quickstart" / "lr=0.1").exists()
    sweep.main([*grid, *common, "--ckpt_path", "last"])
    assert last(tmp_path, "lr=0.05/seed0", version=1)["epoch"] == last(tmp_path, "lr=0.1/seed0")["epoch"] == 2


def test_a_key_that_cannot_be_mapped_trains_its_values_one_after_another(data_root, tmp_path, capsys):
    """``data.alpha`` (another partition) cannot differ inside one stacked step: one line names it, and each
    alpha's lrs train together, one alpha after the other; every (setting, seed) has its run folder."""
    sweep.main(["--grid", "data.alpha=0.3,1", "model.lr=0.05,0.1", "--seeds", "0", "--rounds", "1", "--together",
                *args(data_root, tmp_path)])
    out = capsys.readouterr().out
    assert ("fedrcl sweep: --together: data.alpha cannot differ between runs of one stacked step (only the client "
            "lr, its decays and the method's sweepable loss weights can): the settings of each of its 2 values "
            "train together, one value after another") in out
    assert "one after another instead" not in out  # each cohort trained together
    for setting in ("alpha=0.3,lr=0.05", "alpha=0.3,lr=0.1", "alpha=1,lr=0.05", "alpha=1,lr=0.1"):
        assert last(tmp_path, f"{setting}/seed0")["epoch"] == 0


def test_a_method_that_cannot_train_together_trains_one_run_after_another(data_root, tmp_path, capsys):
    """MOON (its clients cannot train batched): the sweep says so in one line beginning with the run's label,
    and trains each run on its own, into the same folders."""
    sweep.main(["--grid", "model.init_args.mu=0.5,1", "--seeds", "0", "--rounds", "1", "--together",
                *args(data_root, tmp_path, model="fedrcl.algorithms.MOON")])
    out = capsys.readouterr().out
    assert ("fedrcl sweep: --together: mu=0.5 seed 0: MOON keeps a previous local model per client; the runs train "
            "one after another instead") in out
    for setting in ("mu=0.5", "mu=1"):
        assert sorted(p.name for p in (tmp_path / "quickstart" / setting / "seed0").iterdir()) == ["version_0"]
        assert last(tmp_path, f"{setting}/seed0")["epoch"] == 0


def test_every_sweepable_weight_is_a_constructor_argument():
    """What a method declares ``SWEEPABLE`` is one of its config keys (``model.init_args.<name>``), kept as the
    attribute of that name; the methods the sweep's docs name declare theirs."""
    import inspect

    import fedrcl.algorithms as algorithms

    declared = {name: cls.SWEEPABLE for name, cls in vars(algorithms).items()
                if isinstance(cls, type) and issubclass(cls, algorithms.FedAvg) and cls.SWEEPABLE}
    assert {"FedProx": ("mu",), "FedLC": ("tau",), "FedRCL": ("beta",), "MOON": ("mu",)}.items() <= declared.items()
    for name, weights in declared.items():
        parameters = inspect.signature(getattr(algorithms, name).__init__).parameters
        assert set(weights) <= set(parameters), name


def test_calibration_offsets_take_a_tensor_tau():
    """FedLC's offsets with ``tau`` a 0-dim tensor (set per slice when a sweep trains its values together):
    the float's values, ``tau = 0`` included (0, not ``0 * inf``), also mapped over several ``tau``."""
    from torch.func import vmap

    from fedrcl.losses.logit_calibration import calibration_offsets

    counts = torch.tensor([0, 1, 16, 81])
    assert calibration_offsets(counts, torch.tensor(2.0)).tolist() == pytest.approx([float("inf"), 2.0, 1.0, 2 / 3])
    assert calibration_offsets(counts, torch.tensor(0.0)).tolist() == [0.0, 0.0, 0.0, 0.0]
    taus = torch.tensor([0.0, 0.3, 1.7])
    mapped = vmap(lambda tau: calibration_offsets(counts, tau))(taus)
    for tau, row in zip(taus.tolist(), mapped):
        assert torch.equal(row, calibration_offsets(counts, tau))


def test_fedlc_tau_grid_together_equals_its_own_fit(data_root, tmp_path, capsys):
    """FedLC's tau 0 and 1 trained together (float64, 2 rounds): each within 1e-9 of its own fit, and apart."""
    common = args(data_root, tmp_path / "x", "--trainer.precision", "64-true", model="fedrcl.algorithms.FedLC")
    sweep.main(["--grid", "model.init_args.tau=0,1", "--seeds", "0", "--rounds", "2", "--together", *common,
                "--trainer.logger.init_args.save_dir", str(tmp_path / "together")])
    assert "--together:" not in capsys.readouterr().out
    weights = {}
    for tau in ("0", "1"):
        build_cli(["fit", *common, "--model.init_args.tau", tau, "--trainer.rounds", "2",
                   "--trainer.logger.init_args.save_dir", str(tmp_path / "alone")])
        alone = torch.load(tmp_path / "alone" / "quickstart" / f"version_{tau}" / "checkpoints" / "last.ckpt",
                           weights_only=True)
        weights[tau] = last(tmp_path / "together", f"tau={tau}/seed0")["state_dict"]
        assert relative_difference(weights[tau], alone["state_dict"]) <= 1e-9, tau
    assert relative_difference(weights["0"], weights["1"]) > 1e-4


def test_resume_leaves_out_runs_whose_logs_reach_the_budget(data_root, tmp_path, capsys):
    """``--ckpt_path last``: a run that logged its last round is done, with its checkpoints or without them
    (finished runs are kept as event files only), and is not trained again; with a larger ``--rounds`` the run
    with a checkpoint goes on from it and the one without starts anew, both said."""
    import shutil

    grid = ["--grid", "model.lr=0.05,0.1", "--seeds", "0"]
    common = args(data_root, tmp_path)
    sweep.main([*grid, "--rounds", "2", *common])
    shutil.rmtree(tmp_path / "quickstart" / "lr=0.05" / "seed0" / "version_0" / "checkpoints")
    capsys.readouterr()
    sweep.main([*grid, "--rounds", "2", *common, "--ckpt_path", "last"])
    said = capsys.readouterr().out
    for setting in ("lr=0.05", "lr=0.1"):
        assert f"fedrcl sweep: {setting} seed 0: done (round 2 logged in " in said
        assert not (tmp_path / "quickstart" / setting / "seed0" / "version_1").exists()
    sweep.main([*grid, "--rounds", "3", *common, "--ckpt_path", "last"])
    said = capsys.readouterr().out
    assert "lr=0.05 seed 0: no checkpoint in" in said and "done (" not in said
    assert last(tmp_path, "lr=0.1/seed0", version=1)["epoch"] == last(tmp_path, "lr=0.05/seed0", version=1)["epoch"] == 2
