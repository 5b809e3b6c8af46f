"""``fedrcl validate`` / ``test`` report the checkpoint's own EMA and never touch the training curves."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import run_cli
from fedrcl.analysis.catalogue import collect_runs, find_runs
from fedrcl.analysis.runs import load_scalars


@pytest.fixture(scope="module")
def fit_run(data_root, tmp_path_factory) -> tuple[Path, Path]:
    save_dir = tmp_path_factory.mktemp("runs")
    fit = run_cli(data_root, save_dir, rounds=3)
    return save_dir, Path(fit.trainer.logger.log_dir)


@pytest.mark.parametrize("subcommand", ["validate", "test"])
def test_evaluation_keeps_the_run_and_its_ema(data_root, fit_run, subcommand):
    save_dir, log_dir = fit_run
    run = log_dir.parent
    before = load_scalars(run)
    ckpt = log_dir / "checkpoints" / "last.ckpt"
    evaluated = run_cli(data_root, save_dir, "--ckpt_path", str(ckpt), subcommand=subcommand)
    metrics = evaluated.trainer.callback_metrics
    if subcommand == "validate":  # the checkpoint's EMA, not one step further
        saved_ema = torch.load(ckpt, weights_only=True)["acc_ema"]
        assert metrics["val/acc_ema"].item() == pytest.approx(saved_ema, abs=1e-7)
        assert metrics["val/acc_ema"].item() == pytest.approx(before["val/acc_ema"][1][-1], abs=1e-7)
    assert metrics[f"{subcommand}/acc" if subcommand == "test" else "val/acc"].item() == \
        pytest.approx(before["val/acc"][1][-1])
    # Logged beside the run, never as one of its versions: its curves, runs and report are unchanged.
    eval_dir = Path(evaluated.trainer.log_dir)
    assert eval_dir == run / f"{subcommand}_0" and (eval_dir / "config.yaml").is_file()
    assert sorted(p.name for p in run.glob("version_*")) == ["version_0"]
    after = load_scalars(run)
    assert after.keys() == before.keys()
    for tag, (rounds, values) in before.items():
        assert after[tag][0].tolist() == rounds.tolist() and after[tag][1].tolist() == values.tolist(), tag
    assert list(find_runs(save_dir)) == [run.name]
    assert [r.path for r in collect_runs(save_dir)] == [run]


def test_validate_last_finds_the_fit_runs_checkpoint(data_root, fit_run):
    save_dir, log_dir = fit_run
    saved_ema = torch.load(log_dir / "checkpoints" / "last.ckpt", weights_only=True)["acc_ema"]
    evaluated = run_cli(data_root, save_dir, "--ckpt_path", "last", subcommand="validate")
    assert evaluated.trainer.callback_metrics["val/acc_ema"].item() == pytest.approx(saved_ema, abs=1e-7)
    assert Path(evaluated.trainer.log_dir).parent == log_dir.parent
    assert Path(evaluated.trainer.log_dir).name.startswith("validate_")


def test_validate_without_a_checkpoint_reports_no_ema(data_root, tmp_path):
    evaluated = run_cli(data_root, tmp_path, subcommand="validate")
    assert "val/acc" in evaluated.trainer.callback_metrics
    assert "val/acc_ema" not in evaluated.trainer.callback_metrics


def test_the_default_logger_also_logs_apart(tmp_path):
    from jsonargparse import Namespace

    from fedrcl.cli import _log_apart

    (tmp_path / "fedrcl" / "test_0").mkdir(parents=True)
    trainer = Namespace(logger=True, default_root_dir=str(tmp_path))
    _log_apart(trainer, "test")
    assert trainer.logger.init_args == Namespace(save_dir=str(tmp_path), name="fedrcl", version="test_1")
