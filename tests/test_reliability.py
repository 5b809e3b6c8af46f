"""Nothing lost, nothing silent: kills, a full disk, divergence and configuration changes around checkpoints.

The kill tests run ``fedrcl fit`` as a separate process that SIGKILLs itself half-way through writing a
chosen checkpoint file (``tests/faults.py``); the resumed run must then equal a run that never stopped: its
weights bitwise, and every scalar of every round (``all_curves``) once, with the same value. The preemption
tests send SIGTERM (and Ctrl-C's SIGINT) in the middle of a round (``faults.SignalAt``), with one process and
with two.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from conftest import REPO, assert_same_state, run_cli
from fedrcl.algorithms.client_state import ClientStateStore
from test_cli import load_ckpt as read_checkpoint

FEDAVG = "fedrcl.algorithms.FedAvg"
BOOT = "import sys, faults; faults.install_from_env(); from fedrcl.cli import main; main(sys.argv[1:])"
EVERY_ROUND = ("--trainer.checkpoint_every", "1")


def fit_process(data_root: Path, save_dir: Path, *extra: str, rounds: int = 3, model: str = FEDAVG,
                fault: str = "") -> subprocess.CompletedProcess:
    """``fedrcl fit`` on the shrunk quickstart (as ``run_cli``) in a child process, with an armed fault."""
    args = ["fit", "--config", str(REPO / "configs" / "quickstart.yaml"), "--model", model,
            "--data.root", str(data_root), "--data.num_clients", "10", "--trainer.accelerator", "cpu",
            "--trainer.logger.init_args.save_dir", str(save_dir), "--trainer.enable_progress_bar", "false",
            "--trainer.enable_model_summary", "false", "--trainer.rounds", str(rounds),
            "--trainer.local_epochs", "1", "--trainer.clients_per_round", "3", *extra]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")]),
           "OMP_NUM_THREADS": "1", "FEDRCL_FAULT": fault}
    return subprocess.run([sys.executable, "-c", BOOT, *args], env=env, capture_output=True, text=True,
                          timeout=300)


def all_curves(save_dir: Path) -> dict:
    """Every scalar tag of the run under ``save_dir`` as ``fedrcl.analysis`` reads it (all versions merged),
    ``time/*`` aside (wall-clock seconds differ between runs): ``{tag: [(round, value), ...]}``."""
    from fedrcl.analysis import load_scalars

    curves = load_scalars(save_dir / "quickstart")
    return {tag: list(zip(rounds.tolist(), values.tolist())) for tag, (rounds, values) in curves.items()
            if not tag.startswith("time/")}


def assert_same_curves(resumed: dict, full: dict, rounds: int) -> None:
    assert resumed.keys() == full.keys()
    assert {"val/acc", "val/acc_ema", "train/loss", "train/lr", "comm/cumulative_bytes"} <= set(full), sorted(full)
    for tag, points in full.items():
        assert [r for r, _ in points] == list(range(1, rounds + 1)), tag  # every round, once
        assert resumed[tag] == points, tag


def checkpoints(run_dir: Path, version: int = 0) -> Path:
    return run_dir / "quickstart" / f"version_{version}" / "checkpoints"


@pytest.fixture
def run_dir(tmp_path):
    """The run folder, on another filesystem than the temp folder where there is one (/dev/shm): the case
    where Lightning's writer, staging in /tmp, copies into place instead of renaming."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or os.stat(shm).st_dev == os.stat(tempfile.gettempdir()).st_dev:
        yield tmp_path / "runs"
        return
    folder = Path(tempfile.mkdtemp(dir=shm, prefix="fedrcl-test-"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_kill_while_last_ckpt_is_written_leaves_a_resumable_run(data_root, tmp_path, run_dir):
    """SIGKILL half-way through round 2's ``last.ckpt``: round 1's is intact, and the resume is exact."""
    killed = fit_process(data_root, run_dir, *EVERY_ROUND, fault="kill:last.ckpt:2")
    assert killed.returncode == -9, killed.stderr[-2000:]
    folder = checkpoints(run_dir)
    assert read_checkpoint(folder / "last.ckpt")["epoch"] == 0  # the previous, complete last.ckpt
    resumed = run_cli(data_root, run_dir, *EVERY_ROUND, "--ckpt_path", "last", rounds=3, model=FEDAVG)
    assert Path(resumed.trainer.ckpt_path) == folder / "round0001.ckpt"  # round 2, the newest complete one
    full = run_cli(data_root, tmp_path / "full", rounds=3, model=FEDAVG)
    assert_same_state(full.model.state_dict(), resumed.model.state_dict())
    # Round 2's training scalars were logged before its checkpoint: no hole where the kill fell.
    assert_same_curves(all_curves(run_dir), all_curves(tmp_path / "full"), rounds=3)


def test_moon_killed_while_checkpointing_resumes_exactly(data_root, tmp_path, run_dir):
    """SIGKILL while round 2's first checkpoint is written: round 1's ``last.ckpt`` and every client-state
    file it refers to survive (client 9 trained in rounds 1 and 2, so its round-1 file is superseded)."""
    extra = ("--config", str(REPO / "configs" / "methods" / "moon.yaml"), *EVERY_ROUND)
    moon = "fedrcl.algorithms.MOON"
    killed = fit_process(data_root, run_dir, *extra, model=moon, fault="kill:round0001.ckpt:1")
    assert killed.returncode == -9, killed.stderr[-2000:]
    resumed = run_cli(data_root, run_dir, *extra, "--ckpt_path", "last", rounds=3, model=moon)
    assert Path(resumed.trainer.ckpt_path).name in ("last.ckpt", "round0000.ckpt")  # round 1
    full = run_cli(data_root, tmp_path / "full", *extra, rounds=3, model=moon)
    assert_same_state(full.model.state_dict(), resumed.model.state_dict())
    assert_same_curves(all_curves(run_dir), all_curves(tmp_path / "full"), rounds=3)


def test_disk_full_while_checkpointing_keeps_the_last_complete_checkpoint(data_root, tmp_path, run_dir,
                                                                          monkeypatch):
    import faults

    with monkeypatch.context() as patch:
        faults.install("enospc:last.ckpt:2", patch)
        with pytest.raises(OSError, match="No space left"):
            run_cli(data_root, run_dir, *EVERY_ROUND, rounds=3, model=FEDAVG)
    folder = checkpoints(run_dir)
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt", "round0000.ckpt", "round0001.ckpt"]
    assert read_checkpoint(folder / "last.ckpt")["epoch"] == 0  # not truncated: the previous one
    resumed = run_cli(data_root, run_dir, *EVERY_ROUND, "--ckpt_path", "last", rounds=3, model=FEDAVG)
    assert Path(resumed.trainer.ckpt_path).name == "round0001.ckpt"
    run_cli(data_root, tmp_path / "full", rounds=3, model=FEDAVG)
    assert_same_curves(all_curves(run_dir), all_curves(tmp_path / "full"), rounds=3)


def test_divergence_stops_the_run_and_last_finds_the_good_checkpoint(data_root, tmp_path):
    """Two good rounds, then a deliberate change to lr 1e8 without clipping: round 3 diverges."""
    run_cli(data_root, tmp_path, rounds=2, model=FEDAVG)
    diverged = fit_process(data_root, tmp_path, "--ckpt_path", "last", "--model.init_args.lr", "1e8",
                           "--model.init_args.grad_clip_norm", "null", *EVERY_ROUND,
                           "--trainer.resume_allow_changes",
                           "[model.init_args.lr, model.init_args.grad_clip_norm]", rounds=4)
    assert diverged.returncode == 1
    message = diverged.stderr.strip().splitlines()
    assert "fedrcl: error: training diverged in round 3: client " in message[-2], diverged.stderr[-2000:]
    assert "Traceback" not in diverged.stderr
    assert not list(checkpoints(tmp_path, 1).glob("*.ckpt"))  # nothing of the diverged run was written
    resumed = run_cli(data_root, tmp_path, "--ckpt_path", "last", rounds=3, model=FEDAVG)
    assert Path(resumed.trainer.ckpt_path) == checkpoints(tmp_path) / "last.ckpt"


def test_divergence_guard_names_round_and_client(data_root, tmp_path):
    with pytest.raises(RuntimeError, match=r"round 1: client \d+ \(non-finite loss\)"):
        run_cli(data_root, tmp_path, "--model.init_args.lr", "1e8", "--model.init_args.grad_clip_norm",
                "null", rounds=2, model=FEDAVG)
    assert not list(tmp_path.rglob("*.ckpt"))


def test_last_skips_damaged_and_non_finite_checkpoints_and_names_them(data_root, tmp_path):
    run_cli(data_root, tmp_path, *EVERY_ROUND, rounds=3, model=FEDAVG)
    folder = checkpoints(tmp_path)
    newest = read_checkpoint(folder / "last.ckpt")
    newest["global_step"] += 100
    newest["state_dict"]["backbone.fc1.weight"][0, 0] = float("nan")
    torch.save(newest, folder / "nan.ckpt")  # as main's code wrote after a divergence
    (folder / "last.ckpt").write_bytes((folder / "last.ckpt").read_bytes()[:5000])
    (folder / "round0002.ckpt").write_bytes(b"")
    with pytest.warns(UserWarning) as warned:
        resumed = run_cli(data_root, tmp_path, *EVERY_ROUND, "--ckpt_path", "last", rounds=3, model=FEDAVG)
    assert Path(resumed.trainer.ckpt_path).name == "round0001.ckpt"
    shown = "\n".join(str(w.message) for w in warned)
    assert "nan.ckpt: non-finite weights" in shown
    assert "last.ckpt: truncated or not a checkpoint" in shown
    assert "round0002.ckpt: empty (0 bytes)" in shown


@pytest.mark.parametrize("damage, named", [(b"", "is empty (0 bytes)"), (None, "is truncated")])
def test_an_explicit_damaged_checkpoint_is_named(data_root, tmp_path, damage, named):
    cli = run_cli(data_root, tmp_path, rounds=1, model=FEDAVG)
    ckpt = Path(cli.trainer.logger.log_dir) / "checkpoints" / "last.ckpt"
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(damage if damage is not None else ckpt.read_bytes()[:3000])
    with pytest.raises(ValueError, match=re.escape(f"checkpoint {bad} {named}")):
        run_cli(data_root, tmp_path, "--ckpt_path", str(bad), rounds=2, model=FEDAVG)


@pytest.mark.parametrize("subcommand", ["fit", "validate"])
def test_an_explicit_checkpoint_with_non_finite_weights_is_refused(data_root, tmp_path, subcommand):
    """``--ckpt_path last`` passes such a file over; named explicitly it was loaded, and the run diverged."""
    cli = run_cli(data_root, tmp_path, rounds=1, model=FEDAVG)
    checkpoint = read_checkpoint(Path(cli.trainer.logger.log_dir) / "checkpoints" / "last.ckpt")
    checkpoint["state_dict"]["backbone.fc1.weight"][0, 0] = float("inf")
    bad = tmp_path / "inf.ckpt"
    torch.save(checkpoint, bad)
    with pytest.raises(ValueError, match=re.escape(f"--ckpt_path {bad}: its weights are not finite (NaN or inf)")):
        run_cli(data_root, tmp_path / "again", "--ckpt_path", str(bad), subcommand=subcommand, rounds=2,
                model=FEDAVG)
    assert not list((tmp_path / "again").rglob("*.ckpt")) and not list((tmp_path / "again").rglob("events.*"))


def test_last_with_nothing_to_resume_says_so(data_root, tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing to resume .* leave out --ckpt_path"):
        run_cli(data_root, tmp_path, "--ckpt_path", "last", rounds=1, model=FEDAVG)


# -- strict resume -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_rounds(data_root, tmp_path_factory) -> Path:
    """A finished 2-round FedAvgM run (module-wide, read-only): its ``last.ckpt``."""
    save_dir = tmp_path_factory.mktemp("two_rounds")
    cli = run_cli(data_root, save_dir, "--config", str(REPO / "configs/server/fedavgm.yaml"), model=FEDAVG)
    return Path(cli.trainer.logger.log_dir) / "checkpoints" / "last.ckpt"


FEDAVGM = ("--config", str(REPO / "configs/server/fedavgm.yaml"))


@pytest.mark.parametrize("change, key", [
    (("--model.init_args.lr", "0.05"), "model.init_args.lr was 0.1 there and is 0.05 here"),
    (("--model.init_args.lr_decay", "0.99"), "model.init_args.lr_decay"),
    (("--trainer.local_epochs", "2"), "trainer.local_epochs was 1 there and is 2 here"),
    (("--trainer.clients_per_round", "4"), "trainer.clients_per_round was 3 there and is 4 here"),
    (("--trainer.server.init_args.beta", "0.5"), "trainer.server.init_args.beta was 0.4 there and is 0.5"),
    (("--model.init_args.backbone.init_args.conv_padding", "3"), "backbone.init_args.conv_padding was 2"),
    (("--data.batch_size", "12"), "data.batch_size was 24 there and is 12 here"),
    (("--model", "fedrcl.algorithms.FedProx"), "model was 'FedAvg' there and is 'FedProx' here"),
])
def test_resume_with_another_setting_is_refused(data_root, tmp_path, two_rounds, change, key):
    model = change[1] if change[0] == "--model" else FEDAVG
    change = () if change[0] == "--model" else change
    with pytest.raises(ValueError, match=f"another configuration: .*{key}"):
        run_cli(data_root, tmp_path, *FEDAVGM, *change, "--ckpt_path", str(two_rounds), rounds=3, model=model)


def test_fedavgm_checkpoint_into_fedavg_is_refused(data_root, tmp_path, two_rounds):
    with pytest.raises(ValueError, match="trainer.server was 'FedAvgM' there and is 'FedAvg' here"):
        run_cli(data_root, tmp_path, "--ckpt_path", str(two_rounds), rounds=3, model=FEDAVG)


def test_last_passes_over_checkpoints_of_another_configuration(data_root, tmp_path, two_rounds):
    shutil.copytree(two_rounds.parents[2], tmp_path / "quickstart")
    with pytest.warns(UserWarning, match="other configuration: model.init_args.lr 0.1 there, 0.05 here"):
        with pytest.raises(FileNotFoundError, match="nothing to resume"):
            run_cli(data_root, tmp_path, *FEDAVGM, "--model.init_args.lr", "0.05", "--ckpt_path", "last",
                    rounds=3, model=FEDAVG)


OLD_KEYS = ("data.dataset", "data.num_clients", "data.partition", "data.alpha", "data.seed",
            "data.partition_file", "model", "model.backbone", "trainer.seed")


def old_checkpoint(two_rounds: Path, tmp_path: Path) -> Path:
    """``two_rounds`` as main's code wrote it: the first fingerprint's nine keys, no segments."""
    ckpt = read_checkpoint(two_rounds)
    federation = ckpt["callbacks"]["Federation"]
    federation["fingerprint"] = {k: federation["fingerprint"][k] for k in OLD_KEYS}
    federation.pop("segments", None)
    path = tmp_path / "old.ckpt"
    torch.save(ckpt, path)
    return path


def test_a_checkpoint_with_the_older_fingerprint_resumes_with_a_notice(data_root, tmp_path, two_rounds,
                                                                        caplog):
    old = old_checkpoint(two_rounds, tmp_path)
    cli = run_cli(data_root, tmp_path, *FEDAVGM, "--ckpt_path", str(old), rounds=3, model=FEDAVG)
    assert cli.trainer.current_epoch == 3
    notice = [r.getMessage() for r in caplog.records if "not checked" in r.getMessage()]
    assert len(notice) == 1 and "model.init_args.lr" in notice[0] and "trainer.server" in notice[0]


def test_an_older_fedavgm_checkpoint_into_fedavg_is_refused(data_root, tmp_path, two_rounds):
    """The older fingerprint has no server key: the server memory in the checkpoint gives it away."""
    old = old_checkpoint(two_rounds, tmp_path)
    with pytest.raises(ValueError, match=r"server memory \(momentum\) that trainer.server FedAvg does not"):
        run_cli(data_root, tmp_path, "--ckpt_path", str(old), rounds=3, model=FEDAVG)


def test_a_deliberate_change_is_allowed_recorded_and_logged(data_root, tmp_path, two_rounds):
    shutil.copytree(two_rounds.parents[2], tmp_path / "quickstart")
    cli = run_cli(data_root, tmp_path, *FEDAVGM, "--model.init_args.lr", "0.05", "--ckpt_path", "last",
                  "--trainer.resume_allow_changes", "[model.init_args.lr]", rounds=3, model=FEDAVG)
    log_dir = Path(cli.trainer.logger.log_dir)
    saved = read_checkpoint(log_dir / "checkpoints" / "last.ckpt")["callbacks"]["Federation"]
    assert saved["segments"] == [{"round": 2, "changed": {"model.init_args.lr": [0.1, 0.05]}}]
    assert saved["fingerprint"]["model.init_args.lr"] == 0.05
    assert "resume_allow_changes:\n  - model.init_args.lr" in (log_dir / "config.yaml").read_text()
    assert "model.init_args.lr" in cli.trainer.logger.hparams["resume_segments"]


def test_an_unknown_allowed_key_is_an_error(data_root, tmp_path):
    with pytest.raises(ValueError, match="resume_allow_changes: model.init_args.learning_rate is not"):
        run_cli(data_root, tmp_path, "--trainer.resume_allow_changes", "[model.init_args.learning_rate]",
                rounds=1, model=FEDAVG)


# -- Lightning's ModelCheckpoint ---------------------------------------------------------------------------
def test_a_users_model_checkpoint_adds_files_and_resume_still_works(data_root, tmp_path):
    mine = ("--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
            "--trainer.callbacks.monitor=val/acc", "--trainer.callbacks.mode=max")
    cli = run_cli(data_root, tmp_path, *mine, rounds=2, model=FEDAVG)
    folder = Path(cli.trainer.logger.log_dir) / "checkpoints"
    names = sorted(p.name for p in folder.iterdir())
    assert "last.ckpt" in names and "round0001.ckpt" in names
    theirs = [n for n in names if n.startswith("epoch=")]
    assert len(theirs) == 1  # named by Lightning's real optimizer step, not by the round
    step = read_checkpoint(folder / theirs[0])["global_step"]
    assert theirs[0] == f"epoch=0-step={step}.ckpt" != "epoch=0-step=1.ckpt"
    assert "step" not in cli.trainer.callback_metrics
    resumed = run_cli(data_root, tmp_path, *mine, "--ckpt_path", "last", rounds=3, model=FEDAVG)
    assert Path(resumed.trainer.ckpt_path).parent == folder and resumed.trainer.current_epoch == 3


# -- client-state store ------------------------------------------------------------------------------------
def test_store_deletes_a_file_only_when_no_checkpoint_refers_to_it(tmp_path):
    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()
    store = ClientStateStore(tmp_path / "state", checkpoint_dirs=[ckpts])
    store.put(0, {"w": torch.zeros(2)}, round_idx=0)
    torch.save({"client_state": store.state_dict()}, ckpts / "round0000.ckpt")
    first = tmp_path / "state" / "client00000_round00000.safetensors"
    store.put(0, {"w": torch.ones(2)}, round_idx=1)
    manifest = store.state_dict()  # the next checkpoint: while it is written, round0000.ckpt needs round 0
    assert first.exists()
    torch.save({"client_state": manifest}, ckpts / "round0001.ckpt")
    store.put(0, {"w": torch.full((2,), 2.0)}, round_idx=2)
    store.state_dict()
    assert first.exists()  # round0000.ckpt still refers to it
    (ckpts / "round0000.ckpt").unlink()
    store.put(0, {"w": torch.full((2,), 3.0)}, round_idx=3)  # supersedes round 2's file: it was taken
    store.state_dict()
    assert not first.exists()  # no checkpoint refers to it any more
    assert (tmp_path / "state" / "client00000_round00001.safetensors").exists()  # round0001.ckpt's


def test_store_reads_each_checkpoint_once_per_version(tmp_path, monkeypatch):
    """Each manifest taken reads only the checkpoints written since the last one, not every one of the run."""
    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()
    store = ClientStateStore(tmp_path / "state", checkpoint_dirs=[ckpts])
    reads = []
    load = torch.load
    monkeypatch.setattr(torch, "load", lambda f, *a, **kw: reads.append(Path(f).name) or load(f, *a, **kw))
    for round_idx in range(4):
        store.put(0, {"w": torch.full((2,), float(round_idx))}, round_idx=round_idx)
        torch.save({"client_state": store.state_dict()}, ckpts / f"round{round_idx:04d}.ckpt")
    assert reads == ["round0000.ckpt", "round0001.ckpt", "round0002.ckpt"]   # each read once, when new
    torch.save({"client_state": {"files": {}}}, ckpts / "round0000.ckpt")    # rewritten: read again
    store.put(0, {"w": torch.zeros(2)}, round_idx=4)
    store.state_dict()
    assert sorted(reads[3:]) == ["round0000.ckpt", "round0003.ckpt"]
    assert not (tmp_path / "state" / "client00000_round00000.safetensors").exists()  # no longer referenced


# -- preemption --------------------------------------------------------------------------------------------
SIGTERM_IN_ROUND_2 = ("--trainer.callbacks+=faults.SignalAt", "--trainer.callbacks.init_args.round=2",
                      "--trainer.callbacks.init_args.step=1")


def test_sigterm_mid_round_stops_after_the_round_checkpointed_and_resumes_exactly(data_root, tmp_path, run_dir):
    """SIGTERM during round 2 (checkpoints every 20 rounds): round 2 finishes and is checkpointed, the exit
    status is 143 (128 + SIGTERM), one line says how to resume; the resume equals a run that never stopped."""
    stopped = fit_process(data_root, run_dir, *SIGTERM_IN_ROUND_2, rounds=3)
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    line = stopped.stderr.strip().splitlines()[-1]
    last = checkpoints(run_dir) / "last.ckpt"
    assert line.startswith(f"fedrcl: stopped by SIGTERM after round 2/3, checkpoint {last}; resume: fedrcl fit ")
    assert line.endswith(" --ckpt_path last") and "Traceback" not in stopped.stderr
    assert read_checkpoint(last)["epoch"] == 1  # round 2, whole
    assert sorted(p.name for p in checkpoints(run_dir).iterdir()) == ["last.ckpt", "round0001.ckpt"]
    resumed = run_cli(data_root, run_dir, "--ckpt_path", "last", rounds=3, model=FEDAVG)
    assert resumed.trainer.current_epoch == 3
    full = run_cli(data_root, tmp_path / "full", rounds=3, model=FEDAVG)
    assert_same_state(full.model.state_dict(), resumed.model.state_dict())
    assert_same_curves(all_curves(run_dir), all_curves(tmp_path / "full"), rounds=3)


def test_sigterm_in_the_last_round_finishes_the_run(data_root, tmp_path):
    """Nothing is left to resume: the run ends as usual (in this process: no ``Preempted``)."""
    cli = run_cli(data_root, tmp_path, *SIGTERM_IN_ROUND_2, rounds=2, model=FEDAVG)
    assert cli.trainer.current_epoch == 2 and cli.trainer._signal_connector.signum == signal.SIGTERM
    assert read_checkpoint(checkpoints(tmp_path) / "last.ckpt")["epoch"] == 1


def test_output_to_a_closed_pipe_never_stops_the_run(data_root, tmp_path, run_dir):
    """``fedrcl fit ... 2>&1 | head -1``: the reader goes away after the first line; the run goes on quietly to
    its end (it died at its next write, exit status 1, no checkpoint) and equals a run whose output was read."""
    args = ["fit", "--config", str(REPO / "configs" / "quickstart.yaml"), "--model", FEDAVG,
            "--data.root", str(data_root), "--data.num_clients", "10", "--trainer.accelerator", "cpu",
            "--trainer.logger.init_args.save_dir", str(run_dir), "--trainer.enable_model_summary", "false",
            "--trainer.rounds", "3", "--trainer.local_epochs", "1", "--trainer.clients_per_round", "3",
            *EVERY_ROUND]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")]), "OMP_NUM_THREADS": "1"}
    child = subprocess.Popen([sys.executable, "-c", BOOT, *args], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT)
    try:
        assert child.stdout is not None
        first = child.stdout.readline()  # as head -1: one line read, then the pipe closed
        child.stdout.close()
        code = child.wait(timeout=300)
    finally:
        child.kill()
    assert first and code == 0
    folder = checkpoints(run_dir)
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt", "round0000.ckpt", "round0001.ckpt",
                                                        "round0002.ckpt"]
    full = run_cli(data_root, tmp_path / "full", rounds=3, model=FEDAVG)
    assert_same_state(full.model.state_dict(), read_checkpoint(folder / "last.ckpt")["state_dict"])
    assert_same_curves(all_curves(run_dir), all_curves(tmp_path / "full"), rounds=3)


SIGINT_IN_ROUND_2 = (*SIGTERM_IN_ROUND_2, "--trainer.callbacks.init_args.signal=SIGINT")


@pytest.fixture(scope="module")
def uninterrupted(data_root, tmp_path_factory) -> tuple[dict, dict]:
    """The weights and curves of the 3-round run the interrupted ones are resumed into."""
    save_dir = tmp_path_factory.mktemp("uninterrupted")
    full = run_cli(data_root, save_dir, rounds=3, model=FEDAVG)
    return full.model.state_dict(), all_curves(save_dir)


def test_ctrl_c_stops_after_the_round_checkpointed_and_resumes_exactly(data_root, run_dir, uninterrupted):
    """Ctrl-C (SIGINT) as SIGTERM: one line at once says the run stops after the round; round 2 finishes and
    is checkpointed; exit status 130, one line with the resume command (no Lightning "graceful shutdown", no
    traceback); the resume equals a run that never stopped, bitwise."""
    stopped = fit_process(data_root, run_dir, *SIGINT_IN_ROUND_2, rounds=3)
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    assert "fedrcl: Ctrl-C: stopping after round 2/3, checkpointed; Ctrl-C again stops now" in stopped.stderr
    last = checkpoints(run_dir) / "last.ckpt"
    line = stopped.stderr.strip().splitlines()[-1]
    assert line.startswith(f"fedrcl: stopped by SIGINT after round 2/3, checkpoint {last}; resume: fedrcl fit ")
    assert line.endswith(" --ckpt_path last"), line
    assert "Traceback" not in stopped.stderr and "KeyboardInterrupt" not in stopped.stderr, stopped.stderr[-3000:]
    assert read_checkpoint(last)["epoch"] == 1  # round 2, whole
    resumed = run_cli(data_root, run_dir, "--ckpt_path", "last", rounds=3, model=FEDAVG)
    assert resumed.trainer.current_epoch == 3
    assert_same_state(uninterrupted[0], resumed.model.state_dict())
    assert_same_curves(all_curves(run_dir), uninterrupted[1], rounds=3)


def test_a_second_ctrl_c_stops_at_once_in_one_line_and_the_run_resumes_exactly(data_root, run_dir, uninterrupted):
    """Two Ctrl-C in round 2: the run stops before round 2 ends, in one line naming the last checkpoint
    (round 1) and the resume command, exit status 130, no traceback; resumed, it equals a run that never
    stopped, bitwise."""
    second = ("--trainer.callbacks+=faults.SignalAt", "--trainer.callbacks.init_args.round=2",
              "--trainer.callbacks.init_args.step=2", "--trainer.callbacks.init_args.signal=SIGINT")
    stopped = fit_process(data_root, run_dir, *SIGINT_IN_ROUND_2, *second, *EVERY_ROUND, rounds=3)
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    last = checkpoints(run_dir) / "last.ckpt"
    lines = stopped.stderr.strip().splitlines()
    assert lines[-1] == f"fedrcl: stopped by a second SIGINT in round 2/3, the rounds after checkpoint {last} " \
                        f"lost; resume: {lines[-1].split('resume: ', 1)[1]}", lines[-1]
    assert lines[-1].endswith(" --ckpt_path last") and lines[-2].startswith("fedrcl: Ctrl-C: stopping after round 2/3")
    assert "Traceback" not in stopped.stderr and "Round 2/3" not in stopped.stderr, stopped.stderr[-3000:]
    assert read_checkpoint(last)["epoch"] == 0  # round 1
    resumed = run_cli(data_root, run_dir, *EVERY_ROUND, "--ckpt_path", "last", rounds=3, model=FEDAVG)
    assert resumed.trainer.current_epoch == 3
    assert_same_state(uninterrupted[0], resumed.model.state_dict())
    assert_same_curves(all_curves(run_dir), uninterrupted[1], rounds=3)


TWO_PROCESSES = ("--trainer.devices", "2", "--trainer.strategy", "ddp", "--trainer.clients_per_round", "5",
                 "--data.eval_batch_size", "100")


def fit_two_processes(data_root: Path, save_dir: Path, *extra: str) -> tuple[int, str]:
    """``fedrcl fit`` over 2 CPU processes (Lightning starts the second); exit status and output. A hang is
    killed after ``timeout`` seconds and fails the test."""
    args = [sys.executable, "-m", "fedrcl.cli", "fit", "--config", str(REPO / "configs" / "quickstart.yaml"),
            "--model", FEDAVG, "--data.root", str(data_root), "--data.num_clients", "10",
            "--trainer.accelerator", "cpu", "--trainer.logger.init_args.save_dir", str(save_dir),
            "--trainer.enable_model_summary", "false", "--trainer.rounds", "3", "--trainer.local_epochs", "1",
            *TWO_PROCESSES, *extra]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")]), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=420)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"two-process run did not finish in 420 s (hang?):\n{output[-3000:]}")
    return proc.returncode, output


@pytest.mark.slow
def test_sigterm_to_one_of_two_processes_stops_both_after_the_round(data_root, tmp_path):
    """SIGTERM reaches rank 0 only, in mid-round; rank 1 learns of it (Lightning's launcher passes it on, and
    the round-end decision is collective): both stop after round 2, no hang, status 143. The resume (here in
    one process: a 2-process run equals a 1-process one bitwise, ``tests/test_multiprocess.py``, which also
    resumes over 2 processes) equals a run that never stopped."""
    save_dir = tmp_path / "two"
    code, output = fit_two_processes(data_root, save_dir, *SIGTERM_IN_ROUND_2)
    assert code == 143, output[-3000:]
    assert "fedrcl: stopped by SIGTERM after round 2/3" in output and output.count("fedrcl: stopped by") == 1
    assert read_checkpoint(checkpoints(save_dir) / "last.ckpt")["epoch"] == 1
    five = ("--trainer.clients_per_round", "5", "--data.eval_batch_size", "100")
    resumed = run_cli(data_root, save_dir, *five, "--ckpt_path", "last", rounds=3, model=FEDAVG)
    one = run_cli(data_root, tmp_path / "one", *five, rounds=3, model=FEDAVG)
    assert_same_state(one.model.state_dict(), resumed.model.state_dict())
    curves, expected = all_curves(save_dir), all_curves(tmp_path / "one")
    for tag in ("val/acc", "val/acc_ema", "train/lr", "comm/cumulative_bytes"):
        assert curves[tag] == expected[tag], tag
    assert [r for r, _ in curves["train/loss"]] == [1, 2, 3]


def test_requeue_runs_scontrol_for_the_job(tmp_path, monkeypatch):
    """Under SLURM, after the requeue signal's checkpoint: ``scontrol requeue <job>`` (an array task as
    ``<array job>_<task>``), and what happened in words."""
    from fedrcl.federated.preemption import requeue_slurm_job

    calls = tmp_path / "calls"
    scontrol = tmp_path / "scontrol"
    scontrol.write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\n")
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    assert requeue_slurm_job() == "SLURM job 4242 requeued"
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "17")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    assert requeue_slurm_job() == "SLURM job 17_3 requeued"
    assert calls.read_text().splitlines() == ["requeue 4242", "requeue 17_3"]
    scontrol.write_text("#!/bin/sh\necho 'Invalid job id' >&2\nexit 1\n")
    assert requeue_slurm_job() == "scontrol requeue 17_3 failed (Invalid job id)"


def test_slurms_requeue_signal_stops_a_run_when_auto_requeue_is_on():
    """Lightning's ``SLURMEnvironment`` says which signal asks for a requeue (SIGUSR1 by default)."""
    from types import SimpleNamespace

    from lightning.fabric.plugins.environments import LightningEnvironment, SLURMEnvironment

    from fedrcl.federated.preemption import _stop_signals

    def signals(environment):
        connector = SimpleNamespace(cluster_environment=environment)
        return _stop_signals(SimpleNamespace(_accelerator_connector=connector))

    stops = {signal.SIGTERM: False, signal.SIGINT: False}  # Ctrl-C as SIGTERM
    assert signals(LightningEnvironment()) == stops
    assert signals(SLURMEnvironment()) == {**stops, signal.SIGUSR1: True}
    usr2 = SLURMEnvironment(requeue_signal=signal.SIGUSR2)
    assert signals(usr2) == {**stops, signal.SIGUSR2: True}
    assert signals(SLURMEnvironment(auto_requeue=False)) == stops


def test_a_resume_does_not_warn_that_its_checkpoint_folder_moved(data_root, tmp_path):
    """A resumed run writes a new version folder by design: Lightning's warning about it is not shown."""
    import warnings

    run_cli(data_root, tmp_path, rounds=1, model=FEDAVG)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_cli(data_root, tmp_path, "--ckpt_path", "last", rounds=2, model=FEDAVG)
    assert not [w for w in caught if "dirpath has changed" in str(w.message)]


def test_a_closed_pipe_never_stops_the_other_subcommands():
    """``fedrcl methods | true`` (as ``report``, ``plot``, ``seeds`` and ``check``, which share the path): the
    reader is gone before the first line; the listing goes nowhere, exit status 0, no ``BrokenPipeError``."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    child = subprocess.Popen([sys.executable, "-m", "fedrcl.cli", "methods"], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stderr is not None
        child.stdout.close()  # before the child's first write
        code = child.wait(timeout=120)
        errors = child.stderr.read().decode()
    finally:
        child.kill()
    assert code == 0 and "BrokenPipeError" not in errors, errors
