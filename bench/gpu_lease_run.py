"""One GPU lease in one command: set up, probe, train, collect. Run by ``bench/gpu_lease.sh`` (see docs/gpu.md).

Subcommands (``python3 bench/gpu_lease_run.py <name>``):

    prepare [--from DIR ...]  here, before the lease: the carried folders (.lease, .lease2, ...: wheels, the
      [--check SCRATCH]       CIFAR-10 JPEG mosaics, the last lease's checkpoint parts, its compile cache if
                              room is left), each call's payload measured against the carry limit; --check:
                              every carried checkpoint must resume its seed here (built on the CPU)
    stash                     on the device: copy the carried parts (checkpoints, mosaics) into the work folder
    lease                     on the device: stash, join (if in parts) and decode the mosaics, probe (or reuse
                              the last decision), train seeds 0, 1, 2 of FedAvg and of FedRCL (one
                              ``fedrcl seeds --together`` process per method, side by side) until the
                              deadline, then collect
    collect                   on the device: put the next files of the outbox into $OUT, within its limits

Settings come from the environment (``bench/gpu_lease.sh`` documents them); ``GPU_LEASE_REHEARSAL=1`` runs the
same steps at toy scale on the CPU (the test suite's ``tests/test_gpu_lease.py``).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
MiB = 1 << 20
TILE = 32
METHODS = ("FedAvg", "FedRCL")
SEEDS = (0, 1, 2)  # trained together in one process per method; seed 0 continues the first lease's runs
# Execution modes, fastest first when they work: (client_batching, compile_clients). The batched modes train
# the seeds together; sequential trains seed 0 alone.
MODES = {"batched+compiled": ("on", True), "batched": ("on", False), "sequential": ("off", False)}
FORMAT = "fedrcl-gpu-lease/2"  # /1: the first lease's, one seed per method in <name>/version_N
PROFILE = "probe_profile.txt"


def env_float(name: str, default: float) -> float:
    value = os.environ.get(name)
    return default if value in (None, "") else float(value)


@dataclass
class Lease:
    """This lease's settings, read from the environment (defaults: the real lease on one GPU)."""

    rehearsal: bool = field(default_factory=lambda: os.environ.get("GPU_LEASE_REHEARSAL") == "1")
    work: Path = field(default_factory=lambda: Path(os.environ.get("LEASE_WORK", "/tmp/lease")))
    out: Path = field(default_factory=lambda: Path(os.environ.get("OUT", "/tmp/lease/out")))
    carry: str = field(default_factory=lambda: os.environ.get("LEASE_CARRY", ".lease"))
    started: float = field(default_factory=lambda: env_float("LEASE_T0", time.time()))
    limit_s: float = field(default_factory=lambda: env_float("LEASE_LIMIT_S", 600))
    collect_s: float = field(default_factory=lambda: env_float("LEASE_COLLECT_S", 45))
    probe_s: float = field(default_factory=lambda: env_float("LEASE_PROBE_S", 150))
    startup_s: float = field(default_factory=lambda: env_float("LEASE_STARTUP_S", 30))
    part_bytes: int = field(default_factory=lambda: int(env_float("LEASE_PART_BYTES", 15 * MiB)))
    out_files: int = field(default_factory=lambda: int(env_float("LEASE_OUT_FILES", 8)))
    out_bytes: int = field(default_factory=lambda: int(env_float("LEASE_OUT_BYTES", 63 * MiB)))
    index: int = 0  # leases before this one in the runs' history: their logs are version_0 ... version_{index-1}
    margin_s: float = 0.0  # SIGTERM this long before the deadline: about one round of the runs side by side

    @property
    def deadline(self) -> float:
        """When training must have stopped: the command's limit less the time to collect."""
        return self.started + self.limit_s - self.collect_s

    def carried(self) -> list[Path]:
        """The carried folders present (``.lease``, ``.lease2``, ...)."""
        base = Path(self.carry) if Path(self.carry).is_absolute() else REPO / self.carry
        return sorted(p for p in base.parent.glob(base.name + "*") if p.is_dir())


def log(message: str) -> None:
    print(f"[lease {time.strftime('%H:%M:%S')}] {message}", flush=True)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(MiB), b""):
            digest.update(block)
    return digest.hexdigest()


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)


# -- data -------------------------------------------------------------------------------------------------------
def decode_mosaics(folder: Path, npz: Path) -> int:
    """The CIFAR-10 JPEG mosaics of ``folder`` (``train.jpg``, ``test.jpg``: 32-px tiles in rows; ``labels.npz``)
    as the project's prepared ``.npz``; returns the number of training images."""
    from PIL import Image

    labels = np.load(folder / "labels.npz", allow_pickle=False)
    arrays = {"classes": np.asarray(labels["classes"]).astype(str)}
    for split in ("train", "test"):
        y = np.asarray(labels[f"y_{split}"]).astype(np.int64)
        with Image.open(folder / f"{split}.jpg") as image:
            mosaic = np.asarray(image.convert("RGB"))
        rows, cols = mosaic.shape[0] // TILE, mosaic.shape[1] // TILE
        if rows * cols < len(y):
            raise ValueError(f"{folder / f'{split}.jpg'} holds {rows * cols} tiles, labels.npz {len(y)} labels")
        tiles = mosaic[:rows * TILE, :cols * TILE].reshape(rows, TILE, cols, TILE, 3).swapaxes(1, 2)
        arrays[f"x_{split}"] = np.ascontiguousarray(tiles.reshape(-1, TILE, TILE, 3)[:len(y)])
        arrays[f"y_{split}"] = y
    npz.parent.mkdir(parents=True, exist_ok=True)
    tmp = npz.with_name(".cifar10.npz.tmp")
    with open(tmp, "wb") as f:
        np.savez(f, **arrays)
    os.replace(tmp, npz)
    return len(arrays["y_train"])


