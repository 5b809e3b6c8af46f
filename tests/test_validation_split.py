"""The validation split (``data.val_fraction``): held out per client, evaluated beside the test set, never trained."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import run_cli
from fedrcl import seeds
from fedrcl.data.validation import held_out_count, hold_out
from test_together import args as together_args, last


def test_held_out_count_hand_cases():
    assert [held_out_count(n, 0.1) for n in (0, 1, 2, 5, 10, 14, 15, 100)] == [0, 0, 1, 1, 1, 1, 2, 10]
    assert held_out_count(100, 0.0) == 0
    assert held_out_count(3, 0.9) == 2  # a client keeps one sample to train on


def test_hold_out_hand_case():
    """Two clients, a fifth held out: one sample each, the rest in the given order."""
    parts = [np.array([9, 3, 5, 1, 7]), np.array([2, 4, 6, 8, 0])]
    train, val = hold_out(parts, 0.2, seed=0)
    assert [len(p) for p in train] == [4, 4] and len(val) == 2
    for part, kept, held in zip(parts, train, (val[:1], val[1:])):
        assert sorted([*kept, *held]) == sorted(part)
        assert list(kept) == [i for i in part if i not in held]  # the order kept


def test_hold_out_is_a_pure_disjoint_split():
    rng = np.random.default_rng(3)
    perm = rng.permutation(1000)
    parts = [np.sort(perm[a:b]) for a, b in ((0, 400), (400, 430), (430, 431), (431, 1000))]
    train, val = hold_out(parts, 0.25, seed=11)
    again, val_again = hold_out(parts, 0.25, seed=11)
    assert all(np.array_equal(a, b) for a, b in zip(train, again)) and np.array_equal(val, val_again)
    assert [len(p) for p in train] == [300, 22, 1, 427]  # 100, 8 (round 7.5 -> 8), 0 (one sample), 142
    everything = np.concatenate([*train, val])
    assert len(np.unique(everything)) == len(everything) == 1000
    _, other = hold_out(parts, 0.25, seed=12)
    assert not np.array_equal(np.sort(val), np.sort(other))  # the data seed chooses
    with pytest.raises(ValueError, match=r"data.val_fraction must be in \[0, 1\), got 1.0"):
        hold_out(parts, 1.0, seed=0)


def scalars(log_dir: Path) -> dict[str, list[float]]:
    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def accuracy(module, x: torch.Tensor, y: torch.Tensor) -> float:
    module.eval()
    with torch.no_grad():
        return float((module.backbone(x).logits.argmax(-1) == y).double().mean())


def test_fit_evaluates_validation_and_test_sets(data_root, tmp_path):
    """``val/acc`` is the accuracy on the held-out samples and ``test/acc`` on the test set, each recomputed here
    from the final global model; no held-out sample is in a client's training part; split.json keeps the whole
    parts; the EMAs are in the checkpoint."""
    fit = run_cli(data_root, tmp_path, "--data.val_fraction", "0.2", rounds=3)
    dm, module = fit.datamodule, fit.model
    log_dir = Path(fit.trainer.logger.log_dir)
    logged = scalars(log_dir)
    assert {"val/acc", "val/acc_ema", "test/acc", "test/acc_ema"} <= logged.keys()
    assert len(logged["val/acc"]) == len(logged["test/acc"]) == 3
    held = dm.val_indices
    x_val = dm.model_input(dm.x_train[held])
    assert logged["val/acc"][-1] == pytest.approx(accuracy(module, x_val, dm.y_train[held]), abs=1e-6)
    assert logged["test/acc"][-1] == pytest.approx(accuracy(module, dm.model_input(dm.x_test), dm.y_test), abs=1e-6)
    training = torch.cat(dm.client_indices)
    assert not torch.isin(held, training).any()
    whole = json.loads((log_dir / "split.json").read_text())
    assert sum(len(p) for p in whole["clients"]) == len(training) + len(held)
    saved = torch.load(log_dir / "checkpoints" / "last.ckpt", weights_only=True)
    assert saved["acc_ema"] == pytest.approx(logged["val/acc_ema"][-1], abs=1e-7)
    assert saved["test_acc_ema"] == pytest.approx(logged["test/acc_ema"][-1], abs=1e-7)


def test_without_a_split_val_is_the_test_set(data_root, tmp_path):
    fit = run_cli(data_root, tmp_path, rounds=1)
    logged = scalars(Path(fit.trainer.logger.log_dir))
    assert "test/acc" not in logged and fit.datamodule.val_indices is None
    dm = fit.datamodule
    assert logged["val/acc"][-1] == pytest.approx(accuracy(fit.model, dm.model_input(dm.x_test), dm.y_test), abs=1e-6)


def test_seeds_together_evaluate_both_sets_as_fit(data_root, tmp_path, capsys):
    """Two seeds trained together log the same validation and test accuracies as each seed's own fit."""
    common = together_args(data_root, tmp_path / "x", "--data.val_fraction", "0.2", rounds=2)
    seeds.main(["--seeds", "0", "1", "--together", *common,
                "--trainer.logger.init_args.save_dir", str(tmp_path / "together")])
    assert "--together:" not in capsys.readouterr().out  # no fallback
    seeds.main(["--seeds", "0", "1", *common, "--trainer.logger.init_args.save_dir", str(tmp_path / "alone")])
    for seed in (0, 1):
        runs = [tmp_path / kind / "quickstart" / f"seed{seed}" / "version_0" for kind in ("together", "alone")]
        together, alone = scalars(runs[0]), scalars(runs[1])
        for tag in ("val/acc", "val/acc_ema", "test/acc", "test/acc_ema"):
            assert together[tag] == pytest.approx(alone[tag], abs=1e-6), (seed, tag)
        assert last(tmp_path / "together", seed)["test_acc_ema"] == \
            pytest.approx(last(tmp_path / "alone", seed)["test_acc_ema"], abs=1e-6)
