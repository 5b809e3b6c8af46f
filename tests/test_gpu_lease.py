"""The GPU lease (``bench/gpu_lease.sh``) rehearsed on the CPU, and the round-boundary deadline it relies on.

The rehearsal runs the lease script as the device would, twice (two "machines", each with its own work folder),
at toy scale: prepare -> lease (probe with both batched modes broken on purpose, training stopped by the
deadline after round 1) -> collect in several calls under small limits -> prepare the continuation from the
returned files (spilling into a second carried folder) -> stash -> lease (the decision reused, training to
round 3) -> collect; the continued FedRCL run must equal, bitwise, one that never stopped.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import REPO, assert_same_state, run_cli
from fedrcl.analysis.runs import load_scalars
from fedrcl.federated.deadline import training_seconds

FEDAVG = "fedrcl.algorithms.FedAvg"
CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
# Small limits scaled like the real ones: a checkpoint (width 4: 210 kB) in three parts, four parts a call.
LIMITS = {"LEASE_PART_BYTES": 75000, "LEASE_OUT_FILES": 4, "LEASE_OUT_BYTES": 310000}
RETURNABLE = re.compile(r"[A-Za-z0-9._-]+")


def test_max_time_stops_on_a_whole_round_that_resumes_exactly(data_root, tmp_path):
    """``--trainer.max_time`` is checked after each round: a budget of 1 microsecond stops after round 1, with a
    checkpoint of that round (not only every ``checkpoint_every``) that resumes to a run that never stopped."""
    stopped = run_cli(data_root, tmp_path / "a", "--trainer.max_time", '{"microseconds": 1}', rounds=3,
                      model=FEDAVG)
    assert stopped.trainer.current_epoch == 1  # one round run, then stopped
    folder = tmp_path / "a" / "quickstart" / "version_0" / "checkpoints"
    assert sorted(p.name for p in folder.glob("*.ckpt")) == ["last.ckpt", "round0000.ckpt"]
    checkpoint = torch.load(folder / "last.ckpt", weights_only=True)
    assert checkpoint["epoch"] == 0 and training_seconds(checkpoint) > 0
    with warnings.catch_warnings(record=True) as caught:  # resumed without a time limit: no Timer needed
        warnings.simplefilter("always")
        resumed = run_cli(data_root, tmp_path / "a", "--ckpt_path", str(folder / "last.ckpt"), rounds=3,
                          model=FEDAVG)
    assert not [w for w in caught if "Timer" in str(w.message)]
    full = run_cli(data_root, tmp_path / "full", rounds=3, model=FEDAVG)
    assert resumed.trainer.current_epoch == full.trainer.current_epoch == 3
    assert_same_state(full.model.state_dict(), resumed.model.state_dict())


def make_mosaics(folder: Path) -> dict[str, np.ndarray]:
    """CIFAR-10-format JPEG mosaics (250 tiles of 32 px per row) of random textured images (flat ones would make
    GroupNorm divide by a zero variance); returns each image's mean colour, to check the decoding's order."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    means = {}
    for split, n in (("train", 300), ("test", 60)):
        base = rng.integers(40, 216, (n, 1, 1, 3))
        images = np.clip(base + rng.integers(-40, 41, (n, 32, 32, 3)), 0, 255).astype(np.uint8)
        means[split] = images.mean(axis=(1, 2))
        mosaic = np.zeros((-(-n // 250) * 32, 250 * 32, 3), np.uint8)
        for i, image in enumerate(images):
            row, col = divmod(i, 250)
            mosaic[row * 32:(row + 1) * 32, col * 32:(col + 1) * 32] = image
        Image.fromarray(mosaic).save(folder / f"{split}.jpg", quality=95, subsampling=0)
    np.savez(folder / "labels.npz", y_train=rng.integers(0, 10, 300).astype(np.uint8),
             y_test=rng.integers(0, 10, 60).astype(np.uint8), classes=np.array(CLASSES))
    return means


def lease_sh(*flags: str, **env: object) -> subprocess.CompletedProcess:
    full = {**os.environ, "GPU_LEASE_REHEARSAL": "1", "OMP_NUM_THREADS": "1",
            **{k: str(v) for k, v in {**LIMITS, **env}.items()}}
    done = subprocess.run(["bash", str(REPO / "bench" / "gpu_lease.sh"), *flags], env=full, capture_output=True,
                          text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def collect_all(work: Path, first: Path, into: Path) -> Path:
    """Every file a lease returns: its own $OUT, then ``--collect`` calls until nothing waits; each $OUT within
    the (rehearsal's) limits: file count, total and file size, flat, plain names."""
    into.mkdir()
    outs, calls = [first], 0
    while True:
        out = outs[-1]
        files = list(out.iterdir())
        assert all(f.is_file() and RETURNABLE.fullmatch(f.name) for f in files), files
        assert len(files) <= LIMITS["LEASE_OUT_FILES"]
        assert sum(f.stat().st_size for f in files) <= LIMITS["LEASE_OUT_BYTES"]
        for f in files:
            (into / f.name).write_bytes(f.read_bytes())
        if calls and not files:
            return into
        calls += 1
        assert calls < 10, "collect never ends"
        outs.append(work.parent / f"{work.name}_collect{calls}")
        lease_sh("--collect", LEASE_WORK=work, OUT=outs[-1])


def first_lease(folder: Path, checkpoint: Path, name: str) -> Path:
    """What the first lease (format 1: one seed per method, ``<name>/version_0``) returned for one run: its
    summary and the checkpoint in parts."""
    folder.mkdir()
    data = checkpoint.read_bytes()
    parts = []
    for i in range(0, len(data), LIMITS["LEASE_PART_BYTES"]):
        parts.append(f"{name}.ckpt.part{len(parts):02d}")
        (folder / parts[-1]).write_bytes(data[i:i + LIMITS["LEASE_PART_BYTES"]])
    saved = {"file": f"{name}.ckpt", "parts": parts, "sha256": hashlib.sha256(data).hexdigest(),
             "bytes": len(data), "rounds": 1}
    summary = {"format": "fedrcl-gpu-lease/1", "lease_index": 0, "gpu": "cpu (rehearsal)", "mode": "sequential",
               "torch": torch.__version__, "runs": {name: {"method": "FedRCL", "checkpoint": saved}}}
    (folder / "summary.json").write_text(json.dumps(summary))
    return folder


def test_gpu_lease_rehearsal(tmp_path, monkeypatch):
    """Seeds 0, 1, 2 of FedAvg and FedRCL together, FedRCL's seed 0 continued from a first-lease checkpoint."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    from gpu_lease_run import Lease, decode_mosaics, fit_args

    jpeg, carry = tmp_path / "cifar10_jpeg", tmp_path / "carry" / ".lease"
    means = make_mosaics(jpeg)
    # The reference: FedRCL's three seeds together, never stopped; its seed 0 after round 1 stands for the
    # first lease's FedRCL run (one seed, in toy_fedrcl/version_0).
    reference = Lease(rehearsal=True, work=tmp_path / "reference")
    decode_mosaics(jpeg, reference.work / "data" / "cifar10.npz")
    never_stopped = subprocess.Popen(
        [sys.executable, "-m", "fedrcl.cli", "seeds", "--seeds", "0", "1", "2", "--together",
         *fit_args("FedRCL", "batched", reference), "--trainer.checkpoint_every", "1"],
        cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True)
    ref_runs = reference.work / "runs" / "toy_fedrcl"
    round1 = ref_runs / "seed0" / "version_0" / "checkpoints" / "round0000.ckpt"  # written atomically
    deadline = time.time() + 300
    while not round1.exists():
        assert never_stopped.poll() is None and time.time() < deadline, never_stopped.stderr.read()[-3000:]
        time.sleep(0.2)
    lease0 = first_lease(tmp_path / "lease0", round1, "toy_fedrcl")

    # Lease 1 on machine A: the checkpoint spills into a second carried folder (stashed first); the compiled
    # mode fails (forced), the batched one trains the seeds together; stopped on a whole round (SIGTERM once
    # training: no time left after the margin).
    size = sum(p.stat().st_size for p in jpeg.iterdir())
    (tmp_path / "scratch").mkdir()
    prepared = lease_sh("--prepare", "--from", str(lease0), "--limit-mib", str((size + 1_060_000) / 2**20),
                        "--check", str(tmp_path / "scratch"), LEASE_DATA=jpeg, LEASE_CARRY=carry, LEASE_TREE_BYTES=0)
    assert "call payload with .lease2" in prepared.stdout and (carry / "cifar10_jpeg" / "train.jpg").exists()
    assert "check: toy_fedrcl/seed0 resumes after round 1 (carried: 1)" in prepared.stdout  # here, before a lease
    assert "check: toy_fedrcl/seed1 resumes after round 0 (carried: 0)" in prepared.stdout
    work_a, out_a = tmp_path / "machine_a", tmp_path / "out_a"
    lease_sh("--stash", LEASE_WORK=work_a, OUT=tmp_path / "out_stash", LEASE_CARRY=carry.with_name(".lease2"))
    carry.with_name(".lease2").rename(tmp_path / "carried_before")  # the main call carries .lease only
    first = lease_sh(LEASE_WORK=work_a, OUT=out_a, LEASE_CARRY=carry, LEASE_ROUND_MARGIN_S=100000,
                     GPU_LEASE_BREAK="batched+compiled=error")
    summary = json.loads((out_a / "summary.json").read_text())
    modes = summary["probe"]["modes"]
    assert summary["mode"] == "batched" and "dropped" not in modes["batched"], first.stdout
    assert modes["batched+compiled"]["dropped"].startswith("error: RuntimeError: forced")
    assert max(modes["batched"]["relative_difference"].values()) <= summary["probe"]["tolerance"]
    table = summary["probe"]["seeds_together"]  # the probe's one seed against three together
    for method in ("FedRCL", "FedAvg"):
        assert table[method]["1"]["seconds_per_round"] > 0 and table[method]["3"]["seconds_per_round"] > 0
        assert table[method]["ratio"] == pytest.approx(
            table[method]["3"]["seconds_per_round"] / table[method]["1"]["seconds_per_round"], rel=0.01)
    assert (out_a / "probe_profile.txt").read_text().startswith("== FedRCL, 3 seed(s) together, batched")
    runs = summary["runs"]
    assert runs["toy_fedrcl/seed0"]["rounds_at_start"] == 1 and runs["toy_fedrcl/seed0"]["rounds_reached"] >= 2
    for name in ("toy_fedrcl/seed1", "toy_fedrcl/seed2", "toy_fedavg/seed0", "toy_fedavg/seed1", "toy_fedavg/seed2"):
        assert runs[name]["rounds_at_start"] == 0 and 1 <= runs[name]["rounds_reached"] < 3, (name, first.stdout)
    assert {p["exit"] for p in summary["processes"].values()} == {143}, first.stdout  # SIGTERM, checkpointed
    with np.load(work_a / "data" / "cifar10.npz") as data:  # the mosaics decoded tile by tile, in order
        for split in ("train", "test"):
            x = data[f"x_{split}"]
            assert x.shape == (len(means[split]), 32, 32, 3) and data[f"y_{split}"].dtype == np.int64
            assert np.abs(x.mean(axis=(1, 2)) - means[split]).max() < 2
    back_a = collect_all(work_a, out_a, tmp_path / "back_a")
    assert set(summary["files"]) | {"summary.json"} == {p.name for p in back_a.iterdir()}

    # Lease 2 on machine B continues the six runs to round 3, reusing the decision.
    lease_sh("--prepare", "--from", str(back_a), LEASE_DATA=jpeg, LEASE_CARRY=carry, LEASE_TREE_BYTES=0)
    work_b, out_b = tmp_path / "machine_b", tmp_path / "out_b"
    again = lease_sh(LEASE_WORK=work_b, OUT=out_b, LEASE_CARRY=carry)
    assert "reusing the last lease's decision on this GPU: batched" in again.stdout
    summary_b = json.loads((out_b / "summary.json").read_text())
    assert summary_b["rounds_reached"] == {m: {"0": 3, "1": 3, "2": 3} for m in ("FedAvg", "FedRCL")}
    assert {p["exit"] for p in summary_b["processes"].values()} == {0}
    back_b = collect_all(work_b, out_b, tmp_path / "back_b")

    # Continued over two leases, FedRCL's seeds equal the run that never stopped: the same weights bitwise,
    # the same accuracy at every round.
    assert never_stopped.wait(timeout=400) == 0, never_stopped.stderr.read()[-3000:]
    logs = tmp_path / "logs"  # both leases' logs in one folder: each seed's version_1 and version_2, one curve
    for back in (back_a, back_b):
        with tarfile.open(back / "logs.tar.gz") as tar:
            tar.extractall(logs, filter="data")
    for seed in (0, 1, 2):
        saved = summary_b["runs"][f"toy_fedrcl/seed{seed}"]["checkpoint"]
        continued = torch.load(io.BytesIO(b"".join((back_b / p).read_bytes() for p in saved["parts"])),
                               weights_only=True)["state_dict"]
        full = torch.load(ref_runs / f"seed{seed}" / "version_0" / "checkpoints" / "last.ckpt", weights_only=True)
        assert_same_state(full["state_dict"], continued)
        assert sorted(p.name for p in (logs / "runs" / "toy_fedavg" / f"seed{seed}").iterdir()) == \
            ["version_1", "version_2"]
        curve = load_scalars(logs / "runs" / "toy_fedrcl" / f"seed{seed}")["val/acc"]
        reference_curve = load_scalars(ref_runs / f"seed{seed}")["val/acc"]
        assert curve[0].tolist() == ([2, 3] if seed == 0 else [1, 2, 3])
        assert curve[1].tolist() == reference_curve[1][-len(curve[1]):].tolist()


def test_a_lease_that_breaks_still_returns_its_logs(tmp_path):
    """No data carried: the lease stops before training, exit 1, and its summary names the error."""
    full = {**os.environ, "GPU_LEASE_REHEARSAL": "1", "OMP_NUM_THREADS": "1", "LEASE_WORK": str(tmp_path / "w"),
            "OUT": str(tmp_path / "out"), "LEASE_CARRY": str(tmp_path / "nothing" / ".lease")}
    done = subprocess.run(["bash", str(REPO / "bench" / "gpu_lease.sh")], env=full, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["error"].startswith("FileNotFoundError: no cifar10_jpeg/")
    with tarfile.open(tmp_path / "out" / "logs.tar.gz") as tar:
        assert "logs/lease.log" in tar.getnames()


def test_runs_past_the_deadline_get_sigterm_then_sigkill(tmp_path, monkeypatch):
    """The backstop: a run still going at the deadline gets SIGTERM; one that ignores it, SIGKILL."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    from gpu_lease_run import Lease, wait_runs

    # The deadline (start + limit - collection time) passed a second ago; SIGKILL comes half the collection
    # time after it, a second from now.
    lease = Lease(work=tmp_path, started=time.time() - 1.0, limit_s=4.0, collect_s=4.0)
    ready = tmp_path / "ready"
    commands = {"polite": f"touch {ready}.polite; sleep 30",
                "stubborn": f"trap '' TERM; touch {ready}.stubborn; while :; do sleep 0.1; done"}
    runs = {name: {"process": subprocess.Popen(["bash", "-c", command]), "log": open(tmp_path / name, "w")}
            for name, command in commands.items()}
    while not all(Path(f"{ready}.{name}").exists() for name in commands):  # the trap is set
        time.sleep(0.05)
    lease.started = time.time() - 1.0
    wait_runs(runs, lease)
    assert runs["polite"]["process"].returncode == -15
    assert runs["stubborn"]["process"].returncode == -9


def test_a_training_run_gets_sigterm_at_the_stop_time_a_starting_one_at_the_deadline(tmp_path, monkeypatch):
    """From ``deadline - margin_s`` a run that has printed a round line gets SIGTERM (it finishes its round); one
    that has not (its handler may not be installed yet: SIGTERM would kill it without a checkpoint) only at
    the deadline."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    from gpu_lease_run import Lease, wait_runs

    lease = Lease(work=tmp_path, started=time.time(), limit_s=3.0, collect_s=1.0, margin_s=100.0)
    runs = {}
    for name, line in (("training", "echo 'seed 0: Round 1/3  val/acc 0.1000'"), ("starting", "true")):
        log = open(tmp_path / f"{name}.log", "w")
        command = f"trap 'date +%s.%N > {tmp_path / name}.termed; exit 143' TERM; {line}; while :; do sleep 0.05; done"
        runs[name] = {"process": subprocess.Popen(["bash", "-c", command], stdout=log), "log": log}
    wait_runs(runs, lease)
    termed = {name: float((tmp_path / f"{name}.termed").read_text()) for name in runs}
    assert termed["training"] < lease.deadline - 1 and lease.deadline <= termed["starting"] < lease.deadline + 0.5
    assert {r["process"].returncode for r in runs.values()} == {143}


def test_a_run_that_fails_goes_on_in_another_mode(tmp_path, monkeypatch):
    """A run that fails before the deadline is handed to the restart (the lease restarts it sequentially), once;
    a run that ends well is not."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    from gpu_lease_run import Lease, wait_runs

    lease = Lease(work=tmp_path, started=time.time(), limit_s=60.0, collect_s=10.0)
    runs = {name: {"process": subprocess.Popen(["bash", "-c", command]), "log": open(tmp_path / name, "w"),
                   "mode": "batched+compiled"} for name, command in (("fails", "exit 3"), ("fine", "exit 0"))}
    asked = []

    def restart(name, run):
        asked.append((name, run["process"].returncode))
        return {"process": subprocess.Popen(["bash", "-c", "sleep 0.3"]), "log": open(tmp_path / "again", "w"),
                "mode": "sequential"}

    wait_runs(runs, lease, restart)
    assert asked == [("fails", 3)]
    assert runs["fails"]["mode"] == "sequential" and runs["fails"]["process"].returncode == 0
    assert runs["fails"]["failed"] == [{"mode": "batched+compiled", "exit": 3}]


def test_prepare_carries_the_checkpoints_first_and_the_compile_cache_only_into_room_left(tmp_path):
    """A continuation's checkpoints always travel (spilling into stash folders); the compile cache travels only
    where it fits into the last folder's room, never in a stash call of its own (the first H200 lease's cache was
    90 MB, against 13-16 s of compiling it saves each run)."""
    jpeg = tmp_path / "cifar10_jpeg"
    make_mosaics(jpeg)
    room = sum(p.stat().st_size for p in jpeg.iterdir()) + 2**20 + 100_000  # 100 kB beside the mosaics
    rng = np.random.default_rng(0)

    def returned(name: str, cache_bytes: int) -> Path:
        folder = tmp_path / name
        folder.mkdir()
        entries = {}
        for file, size in (("toy_fedrcl.ckpt", 300_000), ("compile_cache.tar", cache_bytes)):
            data = rng.bytes(size)
            (folder / f"{file}.part00").write_bytes(data)
            entries[file] = {"file": file, "parts": [f"{file}.part00"], "sha256": hashlib.sha256(data).hexdigest()}
        summary = {"format": "fedrcl-gpu-lease/1", "compile_cache": entries["compile_cache.tar"],
                   "runs": {"toy_fedrcl": {"checkpoint": entries["toy_fedrcl.ckpt"]}}}
        (folder / "summary.json").write_text(json.dumps(summary))
        return folder

    for cache_bytes, travels in ((100_000, True), (room, False)):
        carry = tmp_path / f"carry_{travels}" / ".lease"
        done = lease_sh("--prepare", "--from", str(returned(f"back_{travels}", cache_bytes)), "--limit-mib",
                        str(room / 2**20), LEASE_DATA=jpeg, LEASE_CARRY=carry, LEASE_TREE_BYTES=0)
        folders = sorted(carry.parent.iterdir())
        assert [f.name for f in folders] == [".lease", ".lease2"], done.stdout  # the checkpoint spilled once
        carried = {p.name: p.stat().st_size for f in folders for p in (f / "resume").iterdir()}
        summary = json.loads((carry / "resume" / "summary.json").read_text())
        saved = summary["runs"]["toy_fedrcl/seed0"]["checkpoint"]["parts"]  # a first lease's run: seed 0
        assert sum(carried[p] for p in saved) == 300_000
        assert ("compile_cache" in summary) is travels
        assert any(name.startswith("compile_cache.tar") for name in carried) is travels
        assert ("compile cache left behind" in done.stdout) is not travels


def test_collect_returns_the_checkpoints_before_the_compile_cache_and_says_when_only_it_waits(tmp_path, capsys,
                                                                                            monkeypatch):
    """The outbox's order (summary, logs, checkpoint parts, compile cache) is kept within each call's limits;
    once only compile-cache parts wait, the log says they are optional, so a session can give the machine back."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    from gpu_lease_run import Lease, collect, outbox

    lease = Lease(work=tmp_path / "work", out=tmp_path / "out", out_files=4, out_bytes=10_000)
    box = outbox(lease)
    box.mkdir(parents=True)
    order = ["summary.json", "logs.tar.gz", "r64_fedrcl.ckpt.part00", "r64_fedrcl.ckpt.part01",
             "compile_cache.tar.part00", "compile_cache.tar.part01"]
    for name in order:
        (box / name).write_bytes(b"x" * 2000)
    (box / "order.txt").write_text("\n".join(order) + "\n")
    (box / "returned.txt").write_text("")
    assert collect(lease) == order[4:]
    assert sorted(p.name for p in lease.out.iterdir()) == sorted(order[:4])
    assert "only the compile cache waits" in capsys.readouterr().out
    assert collect(lease) == []
    assert "everything is back" in capsys.readouterr().out


def test_the_paper_scale_checkpoints_named_in_gpu_md_are_in_the_history():
    """docs/gpu.md restores the last lease's checkpoints with ``git archive REV FOLDER``: that commit's parts of
    every run join to the sha256 of the summary committed in that folder (the parts are in no tree since)."""
    shallow = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=REPO, capture_output=True,
                             text=True, timeout=60)
    if shallow.returncode != 0 or shallow.stdout.strip() != "false":
        pytest.skip("not a full git checkout: the checkpoints live in the history")
    text = (REPO / "docs" / "gpu.md").read_text(encoding="utf-8")
    rev, folder = re.search(r"^git archive (\w+) (\S+) \|", text, re.MULTILINE).groups()
    summary = json.loads((REPO / folder / "summary.json").read_text())
    checkpoints = [run["checkpoint"] for run in summary["runs"].values()]
    assert len(checkpoints) == 2

    def blob(path: str) -> bytes:
        return subprocess.run(["git", "cat-file", "blob", f"{rev}:{folder}/{path}"], cwd=REPO, check=True,
                              capture_output=True, timeout=120).stdout

    for checkpoint in checkpoints:
        data = b"".join(blob(part) for part in checkpoint["parts"])
        assert len(data) == checkpoint["bytes"] and hashlib.sha256(data).hexdigest() == checkpoint["sha256"]
        assert not any((REPO / folder / part).exists() for part in checkpoint["parts"])


def test_mosaics_that_do_not_fit_beside_the_tree_travel_in_parts_and_join_on_the_device(tmp_path, monkeypatch):
    """A tree too large for the mosaics beside it (docs/gpu.md's warning): ``--prepare`` cuts them into parts over
    ``.lease`` and a stash folder, each call under the limit; the stash call and the lease's own stash put the
    parts in the work folder, where they join to the carried files (sha256) and decode as the files would."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    from gpu_lease_run import Lease, decode_mosaics, join_mosaics, stash

    jpeg, carry, work = tmp_path / "cifar10_jpeg", tmp_path / "carry" / ".lease", tmp_path / "work"
    make_mosaics(jpeg)
    size = sum(p.stat().st_size for p in jpeg.iterdir())
    tree = size // 2  # the travelling tree's stand-in: the mosaics fit in no call beside it whole
    prepared = lease_sh("--prepare", "--limit-mib", str((tree + size // 2 + 2**20 + 4096) / 2**20), LEASE_DATA=jpeg,
                        LEASE_CARRY=carry, LEASE_TREE_BYTES=tree)
    assert "mosaics in" in prepared.stdout and not (carry / "cifar10_jpeg").exists(), prepared.stdout
    stashed = sorted(p.name for p in carry.parent.glob(".lease?*"))
    assert stashed and all(f"carry=[\"{name}\"]" in prepared.stdout for name in stashed)
    for name in stashed:  # the stash calls, each with its folder only
        lease_sh("--stash", LEASE_WORK=work, LEASE_CARRY=carry.with_name(name))
        shutil.rmtree(carry.with_name(name))
    lease = Lease(work=work, carry=str(carry))  # the lease's call: .lease alone
    stash(lease)
    joined = join_mosaics(lease)
    assert joined is not None
    for original in jpeg.iterdir():
        assert (joined / original.name).read_bytes() == original.read_bytes()
    decode_mosaics(joined, tmp_path / "joined.npz")
    decode_mosaics(jpeg, tmp_path / "direct.npz")
    with np.load(tmp_path / "joined.npz") as a, np.load(tmp_path / "direct.npz") as b:
        assert all(np.array_equal(a[k], b[k]) for k in b.files)
    next((work / "resume").glob("cifar10_jpeg.train.jpg.part*")).unlink()
    with pytest.raises(FileNotFoundError, match="were not stashed"):
        join_mosaics(lease)