def join_mosaics(lease: Lease) -> Path | None:
    """The mosaics a prepare cut into parts (its ``mosaics.json``, carried with ``.lease``), joined from the
    stashed parts into the work folder and checked against their sha256; ``None`` when none were cut."""
    manifest = next((p / "mosaics.json" for p in lease.carried() if (p / "mosaics.json").is_file()), None)
    if manifest is None:
        return None
    folder = lease.work / "cifar10_jpeg"
    folder.mkdir(parents=True, exist_ok=True)
    for name, entry in json.loads(manifest.read_text()).items():
        parts = [lease.work / "resume" / part for part in entry["parts"]]
        missing = [p.name for p in parts if not p.is_file()]
        if missing:
            raise FileNotFoundError(f"mosaic parts {', '.join(missing)} were not stashed: make the --stash calls "
                                    "that --prepare printed first")
        payload = b"".join(p.read_bytes() for p in parts)
        if hashlib.sha256(payload).hexdigest() != entry["sha256"]:
            raise ValueError(f"{name}: the stashed parts do not join to its sha256")
        (folder / name).write_bytes(payload)
    return folder


# -- the runs ---------------------------------------------------------------------------------------------------
def run_name(method: str, lease: Lease) -> str:
    """The experiment's name: each seed's run is ``<name>/seed<k>`` (``fedrcl seeds``)."""
    return f"{'toy' if lease.rehearsal else 'r64'}_{method.lower()}"


def seed_run(method: str, seed: int, lease: Lease) -> str:
    return f"{run_name(method, lease)}/seed{seed}"


def fit_args(method: str, mode: str, lease: Lease) -> list[str]:
    """The ``fedrcl fit`` arguments every seed of one method shares (``fedrcl seeds`` adds each seed's
    ``--seed_everything k --trainer.seed k`` and run name ``<name>/seed<k>``): configs/cifar10_a01.yaml (the
    paper's CIFAR-10, alpha 0.1) at width 64 with the authors' local lr decay, one client split for every seed
    (``data.seed 0``), evaluated every round; the rehearsal shrinks it to seconds."""
    batching, compiled = MODES[mode]
    args = ["--config", str(REPO / "configs" / "cifar10_a01.yaml"),
            "--model", f"fedrcl.algorithms.{method}", "--model.init_args.local_lr_decay", "0.998",
            "--data.seed", "0", "--trainer.eval_every", "1",
            "--data.root", str(lease.work / "data"), "--data.download", "false",
            "--trainer.client_batching", batching, "--trainer.compile_clients", str(compiled).lower(),
            "--trainer.precision", "bf16-mixed",
            "--trainer.logger.init_args.save_dir", str(lease.work / "runs"),
            "--trainer.logger.init_args.name", run_name(method, lease),
            "--trainer.logger.init_args.version", str(lease.index)]
    if lease.rehearsal:
        width = os.environ.get("LEASE_TOY_WIDTH", "4")
        return args + ["--model.init_args.backbone.init_args.width", width, "--trainer.accelerator", "cpu",
                       "--torch_threads", "1", "--trainer.rounds", "3", "--data.num_clients", "10",
                       "--trainer.clients_per_round", "2", "--trainer.local_epochs", "2",
                       "--data.batch_size", "4", "--data.local_iters_per_epoch", "2",
                       "--data.eval_batch_size", "50", "--data.channels_last", "off"]
    return args + ["--model.init_args.backbone.init_args.width", "64", "--trainer.accelerator", "gpu",
                   "--trainer.devices", "1", "--data.eval_batch_size", "5000"]


def split_file(path: Path, folder: Path, part_bytes: int) -> list[str]:
    """``path`` cut into ``<name>.partNN`` files of at most ``part_bytes`` in ``folder``; their names."""
    names = []
    with open(path, "rb") as f:
        for i, block in enumerate(iter(lambda: f.read(part_bytes), b"")):
            name = f"{path.name}.part{i:02d}"
            (folder / name).write_bytes(block)
            names.append(name)
    return names


def join_parts(folder: Path, name: str, expected_sha: str, dest: Path) -> Path:
    """Re-join ``name.partNN`` of ``folder`` into ``dest``, checked against the summary's sha256."""
    parts = sorted(folder.glob(f"{name}.part*"))
    if not parts:
        raise FileNotFoundError(f"no parts of {name} in {folder}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest, "wb") as f:
        for part in parts:
            f.write(part.read_bytes())
    if sha256(dest) != expected_sha:
        dest.unlink()
        raise ValueError(f"{name}: the {len(parts)} parts joined do not match the summary's sha256 "
                         "(a part is missing or damaged)")
    return dest


def previous_summary(lease: Lease) -> dict | None:
    path = lease.work / "resume" / "summary.json"
    return json.loads(path.read_text()) if path.exists() else None


def device_facts(lease: Lease) -> dict:
    import torch

    facts = {"torch": torch.__version__, "gpu": "cpu (rehearsal)" if lease.rehearsal else None}
    if not lease.rehearsal and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        facts.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1))
    return facts


