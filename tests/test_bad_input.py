"""Bad configuration values, data files and checkpoints fail before training, naming the key."""
from __future__ import annotations

import shutil
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch

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


def test_yaml_error_names_the_file_and_the_line(data_root, tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  rounds: 2\n   local_epochs: [\n")
    with pytest.raises(SystemExit):
        run_cli(data_root, tmp_path, "--config", str(bad))
    err = capsys.readouterr().err
    assert f"{bad}: not valid YAML (line 3, column" in err


def test_empty_client_in_a_split_file_is_named(data_root, tmp_path):
    from fedrcl.data.split_file import write_split

    path = write_split(tmp_path / "split.json", [[0, 1, 2], [], [3, 4]], "digits")
    with pytest.raises(ValueError, match=r"split.json: client 1 holds no samples") as info:
        FederatedDataModule(dataset="digits", root=str(data_root), num_clients=3, partition_file=str(path))
    assert "batch_size" not in str(info.value)


def test_offline_download_says_what_to_do_in_a_few_lines(tmp_path, monkeypatch, capsys):
    """``configs/cifar100_a005.yaml`` without internet: what was fetched, where to put it, no traceback."""
    import urllib.error
    import urllib.request

    from conftest import REPO
    from fedrcl.cli import main

    def offline(*args, **kwargs):
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    root = tmp_path / "data"
    with pytest.raises(SystemExit) as info:
        main(["fit", "--config", str(REPO / "configs" / "cifar100_a005.yaml"), "--data.root", str(root),
              "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"), "--trainer.accelerator", "cpu",
              "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"])
    assert info.value.code == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) <= 2, err
    assert not list((tmp_path / "runs").rglob("version_*"))  # the failed start left no run folder
    for needed in ("https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz", "Temporary failure",
                   "put cifar-100-python.tar.gz", f"in '{root}'", "--data.download false"):
        assert needed in err, needed


def test_tinyimagenet_error_says_where_the_archive_comes_from(tmp_path):
    from fedrcl.data.datasets import DataUnavailableError, load_dataset

    with pytest.raises(DataUnavailableError) as info:
        load_dataset("tinyimagenet", tmp_path)
    assert "http://cs231n.stanford.edu/tiny-imagenet-200.zip" in str(info.value)
    assert str(tmp_path / "tiny-imagenet-200") in str(info.value)


@pytest.mark.parametrize("args", [["--trainer.round", "5"], ["--trainer.round=5"], ["--data.num_client", "5"],
                                  ["--data.batch", "8"]])
def test_abbreviated_keys_are_errors(data_root, tmp_path, capsys, args):
    """argparse would take ``--trainer.round`` for ``--trainer.rounds``: here it is an unknown key."""
    with pytest.raises(SystemExit):
        run_cli(data_root, tmp_path, *args)
    assert f"unrecognized arguments: {args[0]}" in capsys.readouterr().err
    assert not list(tmp_path.rglob("*.ckpt"))  # nothing trained


def test_torch_threads_must_be_positive(data_root, tmp_path):
    with pytest.raises(ValueError, match="torch_threads must be >= 1 or null, got 0"):
        run_cli(data_root, tmp_path, "--torch_threads", "0")


# -- the short form: what a user sees from ``fedrcl`` ------------------------------------------------------
def fedrcl(data_root: Path, save_dir: Path, *extra: str, subcommand: str = "fit") -> tuple[int, str]:
    """``fedrcl <subcommand>`` (``fedrcl.cli.main``) on the shrunk quickstart: exit status and stderr."""
    import contextlib
    import io

    from conftest import REPO
    from fedrcl.cli import main

    args = [subcommand, "--config", str(REPO / "configs" / "quickstart.yaml"), "--data.root", str(data_root),
            "--data.num_clients", "10", "--trainer.accelerator", "cpu", "--trainer.enable_model_summary", "false",
            "--trainer.logger.init_args.save_dir", str(save_dir), "--trainer.enable_progress_bar", "false"]
    if subcommand == "fit":
        args += ["--trainer.rounds", "1", "--trainer.local_epochs", "1", "--trainer.clients_per_round", "3"]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as info:
        main([*args, *extra])
    return info.value.code, err.getvalue()


