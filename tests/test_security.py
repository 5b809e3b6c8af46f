"""Nothing executed, nothing shared, nothing unbounded (issue 50).

A checkpoint is never unpickled, whatever its path or URL and whatever ``--weights_only`` says; a run folder has
one writer; a file the user names is read up to a bound; a seed is checked; a closed pipe or a full device ends
quietly or in one line. Each test here failed before the fix it pins.
"""
from __future__ import annotations

import contextlib
import functools
import http.server
import io
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from conftest import REPO, run_cli

QUICK = ["--config", str(REPO / "configs" / "quickstart.yaml"), "--data.num_clients", "10",
         "--trainer.accelerator", "cpu", "--trainer.enable_model_summary", "false",
         "--trainer.enable_progress_bar", "false"]
FIT_QUICK = ["--trainer.rounds", "1", "--trainer.local_epochs", "1", "--trainer.clients_per_round", "3"]


class Payload:
    """What a malicious checkpoint carries: unpickling it creates the file ``marker``."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def payload_checkpoint(path: Path, marker: Path) -> Path:
    torch.save({"state_dict": {}, "epoch": 0, "global_step": 0, "payload": Payload(marker)}, path)
    return path


@contextlib.contextmanager
def served(folder: Path) -> Iterator[str]:
    """``folder`` served over HTTP on localhost; yields the base URL."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(folder))
    handler.log_message = lambda *args: None  # type: ignore[method-assign]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def fedrcl_main(*args: str) -> tuple[int, str]:
    """``fedrcl.cli.main(args)``: exit status and stderr."""
    from fedrcl.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as info:
        main(list(args))
    return info.value.code, err.getvalue()


def one_line(err: str, message: str) -> None:
    assert message in err, err
    assert "Traceback" not in err, err
    assert len([line for line in err.strip().splitlines() if "error" in line]) == 1, err
    assert len(err.strip().splitlines()) <= 4, err