def unpack_compile_cache(lease: Lease, before: dict | None) -> None:
    """The last lease's compile cache, re-joined and unpacked into ``resume/compile_cache`` (each run loads it
    there if it was made with this torch on this GPU: ``bench/gpu_lease_fit.py``)."""
    cache = (before or {}).get("compile_cache")
    folder = lease.work / "resume"
    if not cache or not all((folder / p).exists() for p in cache["parts"]):
        return
    tar = join_parts(folder, cache["file"], cache["sha256"], folder / cache["file"])
    with tarfile.open(tar) as archive:
        archive.extractall(folder / "compile_cache", filter="data")
    log(f"compile cache: {len(list((folder / 'compile_cache').glob('*.bin')))} file(s) carried from the last lease")


def stash(lease: Lease) -> int:
    """Copy the carried resume files (checkpoint parts, the last summary, the compile cache) into the work folder."""
    target = lease.work / "resume"
    target.mkdir(parents=True, exist_ok=True)
    copied = 0
    for folder in lease.carried():
        for path in sorted((folder / "resume").glob("*")):
            shutil.copy2(path, target / path.name)
            copied += 1
    log(f"stash: {copied} file(s) from {', '.join(p.name for p in lease.carried()) or 'no carried folder'}; "
        f"{len(list(target.iterdir()))} in {target}")
    return copied


def probe(lease: Lease, facts: dict, before: dict | None) -> dict:
    """The mode decision and the probe's table: the last lease's on the same GPU and torch, else
    ``bench/gpu_lease_probe.py`` (in a child process with a hard limit, so that a hang or a crash of the batched
    path costs at most the probe)."""
    if before and before.get("format") == FORMAT and before.get("mode") and before.get("gpu") == facts["gpu"] \
            and before.get("torch") == facts["torch"] and os.environ.get("LEASE_PROBE") != "always":
        log(f"probe: reusing the last lease's decision on this GPU: {before['mode']}")
        last = before.get("probe", {})
        return {"mode": before["mode"], "reused_from": before.get("lease_started"),
                "modes": last.get("modes", {}), "seeds_together": last.get("seeds_together", {})}
    result = lease.work / "probe.json"
    result.unlink(missing_ok=True)
    cmd = [sys.executable, str(REPO / "bench" / "gpu_lease_probe.py"), "--result", str(result),
           "--profile", str(lease.work / PROFILE)]
    limit = min(lease.probe_s, max(10.0, lease.deadline - time.time() - 60))
    log(f"probe: {' '.join(cmd[1:])} (at most {limit:.0f} s)")
    with open(lease.work / "logs" / "probe.log", "w") as out:
        try:
            done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=limit, cwd=REPO)
            status = f"exit {done.returncode}"
        except subprocess.TimeoutExpired:
            status = f"stopped at its limit of {limit:.0f} s"
    found = json.loads(result.read_text()) if result.exists() else {"modes": {}}
    found["status"] = status
    if found.get("mode") is None:  # the probe did not decide: no batched mode passed and ran a paper round
        found["mode"] = "sequential"
        for name in MODES:
            found["modes"].setdefault(name, {}).setdefault("dropped", f"not reached: probe {status}")
    log(f"probe: {status}; mode {found['mode']}; " + "; ".join(
        f"{m}: {r.get('dropped') or 'passed'}" for m, r in found["modes"].items()))
    for line in together_table(found.get("seeds_together", {})):
        log(f"probe: {line}")
    return found


def together_table(table: dict) -> list[str]:
    """The probe's one seed against three seeds together, one line per method."""
    lines = []
    for method, rows in table.items():
        cells = [f"{k} seed(s) {rows[k]['seconds_per_round']:.3f} s/round (GPU busy {rows[k].get('gpu_busy_nvml')})"
                 for k in sorted(rows) if k.isdigit() and "seconds_per_round" in rows[k]]
        ratio = f"; 3 together / 1 = {rows['ratio']:.2f}" if rows.get("ratio") is not None else ""
        lines.append(f"{method}: {', '.join(cells) or 'not measured'}{ratio}")
    return lines


def place_checkpoints(lease: Lease, before: dict | None) -> dict[str, dict]:
    """Each carried checkpoint re-joined into its seed's run folder (``<name>/seed<k>/version_<v>/checkpoints/
    last.ckpt``, the version it was written in), where ``--ckpt_path last`` finds it. Returns per seed run the
    rounds it starts from, or why it cannot be continued (its parts were not carried)."""
    import torch

    placed = {}
    for name, run in (before or {}).get("runs", {}).items():
        saved = run.get("checkpoint")
        if not saved:
            continue
        if not all((lease.work / "resume" / part).exists() for part in saved["parts"]):
            log(f"train: {name} NOT continued: parts of its checkpoint ({saved['file']}) were not carried; carry "
                "them (--prepare --from, then --stash)")
            placed[name] = {"missing": saved["file"], "entry": run}
            continue
        version = saved.get("version", (before or {}).get("lease_index", 0))
        folder = lease.work / "runs" / name / f"version_{version}" / "checkpoints"
        path = join_parts(lease.work / "resume", saved["file"], saved["sha256"], folder / "last.ckpt")
        rounds = torch.load(path, map_location="cpu", weights_only=True, mmap=True)["epoch"] + 1
        placed[name] = {"rounds": rounds, "path": str(path)}
        log(f"train: {name} continues from round {rounds} ({path})")
    return placed