def assert_short(err: str, message: str) -> None:
    assert message in err, err
    assert "Traceback" not in err and "usage:" not in err, err
    assert len(err.strip().splitlines()) <= 6, err  # Lightning's own lines (seed, devices) and ours


SHORT_CASES = [  # (arguments, the message, exit status): values, files, checkpoints, configs
    (["--data.alpha", "0"], "fedrcl: error: data.alpha must be > 0, got 0.0", 1),
    (["--data.val_fraction", "1"], "fedrcl: error: data.val_fraction must be in [0, 1), got 1.0", 1),
    (["--data.val_fraction", "0.1", "--data.feature_skew", "[rotation]"],
     "fedrcl: error: data.val_fraction with data.feature_skew: the validation set is not evaluated per domain", 1),
    (["--data.batch_size", "500"], "data.batch_size=500 is larger than client", 1),
    (["--trainer.clients_per_round", "20"], "trainer.clients_per_round=20 exceeds data.num_clients=10", 1),
    (["--torch_threads", "0"], "torch_threads must be >= 1 or null, got 0", 1),
    # LightningCLI's optimizer arguments would replace fedrcl's client optimizer for the whole run
    (["--optimizer", "Adam"], "fedrcl: error: optimizer: fedrcl builds each client's optimizer itself", 1),
    (["--lr_scheduler", "ExponentialLR", "--lr_scheduler.gamma", "0.9"], "fedrcl: error: lr_scheduler: fedrcl", 1),
    (["--trainer.barebones", "true"], "fedrcl: error: trainer.barebones: Lightning's barebones mode turns off", 1),
    (["--ckpt_path", "last"], "--ckpt_path last: nothing to resume under", 1),
    (["--ckpt_path", "nowhere.ckpt"], "--ckpt_path nowhere.ckpt: no such file", 1),
    (["--trainer.max_epochs", "3"], "trainer.max_epochs is set by fedrcl's round loop: use trainer.rounds", 2),
    (["--trainer.gradient_clip_val", "1"], "gradient_clip_val is set by fedrcl's round loop: use model.init_args", 2),
    (["--trainer.check_val_every_n_epoch", "2"], "use trainer.eval_every", 2),
    # a round would end before its clients did (the global model never aggregated), or steps would merge
    (["--trainer.limit_train_batches", "0.5"], "fedrcl: error: trainer.limit_train_batches must stay 1.0, got 0.5", 1),
    (["--trainer.accumulate_grad_batches", "2"], "fedrcl: error: trainer.accumulate_grad_batches must stay 1, got 2", 1),
    (["--trainer.round", "5"], "unrecognized arguments: --trainer.round 5", 2),
    (["--data.dataset", "mnist"], "data.dataset mnist: unknown dataset 'mnist'; allowed: cifar10", 2),
    (["--model", "fedrcl.algorithms.Nope"], "--model fedrcl.algorithms.Nope: not a class fedrcl can import", 2),
    # a constructor's refusal, named by the key as typed (the constructor says model.lr, conv_padding)
    (["--model.init_args.lr", "-0.1"], "fedrcl: error: model.init_args.lr must be > 0, got -0.1", 1),
    (["--model.init_args.backbone.conv_padding", "0"],
     "fedrcl: error: --model.init_args.backbone.conv_padding 0: SmallCNN: image_size=8 with conv_padding=0", 1),
    (["--trainer.gradient_clip_algorithm", "value"],
     "trainer.gradient_clip_algorithm is set by fedrcl's round loop: model.init_args.grad_clip_norm", 2),
    pytest.param(["--trainer.accelerator", "gpu"],
                 "fedrcl: error: trainer.accelerator gpu: this machine has none; available here: auto, cpu", 1,
                 marks=pytest.mark.skipif(torch.cuda.is_available() or torch.backends.mps.is_available(),
                                          reason="this machine has a GPU")),
]