@pytest.fixture
def payload(tmp_path, monkeypatch) -> Iterator[tuple[str, Path, Path]]:
    """(the payload checkpoint's URL on localhost, its local file, the file its payload would create). Its name
    is the test's own and torch.hub's cache is the test's (``TORCH_HOME``): torch.hub caches by file name."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch-home"))
    marker = tmp_path / "payload-ran"
    ckpt = payload_checkpoint(tmp_path / f"{tmp_path.name}.ckpt", marker)
    with served(tmp_path) as url:
        yield f"{url}/{ckpt.name}", ckpt, marker
    assert not (tmp_path / "torch-home").exists(), "torch.hub cached a checkpoint"


@pytest.mark.parametrize("subcommand", ["fit", "validate", "test"])
def test_a_checkpoint_url_is_refused(subcommand, payload, data_root, tmp_path):
    url, _, marker = payload
    fit = FIT_QUICK if subcommand == "fit" else []
    code, err = fedrcl_main(subcommand, *QUICK, *fit, "--data.root", str(data_root),
                            "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"), "--ckpt_path", url)
    assert not marker.exists()
    assert code == 1
    one_line(err, f"fedrcl: error: --ckpt_path {url}: a remote checkpoint (http://) is not read")
    assert "download it first" in err
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("chain", ["simplecache::file://{}", "file://{}", "{}"])
def test_a_local_checkpoint_is_read_weights_only_whatever_weights_only_says(chain, payload, data_root, tmp_path):
    _, ckpt, marker = payload
    code, err = fedrcl_main("fit", *QUICK, *FIT_QUICK, "--data.root", str(data_root),
                            "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"),
                            "--ckpt_path", chain.format(ckpt), "--weights_only", "false")
    assert not marker.exists()
    assert code == 1
    assert "fedrcl: --weights_only false is ignored: checkpoints are always read with weights_only=True" in err
    one_line(err, f"fedrcl: error: checkpoint {ckpt} is not loadable with weights_only=True (it holds io.open, "
                  "which only unpickling with code execution makes); fedrcl never unpickles a checkpoint")


def test_other_fsspec_chains_and_the_registry_are_refused(tmp_path):
    from fedrcl.federated.checkpoint import local_checkpoint

    ckpt = tmp_path / "a.ckpt"
    assert local_checkpoint(f"simplecache::file://{ckpt}") == str(ckpt)
    assert local_checkpoint(f"filecache::file://{ckpt}") == str(ckpt)
    assert local_checkpoint(f"file://{ckpt}") == str(ckpt)
    assert local_checkpoint("last") == "last" and local_checkpoint(None) is None
    for url, words in [("s3://bucket/a.ckpt", "remote checkpoint (s3://)"),
                       ("simplecache::https://host/a.ckpt", "remote checkpoint (https://)"),
                       (f"zip://a.ckpt::file://{tmp_path}/b.zip", "an fsspec chain other than a cache"),
                       ("registry:model:v1", "Lightning's model registry")]:
        with pytest.raises(ValueError, match=re.escape(words)):
            local_checkpoint(url)


def test_the_checkpoint_io_never_unpickles(payload):
    """A user's own ``Trainer.fit(ckpt_path=URL, weights_only=False)`` reaches Lightning's CheckpointIO."""
    from fedrcl.federated.checkpoint import AtomicCheckpointIO, UnreadableCheckpoint

    url, ckpt, marker = payload
    with pytest.raises(ValueError, match="remote checkpoint"):
        AtomicCheckpointIO().load_checkpoint(url, weights_only=False)
    with pytest.raises(UnreadableCheckpoint, match="weights_only=True"):
        AtomicCheckpointIO().load_checkpoint(f"simplecache::file://{ckpt}", weights_only=False)
    assert not marker.exists()


@pytest.mark.parametrize("together", [False, True])
def test_seeds_refuse_a_checkpoint_url(together, payload, data_root, tmp_path):
    url, _, marker = payload
    code, err = fedrcl_main("seeds", "--seeds", "0", *(["--together"] if together else []), *QUICK, *FIT_QUICK,
                            "--data.root", str(data_root), "--trainer.logger.init_args.save_dir",
                            str(tmp_path / "runs"), "--ckpt_path", url)
    assert not marker.exists()
    assert code == 1
    assert f"--ckpt_path {url}: a remote checkpoint (http://) is not read" in err, err
    assert "Traceback" not in err, err


def test_flower_simulation_refuses_a_bad_checkpoint_in_one_line(payload, data_root, tmp_path, capsys):
    pytest.importorskip("flwr")
    from fedrcl.flower.simulation import main

    url, ckpt, marker = payload
    for path, message in [(url, "a remote checkpoint (http://) is not read"),
                          (str(ckpt), "is not loadable with weights_only=True")]:
        with pytest.raises(SystemExit) as info:
            main([*QUICK, *FIT_QUICK, "--data.root", str(data_root), "--trainer.logger.init_args.save_dir",
                  str(tmp_path / "runs"), "--ckpt_path", path])
        err = capsys.readouterr().err
        assert info.value.code == 1
        one_line(err, f"python -m fedrcl.flower: error: ")
        assert message in err, err
    assert not marker.exists()


def test_check_refuses_a_checkpoint_url(payload, data_root, tmp_path):
    url, _, marker = payload
    out = subprocess.run([sys.executable, "-m", "fedrcl.cli", "check", "--backends", "sequential", "--rounds", "1",
                          *QUICK, "--data.root", str(data_root), "--ckpt_path", url],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert not marker.exists()
    assert out.returncode == 1
    assert f"refused: --ckpt_path {url}: a remote checkpoint (http://) is not read" in out.stdout, out.stdout


def together_args(data_root: Path, save_dir: Path, rounds: int) -> list[str]:
    return [*QUICK, "--model", "fedrcl.algorithms.FedAvg", "--data.root", str(data_root), "--trainer.callbacks",
            "[]", "--trainer.logger.init_args.save_dir", str(save_dir), "--trainer.rounds", str(rounds),
            "--trainer.local_epochs", "1", "--data.local_iters_per_epoch", "2", "--trainer.clients_per_round", "3"]


def test_together_names_the_one_seed_without_a_usable_checkpoint(data_root, tmp_path, capsys):
    """One seed's checkpoints all truncated: the run stops naming that seed alone, with the way to start it anew
    while the others resume; done so, the other seed resumes and this one starts at round 1."""
    from fedrcl import seeds

    seeds.main(["--seeds", "0", "1", "--together", *together_args(data_root, tmp_path, 1)])
    for ckpt in (tmp_path / "quickstart" / "seed1").rglob("*.ckpt"):
        ckpt.write_bytes(ckpt.read_bytes()[:100])
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        seeds.main(["--seeds", "0", "1", "--together", *together_args(data_root, tmp_path, 2), "--ckpt_path", "last"])
    err = capsys.readouterr().err
    assert info.value.code == 1
    seed1 = tmp_path / "quickstart" / "seed1"
    line = next(line for line in err.splitlines() if "error:" in line)
    assert line == (f"fedrcl seeds --together: error: seed 1: --ckpt_path last: nothing to resume under {seed1} (2 "
                    "checkpoint file(s), none usable: see the warnings above); to start seed 1 anew and resume the "
                    f"others, move {seed1} away and run the same command again"), err
    assert "Traceback" not in err and "seed 0" not in err, err
    seed1.rename(tmp_path / "seed1-damaged")
    seeds.main(["--seeds", "0", "1", "--together", *together_args(data_root, tmp_path, 2), "--ckpt_path", "last"])
    assert "seed 1: no checkpoint in" in capsys.readouterr().out
    assert torch.load(tmp_path / "quickstart" / "seed0" / "version_1" / "checkpoints" / "last.ckpt",
                      weights_only=True)["epoch"] == 1  # resumed after round 1, ended after round 2
    assert (seed1 / "version_0" / "checkpoints" / "last.ckpt").is_file()


def test_check_says_a_backend_timed_out(data_root, tmp_path, monkeypatch, capsys):
    from fedrcl.check import main

    (tmp_path / "hanging_method.py").write_text(
        "import time\nfrom fedrcl.algorithms import FedAvg\n\n\nclass Hanging(FedAvg):\n"
        "    def training_step(self, batch, batch_idx):\n        time.sleep(600)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(SystemExit) as info:
        main(["--backends", "sequential", "--rounds", "1", "--timeout", "3", *QUICK, "--data.root", str(data_root),
              "--model", "hanging_method.Hanging"])
    out = capsys.readouterr().out
    assert info.value.code == 1
    assert "| sequential |" in out and "|  | timed out after 3 s (--timeout) |" in out, out


@pytest.mark.parametrize("given", [["-1"], ["0", "-5"], ["4294967296"]])
def test_seeds_outside_numpys_bounds_are_refused_in_one_line(given, capsys):
    from fedrcl import seeds

    with pytest.raises(SystemExit) as info:
        seeds.main(["--seeds", *given, "--config", str(REPO / "configs" / "quickstart.yaml")])
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert f"fedrcl seeds: error: --seeds {given[-1]}: a seed must be 0 <= seed < 2**32" in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 2, err  # argparse's usage line and this


@pytest.mark.parametrize("key, seed", [("seed_everything", "-1"), ("trainer.seed", "4294967296"), ("data.seed", "-1")])
def test_a_fit_seed_outside_numpys_bounds_is_refused(key, seed, data_root, tmp_path):
    code, err = fedrcl_main("fit", *QUICK, *FIT_QUICK, "--data.root", str(data_root),
                            "--trainer.logger.init_args.save_dir", str(tmp_path), f"--{key}", seed)
    assert code == 1
    one_line(err, f"fedrcl: error: {key}: a seed must be 0 <= seed < 2**32 (numpy's and torch's generators take no "
                  f"other), got {seed}")


def shell(command: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", f"set -o pipefail; {command}"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"})


@pytest.mark.parametrize("command", ["fedrcl fit --help | head -1", "fedrcl methods | head -1",
                                     "fedrcl --help | head -1"])
def test_a_closed_pipe_ends_quietly(command):
    done = shell(command)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert len(done.stdout.splitlines()) == 1


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs Linux's /dev/full")
@pytest.mark.parametrize("command", ["fedrcl methods > /dev/full", "fedrcl --help > /dev/full",
                                     "fedrcl fit --help > /dev/full"])
def test_a_full_device_ends_in_one_line(command):
    done = shell(command)
    assert done.returncode == 1
    assert done.stderr == "fedrcl: error: standard output: No space left on device (what was written there is " \
                          "incomplete)\n", done.stderr


# -- bounded reads -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("source", ["/dev/zero", "/dev/urandom", "big"])
def test_a_split_file_is_read_up_to_a_bound(source, tmp_path):
    from fedrcl.data.split_file import read_split_file

    path = Path(source)
    if source == "big":
        path = tmp_path / "split.json"
        with open(path, "wb") as f:
            f.truncate(1500 << 20)  # 1.5 GB, sparse: nothing is written
    elif not path.exists():
        pytest.skip(f"needs {source}")
    with pytest.raises(ValueError, match=re.escape(f"data.partition_file: {path} is ")) as info:
        read_split_file(path)
    assert "more than a split file holds (at most 64 MiB" in str(info.value)


@pytest.mark.parametrize("key, config", [("model", "model: big.yaml\n"),
                                         ("trainer.callbacks", "trainer:\n  callbacks: big.yaml\n"),
                                         ("trainer.callbacks[0]", "trainer:\n  callbacks: [big.yaml]\n")])
def test_a_config_a_config_names_is_read_up_to_a_bound(key, config, data_root, tmp_path):
    (tmp_path / "big.yaml").write_text("class_path: fedrcl.algorithms.FedAvg\n#" + "x" * (3 << 20) + "\n")
    (tmp_path / "run.yaml").write_text(config)
    code, err = fedrcl_main("fit", *QUICK, "--config", str(tmp_path / "run.yaml"), "--data.root", str(data_root))
    assert code == 2
    assert f"fedrcl fit: error: {tmp_path / 'run.yaml'}: {key}: {tmp_path / 'big.yaml'}, 3145767 bytes, more " \
           "than a configuration file needs (1048576); not read" in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 2, err


def test_a_config_an_included_config_names_is_parsed_up_to_a_bound(data_root, tmp_path):
    """A file named inside an included file (``model: model.yaml``, which names ``backbone: big.yaml``):
    jsonargparse reads it whole, and its loader refuses it before PyYAML expands it."""
    (tmp_path / "big.yaml").write_text("class_path: fedrcl.models.SmallCNN\n#" + "x" * (3 << 20) + "\n")
    (tmp_path / "model.yaml").write_text("class_path: fedrcl.algorithms.FedAvg\ninit_args:\n  backbone: big.yaml\n")
    (tmp_path / "run.yaml").write_text("model: model.yaml\n")
    code, err = fedrcl_main("fit", *QUICK, "--config", str(tmp_path / "run.yaml"), "--data.root", str(data_root))
    assert code == 2
    assert "fedrcl fit: error: " in err and "big.yaml: 3145765 characters, more than a config needs (1048576)" \
        in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 2, err


# -- a split file edited by hand -----------------------------------------------------------------------------
def test_a_split_files_edited_client_is_named(data_root, tmp_path):
    import json

    from fedrcl.data.datamodule import FederatedDataModule

    written = FederatedDataModule(dataset="digits", root=str(data_root), num_clients=10, seed=0)
    written.setup("validate")
    labels = written.y_train.cpu().numpy()
    from fedrcl.data.split_file import label_fingerprint, write_split

    parts = [p.cpu().numpy() for p in written.client_indices]
    path = write_split(tmp_path / "split.json", parts, "digits", label_fingerprint(labels, parts, 10))
    doc = json.loads(path.read_text())
    # client 3 gives one sample to client 5 for one of client 5's of another label: every label still held once
    a = next(i for i in doc["clients"][3] if any(labels[j] != labels[i] for j in doc["clients"][5]))
    b = next(j for j in doc["clients"][5] if labels[j] != labels[a])
    doc["clients"][3] = [b if i == a else i for i in doc["clients"][3]]
    doc["clients"][5] = [a if j == b else j for j in doc["clients"][5]]
    path.write_text(json.dumps(doc))
    edited = FederatedDataModule(dataset="digits", root=str(data_root), num_clients=10, partition_file=str(path))
    with pytest.raises(ValueError) as info:
        edited.setup("validate")
    assert str(info.value) == (
        f"data.partition_file {path}: client 3's indices were edited after the file was written (and 1 more: 5): "
        "its labels no longer match the per-client hashes the file records; use the file as fedrcl wrote it "
        "(split.json beside the run's config.yaml), or leave out data.partition_file to compute the partition")


# -- one writer per run folder -------------------------------------------------------------------------------
HOLD = ("import sys, time; from fedrcl.federated.run_folder import hold_run_folder; hold_run_folder(sys.argv[1]); "
        "print('held', flush=True); time.sleep(300)")


@contextlib.contextmanager
def held(folder: Path) -> Iterator[subprocess.Popen]:
    """Another process holding ``folder`` (as a run writing into it does) until the block ends."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(folder), "fedrcl-fit-elsewhere"], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=60)