def start_process(method: str, mode: str, lease: Lease, placed: dict[str, dict]) -> dict:
    """One process for ``method``: in a batched mode ``fedrcl seeds --seeds 0 1 2 --together ... --ckpt_path
    last`` (each seed from its own checkpoint, if any, the others from round 1), sequentially seed 0 alone (the
    long run; three seeds one after another would leave seeds 1 and 2 untrained at the deadline). Seeds whose
    checkpoint was not carried are left out. It stops by SIGTERM (``wait_runs``) after a whole round."""
    seeds = [k for k in (SEEDS if mode != "sequential" else SEEDS[:1])
             if "missing" not in placed.get(seed_run(method, k, lease), {})]
    if not seeds:
        return {}
    resumed = any("rounds" in placed.get(seed_run(method, k, lease), {}) for k in seeds)
    own = lease.work / "runs" / run_name(method, lease)
    resumed = resumed or any(own.glob(f"seed{k}/version_*/checkpoints/*.ckpt") for k in seeds)
    args = ["seeds", "--seeds", *map(str, seeds), *(["--together"] if mode != "sequential" else []),
            *fit_args(method, mode, lease), *(["--ckpt_path", "last"] if resumed else [])]
    name = run_name(method, lease)
    cache_in, cache_out = lease.work / "resume" / "compile_cache", lease.work / "compile_cache" / f"{name}.bin"
    cmd = [sys.executable, str(REPO / "bench" / "gpu_lease_fit.py"), "--cache-in", str(cache_in),
           "--cache-out", str(cache_out), *args]
    stop = max(0.0, lease.deadline - lease.margin_s - time.time())
    log(f"train: {name} seeds {seeds} ({mode}); SIGTERM in {stop:.0f} s (once training)")
    out = open(lease.work / "logs" / f"{name}.log", "a")
    process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
    return {"method": method, "mode": mode, "seeds": seeds, "process": process, "log": out,
            "command": ["fedrcl", *args], "started": time.time()}


ROUND_LINE = re.compile(rb"Round \d+/\d+")


def training(run: dict) -> bool:
    """Whether a run has printed a round line: its stop-signal handler is installed (a SIGTERM before it would
    kill the process without a checkpoint)."""
    if not run.get("training"):
        try:
            with open(run["log"].name, "rb") as f:
                f.seek(run.get("read", 0))
                text = f.read()
            run["read"] = run.get("read", 0) + max(0, len(text) - 64)
            run["training"] = bool(ROUND_LINE.search(text))
        except OSError:
            return False
    return bool(run.get("training"))


def wait_runs(runs: dict[str, dict], lease: Lease, restart=None) -> None:
    """Wait for the runs. From ``lease.deadline - lease.margin_s`` on, a run that is training gets SIGTERM (it
    finishes its round, checkpoints every seed and exits); at the deadline every run still going gets it, and
    SIGKILL halfway through the collection time. A run that fails before (an exit status not of these signals)
    is handed to ``restart(name, run)``, which may return its replacement (another mode)."""
    stop, hard = lease.deadline - lease.margin_s, lease.deadline + lease.collect_s / 2
    stopped = (None, 0, -signal.SIGTERM, -signal.SIGKILL, 128 + signal.SIGTERM, 128 + signal.SIGKILL)
    while True:
        now = time.time()
        for name, r in list(runs.items()):
            code = r["process"].poll()
            if code not in stopped and restart is not None and not r.get("termed") and not r.get("handled"):
                r["handled"] = True
                r["log"].close()
                again = restart(name, r)
                if again:
                    runs[name] = {**again, "failed": [*r.get("failed", []), {"mode": r["mode"], "exit": code}]}
        if all(r["process"].poll() is not None for r in runs.values()):
            break
        for name, r in runs.items():
            if r["process"].poll() is None and not r.get("termed") and \
                    (now >= lease.deadline or (now >= stop and training(r))):
                r["termed"] = True
                log(f"train: {name}: SIGTERM ({'deadline' if now >= lease.deadline else 'stop time'})")
                r["process"].send_signal(signal.SIGTERM)
            if now >= hard and r["process"].poll() is None:
                log(f"train: {name} still running: SIGKILL")
                r["process"].kill()
        time.sleep(0.05 if now >= stop else 0.2)
    for r in runs.values():
        r["log"].close()