@pytest.mark.parametrize("args, message, status", SHORT_CASES)
def test_a_user_error_is_its_message_without_traceback_or_run_folder(data_root, tmp_path, args, message, status):
    code, err = fedrcl(data_root, tmp_path / "runs", *args)
    assert code == status
    assert_short(err, message)
    assert not list(tmp_path.rglob("version_*")) and not list(tmp_path.rglob("*.yaml"))  # nothing left behind


@pytest.mark.parametrize("content, message", [
    ("", "the configuration file is empty"),
    ("data:\n  num_clinets: 10\n", "does not accept option 'data.num_clinets'"),
    ("trainer:\n  rounds: [\n", "not valid YAML (line 3, column"),
])
def test_a_bad_config_file_is_named_in_one_line(data_root, tmp_path, content, message):
    bad = tmp_path / "bad.yaml"
    bad.write_text(content)
    code, err = fedrcl(data_root, tmp_path / "runs", "--config", str(bad))
    assert code == 2
    assert_short(err, message)
    if "num_clinets" not in message:
        assert str(bad) in err


def test_a_refused_value_from_a_config_file_names_its_key(data_root, tmp_path):
    """Not typed on the command line: the key is the config's (``model.init_args.lr``), not the constructor's
    own name for it (``model.lr``)."""
    config = tmp_path / "lr.yaml"
    config.write_text("model:\n  init_args:\n    lr: -0.5\n")
    code, err = fedrcl(data_root, tmp_path / "runs", "--config", str(config))
    assert code == 1
    assert_short(err, "fedrcl: error: model.init_args.lr must be > 0, got -0.5")


def test_a_read_only_save_folder_is_one_line(data_root, tmp_path, monkeypatch):
    """The logger's first folder cannot be made (a read-only file system, as on a mounted dataset volume)."""
    import errno
    import os

    save_dir, makedirs = tmp_path / "runs", os.makedirs

    def read_only(path, *args, **kwargs):
        if Path(path).is_relative_to(save_dir):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return makedirs(path, *args, **kwargs)

    monkeypatch.setattr(os, "makedirs", read_only)
    code, err = fedrcl(data_root, save_dir)
    assert code == 1
    assert_short(err, f"fedrcl: error: {save_dir / 'quickstart'}: Read-only file system")


def test_a_full_disk_while_checkpointing_is_one_line_and_keeps_the_last_checkpoint(data_root, tmp_path,
                                                                                     monkeypatch):
    """The second write of last.ckpt meets a full disk: one line naming the file and that the earlier
    checkpoints are intact (torch's own report was two tracebacks ending in ``unexpected pos``)."""
    import faults

    faults.install("enospc:last.ckpt:2", monkeypatch)
    code, err = fedrcl(data_root, tmp_path / "runs", "--trainer.rounds", "3", "--trainer.checkpoint_every", "1")
    last = tmp_path / "runs" / "quickstart" / "version_0" / "checkpoints" / "last.ckpt"
    assert code == 1
    assert_short(err, f"fedrcl: error: checkpoint {last} not written (No space left on device")
    assert "the checkpoints written before it are intact" in err and "unexpected pos" not in err
    assert torch.load(last, weights_only=True)["epoch"] == 0  # round 1's, whole
    assert not list(last.parent.glob(".*.tmp"))


def test_fedrcl_debug_shows_the_traceback(data_root, tmp_path, monkeypatch):
    from fedrcl.cli import main
    from conftest import REPO

    monkeypatch.setenv("FEDRCL_DEBUG", "1")
    with pytest.raises(ValueError, match="data.alpha must be > 0"):
        main(["fit", "--config", str(REPO / "configs" / "quickstart.yaml"), "--data.root", str(data_root),
              "--data.alpha", "0", "--trainer.logger.init_args.save_dir", str(tmp_path)])