def test_a_second_writer_into_a_run_folder_is_refused(data_root, tmp_path):
    folder = tmp_path / "quickstart" / "version_0"
    with held(folder) as other:
        code, err = fedrcl_main("fit", *QUICK, *FIT_QUICK, "--data.root", str(data_root),
                                "--trainer.logger.init_args.save_dir", str(tmp_path),
                                "--trainer.logger.init_args.version", "0")
        assert code == 1
        one_line(err, f"fedrcl: error: the run folder {folder} is being written by another run, PID {other.pid} (")
        assert sorted(p.name for p in folder.iterdir()) == ["fedrcl.lock"], "the other run's folder was touched"
    # killed (kill -9 leaves its lock): the lock is taken over, the run trains, and its lock is gone at its end
    assert (folder / "fedrcl.lock").is_file()
    run_cli(data_root, tmp_path, "--trainer.logger.init_args.version", "0", rounds=1)
    assert (folder / "checkpoints" / "last.ckpt").is_file() and not (folder / "fedrcl.lock").exists()


def test_seeds_together_refuse_a_folder_another_run_writes(data_root, tmp_path):
    from fedrcl import seeds

    folder = tmp_path / "quickstart" / "seed0" / "version_0"
    with held(folder) as other, pytest.raises(SystemExit) as info:
        with contextlib.redirect_stderr(io.StringIO()) as err:
            seeds.main(["--seeds", "0", "1", "--together", *together_args(data_root, tmp_path, 1),
                        "--trainer.logger.init_args.version", "0"])  # started at once: the same version
    assert info.value.code == 1
    assert f"fedrcl seeds --together: error: the run folder {folder} is being written by another run, PID " \
           f"{other.pid}" in err.getvalue(), err.getvalue()
    assert sorted(p.name for p in folder.iterdir()) == ["fedrcl.lock"]


