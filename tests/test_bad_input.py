"""Bad configuration values, data files and checkpoints fail before training, naming the key."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from conftest import run_cli
from fedrcl.data.datamodule import FederatedDataModule


@pytest.mark.parametrize("kwargs, message", [
    ({"alpha": 0.0}, "data.alpha must be > 0"),
    ({"alpha": -1.0}, "data.alpha must be > 0"),
    ({"dataset": "mnist"}, "unknown dataset 'mnist'"),
    ({"partition": "pathological"}, "data.partition must be one of"),
    ({"num_clients": 0}, "data.num_clients must be >= 1"),
    ({"batch_size": 0}, "data.batch_size must be >= 1"),
    ({"local_iters_per_epoch": 0}, "data.local_iters_per_epoch"),
])
def test_datamodule_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FederatedDataModule(**kwargs)


def test_more_clients_than_samples(data_root):
    dm = FederatedDataModule(dataset="digits", root=str(data_root), num_clients=5000)
    with pytest.raises(ValueError, match="num_clients"):
        dm.setup("fit")


def test_batch_larger_than_a_client(data_root):
    dm = FederatedDataModule(dataset="digits", root=str(data_root), num_clients=100, batch_size=50)
    with pytest.raises(ValueError, match="data.batch_size=50 is larger than client"):
        dm.setup("fit")


def test_missing_root_without_download(tmp_path):
    dm = FederatedDataModule(dataset="cifar10", root=str(tmp_path / "nowhere"), download=False)
    with pytest.raises(FileNotFoundError, match="download"):
        dm.setup("fit")


def test_malformed_npz(tmp_path):
    np.savez(tmp_path / "digits.npz", x_train=np.zeros((4, 8, 8, 1), np.float32), y_train=np.zeros(4, np.int64))
    dm = FederatedDataModule(dataset="digits", root=str(tmp_path))
    with pytest.raises(ValueError, match="digits.npz"):
        dm.setup("fit")


def test_clients_per_round_above_num_clients(data_root, tmp_path):
    with pytest.raises(ValueError, match="clients_per_round=20 exceeds data.num_clients=10"):
        run_cli(data_root, tmp_path, "--trainer.clients_per_round", "20")


@pytest.mark.parametrize("args, message", [
    (["--trainer.max_epochs", "3"], "trainer.max_epochs is set by fedrcl"),
    (["--trainer.gradient_clip_val", "1.0"], "trainer.gradient_clip_val is set by fedrcl"),
    (["--trainer.participation", "0.5"], "exactly one of trainer.clients_per_round and trainer.participation"),
    (["--model.init_args.pos_topk", "null"], "pos_topk and model.neg_topk"),
    (["--model.init_args.levels", "[7]"], "model.levels entry 7"),
])
def test_bad_trainer_and_model_values(data_root, tmp_path, args, message):
    with pytest.raises(ValueError, match=message):
        run_cli(data_root, tmp_path, *args)


def test_unknown_key_in_a_config_is_an_error(data_root, tmp_path, capsys):
    (tmp_path / "typo.yaml").write_text("data:\n  num_clinets: 10\n")
    with pytest.raises(SystemExit):
        run_cli(data_root, tmp_path, "--config", str(tmp_path / "typo.yaml"))
    assert "num_clinets" in capsys.readouterr().err


def test_checkpoint_from_another_configuration(data_root, tmp_path):
    first = run_cli(data_root, tmp_path, rounds=1)
    ckpt = Path(first.trainer.logger.log_dir) / "checkpoints" / "last.ckpt"
    with pytest.raises(ValueError, match="data.seed was 0 there and is 1 here"):
        run_cli(data_root, tmp_path / "other", "--data.seed", "1", "--ckpt_path", str(ckpt), rounds=2)


def test_batch_size_null_follows_the_papers_rule(data_root):
    """batch_size null: the smallest client's size over local_iters_per_epoch (10 steps per epoch)."""
    dm = FederatedDataModule(dataset="digits", root=str(data_root), num_clients=10, batch_size=None,
                             local_iters_per_epoch=10)
    dm.setup("fit")
    assert dm.batch_size == min(len(i) for i in dm.client_indices) // 10
    with pytest.raises(ValueError, match="batch_size may be null only with data.local_iters_per_epoch"):
        FederatedDataModule(dataset="digits", batch_size=None)


def test_resume_with_another_split_file_is_refused(data_root, tmp_path):
    first = run_cli(data_root, tmp_path, rounds=1)
    log_dir = Path(first.trainer.logger.log_dir)
    with pytest.raises(ValueError, match="data.partition_file was None there"):
        run_cli(data_root, tmp_path / "other", "--data.partition_file", str(log_dir / "split.json"),
                "--ckpt_path", str(log_dir / "checkpoints" / "last.ckpt"), rounds=2)