def test_an_unexpected_error_keeps_its_traceback_and_removes_the_empty_run(data_root, tmp_path, monkeypatch):
    """A bug (here a ZeroDivisionError inside the data module) is not dressed up as a user error."""
    from fedrcl.cli import main
    from conftest import REPO

    monkeypatch.setattr(FederatedDataModule, "client_num_samples", lambda self, k: 1 // 0)
    with pytest.raises(ZeroDivisionError):
        main(["fit", "--config", str(REPO / "configs" / "quickstart.yaml"), "--data.root", str(data_root),
              "--data.num_clients", "10", "--trainer.logger.init_args.save_dir", str(tmp_path),
              "--trainer.enable_progress_bar", "false"])
    assert not list(tmp_path.rglob("version_*"))


def test_a_failed_start_leaves_an_earlier_run_untouched(data_root, tmp_path):
    run_cli(data_root, tmp_path, rounds=1)
    before = {p: p.is_file() and p.stat().st_mtime_ns for p in tmp_path.rglob("*")}
    code, err = fedrcl(data_root, tmp_path, "--data.batch_size", "500")
    assert code == 1 and "data.batch_size=500" in err
    # version_1 came and went; every file of version_0 is as it was
    assert {p: p.is_file() and p.stat().st_mtime_ns for p in tmp_path.rglob("*")} == before


def test_validate_with_nothing_to_evaluate_is_one_message_and_no_folder(data_root, tmp_path):
    code, err = fedrcl(data_root, tmp_path / "runs", "--ckpt_path", "last", subcommand="validate")
    assert code == 1
    assert_short(err, "fedrcl: error: --ckpt_path last: nothing to evaluate under ")
    assert not list(tmp_path.rglob("validate_*"))


def test_resuming_with_fewer_rounds_than_the_checkpoint_names_the_key(data_root, tmp_path):
    run_cli(data_root, tmp_path, rounds=2)
    code, err = fedrcl(data_root, tmp_path, "--ckpt_path", "last")  # trainer.rounds 1
    assert code == 1
    assert_short(err, "trainer.rounds=1, but checkpoint ")
    assert "has already trained 2 rounds: set trainer.rounds to 2 or more" in err
    assert sorted(p.name for p in (tmp_path / "quickstart").iterdir()) == ["version_0"]


def test_weights_of_another_shape_are_refused_not_broadcast():
    """``load_state_`` (the broadcast into the client model, a resume, Flower's replies) names a tensor of
    another shape; ``copy_`` alone would broadcast ``zeros(1)`` into a bias of 10 without a word."""
    from fedrcl.contract.weights import load_state_

    layer = torch.nn.Linear(4, 10)
    state = {"weight": layer.weight.detach().clone(), "bias": torch.zeros(1)}
    with pytest.raises(ValueError, match=r"weights 'bias': shape \(1,\) does not fit the model's \(10,\)"):
        load_state_(layer, state)


# -- help offers only what can work; inputs with bounds ------------------------------------------------------
def test_help_offers_no_key_that_is_always_refused(capsys):
    """``--optimizer`` / ``--lr_scheduler`` (every torch.optim class listed, always refused) and
    ``--trainer.barebones`` (a traceback) are not offered; they still parse, so saved configs load."""
    from fedrcl.cli import main

    with pytest.raises(SystemExit) as info:
        main(["fit", "--help"])
    assert info.value.code == 0
    shown = capsys.readouterr().out
    assert "--trainer.rounds" in shown and "--data.partition_file" in shown
    for key in ("--optimizer", "--lr_scheduler", "--trainer.barebones", "torch.optim.lr_scheduler"):
        assert key not in shown, key


def test_a_saved_configs_null_optimizer_and_false_barebones_still_load(data_root, tmp_path):
    """Configs saved before these keys were hidden hold ``optimizer: null``, ``lr_scheduler: null`` and
    ``trainer.barebones: false``."""
    saved = tmp_path / "config.yaml"
    saved.write_text("trainer:\n  barebones: false\noptimizer: null\nlr_scheduler: null\n")
    cli = run_cli(data_root, tmp_path, "--config", str(saved), rounds=1, model="fedrcl.algorithms.FedAvg")
    assert cli.trainer.current_epoch == 1


def test_barebones_is_one_line(data_root, tmp_path):
    code, err = fedrcl(data_root, tmp_path / "runs", "--trainer.barebones", "true")
    assert code == 1
    assert_short(err, "fedrcl: error: trainer.barebones: Lightning's barebones mode turns off the loggers and "
                      "callbacks a federated run is made of")


def test_several_nodes_without_a_launcher_are_refused_in_one_line(data_root, tmp_path, monkeypatch):
    """Without torchrun / SLURM and without MASTER_ADDR, MASTER_PORT, NODE_RANK no other node can ever join:
    the run waited for ever without a word (here it would fail instead of waiting)."""
    import torch.distributed

    def would_wait(*args, **kwargs):
        raise AssertionError("the run went on to wait for the other nodes")

    monkeypatch.setattr(torch.distributed, "init_process_group", would_wait)
    for key in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "GROUP_RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    code, err = fedrcl(data_root, tmp_path / "runs", "--trainer.num_nodes", "2")
    assert code == 1
    assert_short(err, "fedrcl: error: trainer.num_nodes=2 without a launcher (torchrun, SLURM's srun) needs "
                      "MASTER_ADDR, MASTER_PORT, NODE_RANK in the environment of each node's command")
    assert not list(tmp_path.rglob("version_*"))


def test_several_nodes_say_what_they_wait_for(data_root, tmp_path):
    """With the variables set, node 0 says where it waits for the others (and waits: ended here)."""
    import os
    import signal
    import subprocess
    import sys
    import threading

    from conftest import REPO
    from fedrcl.flower.localhost import free_port

    port = free_port()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "NODE_RANK": "0",
           "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    child = subprocess.Popen(
        [sys.executable, "-m", "fedrcl.cli", "fit", "--config", str(REPO / "configs" / "quickstart.yaml"),
         "--data.root", str(data_root), "--trainer.accelerator", "cpu", "--trainer.num_nodes", "2",
         "--trainer.logger.init_args.save_dir", str(tmp_path / "runs")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    waiting = threading.Event()

    def read() -> None:
        assert child.stdout is not None
        for line in child.stdout:
            lines.append(line)
            if "waits for" in line:
                waiting.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        assert waiting.wait(timeout=120), "".join(lines)
    finally:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    said = next(line for line in lines if "waits for" in line).strip()
    assert said == f"trainer.num_nodes=2: node 0 waits for the other nodes' processes (2 in all) at 127.0.0.1:{port}"


def alias_bomb(path: Path) -> Path:
    """A YAML "billion laughs": 9 strings, each level 9 aliases of the one before: 9**9 strings when loaded."""
    lines = ['a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for before, name in zip("abcdefgh", "bcdefghi"):
        lines.append(f"{name}: &{name} [{', '.join([f'*{before}'] * 9)}]")
    path.write_text("\n".join(lines) + "\n")
    return path


# The imports first, then an address-space cap of 512 MiB above them: what reading the config may take. Each
# argument list (one per line on stdin) is one ``fedrcl`` command; its exit status is printed.
CAPPED = """
import json, resource, sys
from pathlib import Path
import fedrcl.lightning_cli
from fedrcl.cli import main
size = int(Path('/proc/self/status').read_text().split('VmSize:')[1].split()[0]) * 1024 + (512 << 20)
resource.setrlimit(resource.RLIMIT_AS, (size, size))
for line in sys.stdin:
    try:
        main(json.loads(line))
    except SystemExit as stop:
        print(stop.code, flush=True)
"""


def test_a_yaml_alias_bomb_is_refused_naming_the_file_or_key_under_a_memory_cap(data_root, tmp_path):
    """In a config file it ran for minutes and ended in MemoryError / IndexError (99-118 lines); typed as a
    value (jsonargparse loads values with PyYAML too) it took all the memory there was."""
    import json
    import os
    import subprocess
    import sys

    from conftest import REPO

    bomb = alias_bomb(tmp_path / "bomb.yaml")
    common = ["fit", "--config", str(REPO / "configs" / "quickstart.yaml"), "--data.root", str(data_root),
              "--trainer.logger.init_args.save_dir", str(tmp_path / "runs")]
    typed = "{" + bomb.read_text().replace("\n", ", ") + "}"
    commands = [[*common, "--config", str(bomb)], [*common, "--trainer.resume_allow_changes", typed]]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    env.pop("FEDRCL_DEBUG", None)
    done = subprocess.run([sys.executable, "-c", CAPPED], input="".join(json.dumps(c) + "\n" for c in commands),
                          env=env, capture_output=True, text=True, timeout=180)
    assert done.stdout.split() == ["2", "1"], done.stderr[-3000:]
    assert "MemoryError" not in done.stderr and "Traceback" not in done.stderr, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert f"fedrcl fit: error: {bomb}: refused, its aliases expand to more than 100000 values (a config has a " \
           "few hundred)" in lines
    assert "fedrcl: error: --trainer.resume_allow_changes: refused, its aliases expand to more than 100000 " \
           "values (a config has a few hundred)" in lines
    assert len(lines) <= 6, lines


@pytest.mark.parametrize("content, message", [
    ("trainer:\n  resume_allow_changes: &x [*x]\n", "refused, an alias refers to the value that holds it"),
    ("# " + "x" * (1 << 20) + "\ntrainer:\n  rounds: 1\n", "bytes, more than a configuration file needs"),
])
def test_a_config_that_refers_to_itself_or_is_too_large_is_one_line(data_root, tmp_path, content, message):
    bad = tmp_path / "bad.yaml"
    bad.write_text(content)
    code, err = fedrcl(data_root, tmp_path / "runs", "--config", str(bad))
    assert code == 2
    assert_short(err, f"{bad}: ")
    assert message in err


def test_a_yaml_file_given_as_a_value_is_bounded_too(data_root, tmp_path):
    """``--key FILE.yaml``: jsonargparse reads the file as that key's value, with PyYAML."""
    bad = tmp_path / "server.yaml"
    bad.write_text("class_path: fedrcl.server.FedAvgM\ninit_args: &x {momentum: *x}\n")
    code, err = fedrcl(data_root, tmp_path / "runs", "--trainer.server", str(bad))
    assert code == 1
    assert_short(err, f"fedrcl: error: --trainer.server {bad}: refused, an alias refers to the value that holds it")


def test_a_save_dir_that_is_a_file_is_one_line(data_root, tmp_path):
    taken = tmp_path / "runs"
    taken.write_text("my notes\n")
    code, err = fedrcl(data_root, taken)
    assert code == 1
    assert_short(err, f"fedrcl: error: trainer.logger save_dir {taken}: it is a file, not a folder")
    assert taken.read_text() == "my notes\n"


class RemoveRunFolder(L.Callback):
    """Deletes the run folder at the start of round ``round`` (as a user cleaning up by mistake)."""

    def __init__(self, round: int = 2):
        self.round = round

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.current_epoch + 1 == self.round:
            shutil.rmtree(trainer.log_dir)


def test_a_run_folder_deleted_mid_run_is_one_line_naming_it(data_root, tmp_path):
    """It ended in two tracebacks (139 lines) of TensorBoard's writer on a file that was gone."""
    code, err = fedrcl(data_root, tmp_path / "runs", "--trainer.rounds", "3",
                       "--trainer.callbacks+=test_bad_input.RemoveRunFolder")
    run = tmp_path / "runs" / "quickstart" / "version_0"
    assert code == 1
    assert_short(err, f"fedrcl: error: the run folder {run} was deleted while the run wrote into it (round 2), "
                      "its checkpoints with it; start the run again")


def test_a_full_disk_at_start_names_the_run_folder_and_resumes(data_root, tmp_path, monkeypatch):
    """Lightning's hparams.yaml meets a full disk at the start of a resume: one line naming where, saying that
    the run can resume (it said only ``No space left on device``); then it resumes."""
    import faults

    run_cli(data_root, tmp_path, rounds=1)
    with monkeypatch.context() as patch:
        faults.install("enospc:hparams.yaml:1", patch)
        code, err = fedrcl(data_root, tmp_path, "--ckpt_path", "last", "--trainer.rounds", "2")
    assert code == 1
    assert_short(err, f"fedrcl: error: {tmp_path / 'quickstart' / 'version_1'}: No space left on device "
                      "(injected), writing into the run folder; make room, then resume with --ckpt_path last (the "
                      f"newest usable checkpoint under {tmp_path / 'quickstart'})")
    resumed = run_cli(data_root, tmp_path, "--ckpt_path", "last", rounds=2)
    assert resumed.trainer.current_epoch == 2