def seed_result(method: str, seed: int, lease: Lease, process: dict, placed: dict[str, dict]) -> dict:
    """Rounds reached, seconds per round and the newest checkpoint of one seed's run (the carried one if it
    did not train in this lease, so that it travels on)."""
    import torch

    sys.path.insert(0, str(REPO))
    from fedrcl.analysis.runs import load_scalars

    name = seed_run(method, seed, lease)
    carried = placed.get(name, {})
    result = {"method": method, "seed": seed, "rounds_at_start": carried.get("rounds", 0),
              "trained": seed in process.get("seeds", [])}
    this = lease.work / "runs" / name / f"version_{lease.index}"
    if result["trained"] and any(this.glob("events.out.tfevents.*")):
        curves = load_scalars(this)
        seconds = curves.get("time/round_seconds", (None, np.array([])))[1]
        result["seconds_per_round_median"] = round(float(np.median(seconds)), 4) if len(seconds) else None
        rounds, acc = curves.get("val/acc", (np.array([]), None))
        if len(rounds):
            result["last_val_acc"] = float(acc[-1])
            result["last_val_acc_ema"] = float(curves.get("val/acc_ema", (None, [None]))[1][-1])
    newest = None
    for path in (lease.work / "runs" / name).glob("version_*/checkpoints/last.ckpt"):
        rounds = torch.load(path, map_location="cpu", weights_only=True, mmap=True)["epoch"] + 1
        if newest is None or rounds > newest[0]:
            newest = (rounds, path)
    if newest is not None:
        result["rounds_reached"], result["last_checkpoint"] = newest[0], str(newest[1])
        result["version"] = int(newest[1].parents[1].name.split("_")[1])
        run_here = newest[0] - result["rounds_at_start"]
        if run_here > 0 and "started" in process:  # start-up, compilation and evaluation included
            result["wall_seconds_per_round"] = round(process["wall_seconds"] / run_here, 3)
    return result


# -- collecting -------------------------------------------------------------------------------------------------
def outbox(lease: Lease) -> Path:
    return lease.work / "outbox"


def fill_outbox(lease: Lease, summary: dict, results: dict) -> None:
    """Everything to bring back, in order: the summary, logs and event files (one archive), the probe's profile
    (a small text file), each seed's checkpoint in parts (FedRCL's first, seed 0 first: the runs that matter
    most), then the compile cache (optional: the first lease's was 90 MB, against 13-16 s of compiling that it
    saves each run)."""
    box = outbox(lease)
    shutil.rmtree(box, ignore_errors=True)
    box.mkdir(parents=True)
    with tarfile.open(box / "logs.tar.gz", "w:gz") as tar:
        for path in sorted((lease.work / "logs").glob("*")):
            tar.add(path, arcname=f"logs/{path.name}")
        for path in sorted((lease.work / "runs").rglob("*")):
            if path.is_file() and path.suffix != ".ckpt":  # event files, config.yaml, split.json, hparams
                tar.add(path, arcname=f"runs/{path.relative_to(lease.work / 'runs')}")
    order = ["logs.tar.gz"]
    if (lease.work / PROFILE).exists():
        shutil.copyfile(lease.work / PROFILE, box / PROFILE)
        order.append(PROFILE)
    for name in sorted(results, key=lambda n: (results[n]["method"] != "FedRCL", n)):
        last = results[name].get("last_checkpoint")
        if not last:
            continue
        file = f"{name.replace('/', '_')}.ckpt"
        shutil.copyfile(last, box / file)
        results[name]["checkpoint"] = {"file": file, "sha256": sha256(box / file),
                                       "bytes": (box / file).stat().st_size,
                                       "rounds": results[name]["rounds_reached"],
                                       "version": results[name]["version"]}
        parts = split_file(box / file, box, lease.part_bytes)
        (box / file).unlink()
        results[name]["checkpoint"]["parts"] = parts
        order += parts
    cache, carried = lease.work / "compile_cache", lease.work / "resume" / "compile_cache"
    if (carried / "meta.json").exists():  # carry the last lease's cache on where this lease made none of its own
        own = (cache / "meta.json").read_text() if (cache / "meta.json").exists() else None
        for path in carried.glob("*"):
            if not (cache / path.name).exists() and own in (None, (carried / "meta.json").read_text()):
                shutil.copy2(path, cache / path.name)
    if any(cache.glob("*.bin")):
        with tarfile.open(box / "compile_cache.tar", "w") as tar:
            for path in sorted(cache.glob("*")):
                tar.add(path, arcname=path.name)
        summary["compile_cache"] = {"file": "compile_cache.tar", "sha256": sha256(box / "compile_cache.tar"),
                                    "parts": split_file(box / "compile_cache.tar", box, lease.part_bytes)}
        (box / "compile_cache.tar").unlink()
        order += summary["compile_cache"]["parts"]
    summary["files"] = {name: (box / name).stat().st_size for name in order}
    write_json(box / "summary.json", summary)
    (box / "order.txt").write_text("\n".join(["summary.json", *order]) + "\n")
    (box / "returned.txt").write_text("")