def test_a_stale_lock_of_a_killed_run_is_taken_over(tmp_path):
    from fedrcl.federated.run_folder import RunFolderTaken, hold_run_folder, release_run_folders

    with held(tmp_path) as other:
        with pytest.raises(RunFolderTaken, match=f"PID {other.pid} "):
            hold_run_folder(tmp_path)
        other.kill()  # kill -9
        other.wait()
        hold_run_folder(tmp_path)
    assert f'"pid": {os.getpid()}' in (tmp_path / "fedrcl.lock").read_text()
    release_run_folders()
    assert not (tmp_path / "fedrcl.lock").exists()


# -- Flower's process-starting fixtures under load -------------------------------------------------------------
def test_a_lost_start_is_tried_again_and_a_second_loss_fails_each_test_with_its_reason():
    from flower_fixtures import NotStarted, started

    tries = []

    def lost_once(attempt: int) -> dict:
        tries.append(attempt)
        if attempt == 0:
            pytest.fail("the simulation did not start in 240 s with every core busy")
        return {"fedavg": "run"}

    assert started("the simulation", lost_once) == {"fedavg": "run"} and tries == [0, 1]

    def never(attempt: int) -> dict:
        raise TimeoutError(f"the SuperLink did not start (try {attempt})")

    runs = started("the module's SuperLink", never)
    assert isinstance(runs, NotStarted)
    with pytest.raises(pytest.fail.Exception, match=re.escape(
            "the module's SuperLink did not run (twice): TimeoutError: the SuperLink did not start (try 0) | then: "
            "TimeoutError: the SuperLink did not start (try 1)")):
        runs["fedavg"]
    with pytest.raises(pytest.fail.Exception, match="did not run"):
        runs.workdir