def collect(lease: Lease) -> list[str]:
    """Copy the next outbox files into $OUT: at most ``out_files`` files, ``out_bytes`` together, flat (no
    folder); the rest waits for the next ``collect`` call. Returns the names still pending."""
    box = outbox(lease)
    if not (box / "order.txt").exists():
        log("collect: nothing to collect (no lease ran on this machine)")
        return []
    returned = set((box / "returned.txt").read_text().split())
    pending = [n for n in (box / "order.txt").read_text().split() if n not in returned]
    lease.out.mkdir(parents=True, exist_ok=True)
    taken, total = [], 0
    for name in pending:
        size = (box / name).stat().st_size
        if size > 16 * MiB:
            raise ValueError(f"{name} is {size} bytes, over the 16 MiB a returned file may have")
        if len(taken) < lease.out_files and total + size <= lease.out_bytes:
            shutil.copyfile(box / name, lease.out / name)
            taken.append(name)
            total += size
    with open(box / "returned.txt", "a") as f:
        f.write("".join(f"{n}\n" for n in taken))
    left = [n for n in pending if n not in taken]
    log(f"collect: {len(taken)} file(s), {total / MiB:.1f} MiB into $OUT: {', '.join(taken) or '-'}")
    if left and all(name.startswith("compile_cache") for name in left):
        log(f"collect: only the compile cache waits ({', '.join(left)}): optional (the next lease carries it "
            "only into room left, and compiles anew without it); give the machine back, or --collect it")
    elif left:
        named = ", ".join(left[:4]) + (f", ... {left[-1]}" if len(left) > 4 else "")
        log(f"collect: {len(left)} file(s) still on this machine ({named}): next call, at once: "
            "bash bench/gpu_lease.sh --collect")
    else:
        log("collect: everything is back")
    return left


# -- the lease --------------------------------------------------------------------------------------------------
def run_lease(lease: Lease) -> int:
    """The lease; if a step raises, its logs still come back (``summary.json`` names the error)."""
    for sub in ("logs", "runs", "data", "compile_cache"):
        (lease.work / sub).mkdir(parents=True, exist_ok=True)
    try:
        return lease_steps(lease)
    except Exception as error:
        import traceback

        traceback.print_exc()
        summary = {"format": FORMAT, "rehearsal": lease.rehearsal, "error": f"{type(error).__name__}: {error}"}
        fill_outbox(lease, summary, {})
        collect(lease)
        return 1


def lease_steps(lease: Lease) -> int:
    stash(lease)
    facts = device_facts(lease)
    log(f"device: {facts}; deadline in {lease.deadline - time.time():.0f} s")
    npz = lease.work / "data" / "cifar10.npz"
    if not npz.exists():
        jpeg = next((p / "cifar10_jpeg" for p in lease.carried() if (p / "cifar10_jpeg").is_dir()), None)
        jpeg = jpeg or join_mosaics(lease)
        if jpeg is None:
            raise FileNotFoundError(f"no cifar10_jpeg/ in the carried folders {lease.carry}*: run "
                                    "bash bench/gpu_lease.sh --prepare here and name the folder in carry")
        start = time.time()
        count = decode_mosaics(jpeg, npz)
        log(f"data: {count} training images decoded from {jpeg} in {time.time() - start:.1f} s")
    before = previous_summary(lease)
    lease.index = (before or {}).get("lease_index", -1) + 1
    unpack_compile_cache(lease, before)
    placed = place_checkpoints(lease, before)
    probe_start = time.time()
    decision = probe(lease, facts, before)
    probe_seconds = time.time() - probe_start
    mode = decision["mode"]
    # SIGTERM ends a run after the round in progress: leave about one round of the runs side by side.
    probed = decision.get("seeds_together", {}).get("FedRCL", {}).get(str(len(SEEDS)), {}).get("seconds_per_round")
    lease.margin_s = env_float("LEASE_ROUND_MARGIN_S", 1.5 * len(METHODS) * probed if probed else 30.0)
    runs = {run_name(m, lease): start_process(m, mode, lease, placed) for m in METHODS}
    runs = {name: run for name, run in runs.items() if run}

    def fall_back(name: str, run: dict) -> dict | None:
        """A run that failed in a batched mode goes on sequentially (seed 0), from its newest checkpoint."""
        if run["mode"] == "sequential" or lease.deadline - time.time() < lease.startup_s + 60:
            return None
        log(f"train: {name} failed in {run['mode']} (exit {run['process'].returncode}; its log says why): "
            "going on sequentially with seed 0")
        return start_process(run["method"], "sequential", lease, placed)

    train_start = time.time()
    wait_runs(runs, lease, fall_back)
    for run in runs.values():
        run["wall_seconds"] = round(time.time() - run["started"], 1)
    results = {seed_run(m, k, lease): seed_result(m, k, lease, runs.get(run_name(m, lease), {}), placed)
               for m in METHODS for k in SEEDS}
    for name, carried in placed.items():  # not continued here: its last entry travels on (its parts: last lease)
        if "missing" in carried:
            results[name] = {**carried["entry"], "trained": False, "not_continued": "parts not carried"}
    processes = {name: {"method": r["method"], "mode": r["mode"], "seeds": r["seeds"], "command": r["command"],
                        "exit": r["process"].returncode, "failed": r.get("failed", []),
                        "wall_seconds": r["wall_seconds"]} for name, r in runs.items()}
    summary = {"format": FORMAT, "lease_started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(lease.started)),
               "lease_index": lease.index, "rehearsal": lease.rehearsal, **facts, "mode": mode,
               "seeds": list(SEEDS), "probe": decision,
               "seconds": {"setup_and_data": round(probe_start - lease.started, 1),
                           "probe": round(probe_seconds, 1), "train": round(time.time() - train_start, 1)},
               "processes": processes, "runs": results}
    for key in ("rounds_reached", "seconds_per_round_median"):
        summary[key.removesuffix("_median")] = {m: {str(k): results[seed_run(m, k, lease)].get(key) for k in SEEDS}
                                               for m in METHODS}
    fill_outbox(lease, summary, results)
    for name, r in results.items():
        log(f"result: {name}: rounds {r.get('rounds_at_start')} -> {r.get('rounds_reached')}, "
            f"{r.get('seconds_per_round_median')} s/round")
    collect(lease)
    return 0 if all(r.get("rounds_reached") for r in results.values()) else 1


# -- preparing the carried folders (here, not on the device) ------------------------------------------------------
def check_resume(lease: Lease, summary: dict, mosaics: Path, scratch: Path) -> list[str]:
    """Whether each carried checkpoint resumes its seed as the lease will resume it, before any device time is
    spent: with the checkpoints already in ``scratch/runs/<name>/seed<k>/version_<v>``, each method's seeds are
    built together (``Cohort``, ``--ckpt_path last``) on this CPU with this checkout's code and the lease's
    arguments, and not trained. Returns each seed that does not start at its checkpoint's round."""
    import warnings

    sys.path.insert(0, str(REPO))
    from fedrcl.federated.together import Cohort

    warnings.filterwarnings("ignore", message=".*LightningCLI's args parameter.*")  # args given on purpose

    class NoStop:
        signum = None

    here = Lease(rehearsal=lease.rehearsal, work=scratch, index=summary.get("lease_index", -1) + 1)
    decode_mosaics(mosaics, here.work / "data" / "cifar10.npz")
    problems = []
    for method in METHODS:
        args = fit_args(method, "batched", here)
        if "gpu" in args:
            args[args.index("gpu")] = "cpu"
        name = run_name(method, here)
        cohort = Cohort({k: [*args, "--seed_everything", str(k), "--trainer.seed", str(k),
                             "--trainer.logger.init_args.name", f"{name}/seed{k}", "--ckpt_path", "last"]
                         for k in SEEDS}, NoStop())
        for run in cohort.seeds:
            saved = summary["runs"].get(f"{name}/seed{run.seed}", {}).get("checkpoint")
            expected = saved["rounds"] if saved else 0
            print(f"check: {name}/seed{run.seed} resumes after round {run.next_round} (carried: {expected})")
            if run.next_round != expected:
                problems.append(f"{name}/seed{run.seed} would start after round {run.next_round}, its carried "
                                f"checkpoint holds {expected}")
    return problems