# -- a logger fedrcl does not read ---------------------------------------------------------------------------
def test_a_wandb_runs_closing_line_names_the_folder_of_its_checkpoints(tmp_path, monkeypatch):
    """W&B offline: the closing line names ``<save_dir>/<project>/<run id>``, where Lightning puts its
    checkpoints (it named the working folder)."""
    pytest.importorskip("wandb")
    from lightning.pytorch.loggers import WandbLogger

    from fedrcl.federated.progress import RunClock, run_summary
    from fedrcl.federated.trainer import FederatedTrainer

    monkeypatch.setenv("WANDB_MODE", "offline")
    logger = WandbLogger(offline=True, save_dir=str(tmp_path / "runs"), project="quick", id="run0")
    trainer = FederatedTrainer(rounds=1, logger=logger, accelerator="cpu", enable_progress_bar=False,
                               default_root_dir=str(tmp_path / "root"))
    lines = run_summary(trainer, RunClock()).splitlines()
    assert f"  run folder: {tmp_path / 'runs' / 'quick' / 'run0'}" in lines, lines
    checkpoints = trainer.checkpoint_callback._ModelCheckpoint__resolve_ckpt_dir(trainer)  # Lightning's own rule
    assert Path(checkpoints) == tmp_path / "runs" / "quick" / "run0" / "checkpoints"


def test_report_and_plot_say_which_loggers_they_read(tmp_path, capsys):
    from fedrcl import plot, report

    (tmp_path / "wandb" / "offline-run-1-run0" / "files").mkdir(parents=True)
    for main in (report.main, plot.main):
        with pytest.raises(SystemExit):
            main([str(tmp_path)])
        err = capsys.readouterr().err
        assert "TensorBoard" in err and "CSVLogger" in err and "W&B's and MLflow's runs are read in their own " \
               "tools" in err, err


def test_report_reads_an_event_file_up_to_a_bound(tmp_path):
    from fedrcl.analysis.runs import read_scalars

    version = tmp_path / "version_0"
    version.mkdir()
    with open(version / "events.out.tfevents.1.host.1.0", "wb") as f:
        f.truncate(1500 << 20)  # 1.5 GB, sparse
    curves, problems = read_scalars(tmp_path)
    assert curves == {}
    assert problems == [(version / "events.out.tfevents.1.host.1.0",
                         "1572864000 bytes, more than fedrcl reads of an event file (1 GiB); not read")]