def travelling_tree_bytes() -> int:
    """Bytes of what every device call sends besides ``carry``: tracked and untracked-not-ignored files."""
    if os.environ.get("LEASE_TREE_BYTES"):  # the rehearsal's stand-in
        return int(os.environ["LEASE_TREE_BYTES"])
    names = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=REPO, check=True,
                           capture_output=True).stdout.decode().split("\0")
    return sum((REPO / n).stat().st_size for n in names if n and (REPO / n).is_file())


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def prepare(lease: Lease, wheels: Path | None, data: Path, sources: list[Path], limit: int,
            check: Path | None = None) -> int:
    """Fill ``.lease`` (wheels, mosaics, the last summary and as much of the checkpoints as fits) and
    ``.lease2``, ... (the rest, re-cut to fill each), each call's payload (tree + its folder) under ``limit``
    bytes; print the calls to make. The compile cache goes only into room left in the last folder: a stash call
    of its own costs more device time than the compiling it saves. A first lease's runs (one seed each) are
    seed 0's. ``check``: an empty scratch folder in which every carried checkpoint must resume its seed
    (``check_resume``), else exit 1."""
    data_dir = data
    base = Path(lease.carry) if Path(lease.carry).is_absolute() else REPO / lease.carry
    for old in lease.carried():
        shutil.rmtree(old)
    main = base
    (main / "resume").mkdir(parents=True)
    if wheels is not None:
        shutil.copytree(wheels, main / "wheels")
    tree = travelling_tree_bytes()
    folders, room = [main], limit - tree - folder_bytes(main) - MiB  # a MiB kept for summary.json

    def fill(name: str, payload: bytes) -> list[str]:
        """``payload`` cut into the parts ``name.partNN`` that fill the carried folders' ``resume/`` in turn."""
        nonlocal room
        parts, offset = [], 0
        while offset < len(payload):
            if room <= 0:
                folders.append(base.with_name(f"{base.name}{len(folders) + 1}"))
                (folders[-1] / "resume").mkdir(parents=True)
                room = limit - tree
            piece = payload[offset:offset + room]
            parts.append(f"{name}.part{len(parts):02d}")
            (folders[-1] / "resume" / parts[-1]).write_bytes(piece)
            offset, room = offset + len(piece), room - len(piece)
        return parts

    mosaic_bytes = folder_bytes(data)
    if mosaic_bytes <= room:
        shutil.copytree(data, main / "cifar10_jpeg", copy_function=shutil.copyfile)  # writable copies
        (main / "cifar10_jpeg").chmod(0o755)
        room -= mosaic_bytes
    else:  # in parts, first into room left beside the wheels, the rest stashed by calls of their own
        mosaics = {}
        for path in sorted(p for p in data.iterdir() if p.is_file()):
            payload = path.read_bytes()
            mosaics[path.name] = {"sha256": hashlib.sha256(payload).hexdigest(),
                                  "parts": fill(f"cifar10_jpeg.{path.name}", payload)}
        write_json(main / "mosaics.json", mosaics)  # within the MiB kept
        print(f"mosaics in {sum(len(m['parts']) for m in mosaics.values())} parts: they do not fit beside the "
              f"tree ({tree / MiB:.1f} MiB)")
    if sources:
        found = {p.name: p for source in sources for p in source.iterdir() if p.is_file()}
        if "summary.json" not in found:
            raise FileNotFoundError(f"no summary.json in {', '.join(map(str, sources))}")
        summary = json.loads(found["summary.json"].read_text())
        if summary.get("format") != FORMAT:  # the first lease's runs, one seed each, are seed 0's
            summary["runs"] = {(k if "/seed" in k else f"{k}/seed0"): v for k, v in summary.get("runs", {}).items()}
        carried = []  # (its run, its entry in the summary, its returned parts), the checkpoints first
        for name, run in summary.get("runs", {}).items():
            saved = run.get("checkpoint")
            if not saved:
                continue
            missing = [p for p in saved["parts"] if p not in found]
            if missing:
                print(f"warning: {name}: parts {', '.join(missing)} were not brought back, so the next lease "
                      "cannot continue this run (it will say so and train the others)", file=sys.stderr)
                continue
            saved.setdefault("version", summary.get("lease_index", 0))
            carried.append((name, saved, [found[p] for p in saved["parts"]]))
        cache = summary.pop("compile_cache", None)
        if cache and all(p in found for p in cache["parts"]):
            checkpoint_bytes = sum(p.stat().st_size for _, _, parts in carried for p in parts)
            cache_bytes = sum(found[p].stat().st_size for p in cache["parts"])
            spill = checkpoint_bytes - max(room, 0)  # what goes into stash folders of ``limit - tree`` each
            last_room = -spill if spill <= 0 else -spill % (limit - tree)
            if cache_bytes <= last_room:
                summary["compile_cache"] = cache
                carried.append((None, cache, [found[p] for p in cache["parts"]]))
            else:
                print(f"compile cache left behind: its {cache_bytes / MiB:.1f} MiB would add a stash call "
                      "(the runs compile anew)")
        for name, entry, parts in carried:  # re-cut into pieces that fill each call's payload
            data = b"".join(p.read_bytes() for p in parts)
            if hashlib.sha256(data).hexdigest() != entry["sha256"]:
                raise ValueError(f"{entry['file']}: the returned parts do not join to its sha256")
            if check is not None and name is not None:  # where the lease will put it
                path = check / "runs" / name / f"version_{entry['version']}" / "checkpoints" / "last.ckpt"
                path.parent.mkdir(parents=True)
                path.write_bytes(data)
            entry["parts"] = fill(entry["file"], data)
        write_json(main / "resume" / "summary.json", summary)  # with the parts as carried
        if check is not None:
            problems = check_resume(lease, summary, data_dir, check)
            for problem in problems:
                print(f"error: {problem}", file=sys.stderr)
            if problems:
                return 1
    print(f"travelling tree (tracked + untracked, not ignored): {tree / MiB:.1f} MiB")
    for folder in folders:
        total = tree + folder_bytes(folder)
        print(f"call payload with {folder.name}: {total / MiB:.2f} MiB (limit {limit / MiB:.2f} MiB)")
        if total > limit:
            print(f"error: {folder.name} makes the payload {total / MiB:.1f} MiB, over the limit", file=sys.stderr)
            return 1
    print("device calls, back to back (each within 30 s of the last):")
    for folder in folders[1:]:
        print(f'  run(command="bash bench/gpu_lease.sh --stash", carry=["{folder.name}"], timeout_s=60)')
    print(f'  run(command="LEASE_LIMIT_S=540 bash bench/gpu_lease.sh", carry=["{main.name}"], timeout_s=540)')
    print('  run(command="bash bench/gpu_lease.sh --collect", timeout_s=60)   # while the last one says files wait')
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--wheels", type=Path, help="folder of the wheels the device lacks")
    p.add_argument("--data", type=Path, required=True, help="the cifar10_jpeg folder")
    p.add_argument("--from", dest="sources", type=Path, nargs="*", default=[],
                   help="folders holding the last lease's returned files (summary.json, parts)")
    p.add_argument("--limit-mib", type=float, default=60)
    p.add_argument("--check", type=Path, help="an empty scratch folder: check there that every carried "
                   "checkpoint resumes its seed (built on the CPU, not trained)")
    for name in ("stash", "lease", "collect"):
        sub.add_parser(name)
    args = parser.parse_args(argv)
    lease = Lease()
    if args.command == "prepare":
        return prepare(lease, args.wheels, args.data, args.sources, int(args.limit_mib * MiB), args.check)
    if args.command == "stash":
        stash(lease)
        return 0
    if args.command == "collect":
        collect(lease)
        return 0
    return run_lease(lease)


if __name__ == "__main__":
    sys.exit(main())
