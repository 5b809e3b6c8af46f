"""Where a federated round's time goes, old code against new, in one process.

Extracts the package ``fedrcl/`` of an older commit (``--against``, default 9169a0a: before the multi-process,
batched and reliability work) into a temporary folder, then alternates: import that version, train
``--rounds`` rounds of ``round_overhead``'s workload (small CNN, 5 clients x 50 steps of batch 50, no
evaluation) under ``cProfile``, drop every ``fedrcl`` module, import the working tree's version, the same.
Rounds after the first of each run are profiled (the first is a warm-up), by this process's CPU time.
Prints CPU seconds per profiled round for both versions; the Python time of the engine (fedrcl's round loop
and algorithms, Lightning) apart from the work a raw loop shares (losses, data, models); the functions whose
own time per round changed most; fedrcl's and Lightning's functions by own time; and the framework's
functions by cumulative time per round with the callers they are reached from.
cProfile slows Python-heavy code more than kernels: read the columns against each other, not as wall time.

``--per-step`` prints instead what does not depend on the machine's load: per local step of a round (the
second), the Python calls (cProfile) and the operator events (``torch.profiler``) of both versions and of
``round_overhead``'s raw loop, FedAvg and FedRCL. The framework's round is counted from the method's own
round hooks (no extra callback), the raw loop's as two rounds less one.

    OMP_NUM_THREADS=1 python bench/profile_round.py [--against 9169a0a] [--method FedRCL] [--rounds 4]
        [--batching on]       # the round's clients batched (``trainer.client_batching``), in both versions
    OMP_NUM_THREADS=1 python bench/profile_round.py --per-step [--against 9169a0a]
"""
from __future__ import annotations

import argparse
import cProfile
import importlib
import pstats
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import lightning as L
from torch.profiler import ProfilerActivity, profile

from round_overhead import raw_rounds, write_fake_cifar

REPO = Path(__file__).resolve().parents[1]
FRAMEWORK = ("fedrcl/", "lightning/pytorch/loops/", "lightning/pytorch/trainer/", "lightning/pytorch/core/")
ENGINE = ("fedrcl/federated/", "fedrcl/algorithms/", "lightning/")
WORK = ("fedrcl/losses/", "fedrcl/data/", "fedrcl/models/")


def extract(commit: str, into: Path) -> Path:
    """The package folder of ``commit`` under ``into`` (read with ``git archive``, nothing checked out)."""
    archive = into / "old.tar"
    subprocess.run(["git", "-C", str(REPO), "archive", "-o", str(archive), commit, "fedrcl"], check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into / "old", filter="data")
    return into / "old"


def import_fedrcl(root: Path):
    """Import the ``fedrcl`` package found in ``root`` (dropping any version imported before)."""
    for name in [m for m in sys.modules if m == "fedrcl" or m.startswith("fedrcl.")]:
        del sys.modules[name]
    sys.path.insert(0, str(root))
    try:
        return importlib.import_module("fedrcl"), importlib.import_module("fedrcl.federated.trainer")
    finally:
        sys.path.remove(str(root))


class Profiled(L.Callback):
    """Profiles every round but the first."""

    def __init__(self, profile: cProfile.Profile):
        self.profile, self.rounds = profile, 0

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch > 0:
            self.profile.enable()

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.current_epoch > 0:
            self.profile.disable()
            self.rounds += 1


def profile_rounds(root: Path, data: Path, method: str, rounds: int, batching: str = "off"
                   ) -> tuple[pstats.Stats, int]:
    fedrcl, trainer_module = import_fedrcl(root)
    algorithms = importlib.import_module("fedrcl.algorithms")
    models = importlib.import_module("fedrcl.models")
    datamodule = importlib.import_module("fedrcl.data.datamodule")
    L.seed_everything(0, verbose=False)
    dm = datamodule.FederatedDataModule(dataset="cifar10", root=str(data), num_clients=50, partition="iid",
                                        batch_size=50, local_iters_per_epoch=10)
    model = getattr(algorithms, method)(backbone=models.SmallCNN, num_classes=10)
    profile = cProfile.Profile(time.process_time)  # CPU time: other jobs on the cores are not counted
    callback = Profiled(profile)
    trainer = trainer_module.FederatedTrainer(
        rounds=rounds, clients_per_round=5, local_epochs=5, eval_every=10 ** 6, accelerator="cpu", devices=1,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, callbacks=[callback], client_batching=batching)
    trainer.fit(model, datamodule=dm)
    return pstats.Stats(profile), callback.rounds


STEPS = 250  # local steps per round of the workload: 5 clients x 5 local epochs x 10


class Count:
    """Python calls (``kind="calls"``, cProfile) or operator events (``"ops"``, torch.profiler) between
    ``start`` and ``stop``."""

    def __init__(self, kind: str):
        self.kind, self.total = kind, 0

    def start(self) -> None:
        self._profile = cProfile.Profile() if self.kind == "calls" else profile(activities=[ProfilerActivity.CPU])
        self._profile.enable() if self.kind == "calls" else self._profile.__enter__()

    def stop(self) -> None:
        if self.kind == "calls":
            self._profile.disable()
            self.total += sum(row[1] for row in pstats.Stats(self._profile).stats.values())
        else:
            self._profile.__exit__(None, None, None)
            self.total += len(self._profile.events())


def framework_count(root: Path, data: Path, method: str, kind: str) -> float:
    """``kind`` per step of the framework's second round (``fedrcl`` imported from ``root``), counted from
    the method's own round hooks."""
    _, trainer_module = import_fedrcl(root)
    algorithms = importlib.import_module("fedrcl.algorithms")
    models = importlib.import_module("fedrcl.models")
    datamodule = importlib.import_module("fedrcl.data.datamodule")
    count = Count(kind)

    class Counted(getattr(algorithms, method)):
        def on_train_epoch_start(self):
            super().on_train_epoch_start()
            if self.trainer.current_epoch == 1:
                count.start()

        def on_train_epoch_end(self):
            if self.trainer.current_epoch == 1:
                count.stop()
            super().on_train_epoch_end()

    L.seed_everything(0, verbose=False)
    dm = datamodule.FederatedDataModule(dataset="cifar10", root=str(data), num_clients=50, partition="iid",
                                        batch_size=50, local_iters_per_epoch=10)
    trainer = trainer_module.FederatedTrainer(
        rounds=2, clients_per_round=5, local_epochs=5, eval_every=10 ** 6, accelerator="cpu", devices=1,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0)
    trainer.fit(Counted(backbone=models.SmallCNN, num_classes=10), datamodule=dm)
    return count.total / STEPS


def raw_count(data: Path, rcl: bool, kind: str) -> float:
    """``kind`` per step of one round of ``round_overhead``'s raw loop: two rounds less one."""
    totals = []
    for rounds in (2, 1):
        count = Count(kind)
        count.start()
        raw_rounds(rcl, data, "cpu", rounds)
        count.stop()
        totals.append(count.total)
    return (totals[0] - totals[1]) / STEPS


def per_step(roots: dict[str, Path], data: Path) -> None:
    print("Per local step (one round), framework and raw loop: Python calls and operator events, and the "
          "framework's extra over the raw loop")
    print(f"{'':18}{'calls':>8}{'extra':>8}{'ops':>8}{'extra':>8}")
    for method in ("FedAvg", "FedRCL"):
        raw = {kind: raw_count(data, method == "FedRCL", kind) for kind in ("calls", "ops")}
        for version, root in roots.items():
            fw = {kind: framework_count(root, data, method, kind) for kind in ("calls", "ops")}
            print(f"{version + ' ' + method:18}" + "".join(f"{fw[k]:8.0f}{fw[k] - raw[k]:+8.0f}" for k in fw))
        print(f"{'raw ' + method:18}{raw['calls']:8.0f}{'':8}{raw['ops']:8.0f}", flush=True)


def where(filename: str) -> str:
    """A file path shortened to its package-relative form, the same for both versions."""
    path = filename.replace("\\", "/")
    for marker in ("/fedrcl/", "/lightning/", "/torch/"):
        if marker in path:
            return marker[1:] + path.split(marker, 1)[1]
    return path.rsplit("/", 1)[-1]


def name(func: tuple[str, int, str]) -> str:
    filename, _, function = func
    return f"{where(filename)}:{function}"


def per_round(stats: pstats.Stats, rounds: int) -> dict[str, dict]:
    """Function -> own and cumulative seconds per round, calls per round, and its callers' shares."""
    table: dict[str, dict] = defaultdict(lambda: {"own": 0.0, "cum": 0.0, "calls": 0.0,
                                                  "callers": defaultdict(float)})
    for func, (_, calls, own, cum, callers) in stats.stats.items():
        row = table[name(func)]
        row["own"] += own / rounds
        row["cum"] += cum / rounds
        row["calls"] += calls / rounds
        for caller, (_, _, _, caller_cum) in callers.items():
            row["callers"][name(caller)] += caller_cum / rounds
    return table


def merge(tables: list[dict[str, dict]]) -> dict[str, dict]:
    """Mean of several runs' tables."""
    out: dict[str, dict] = defaultdict(lambda: {"own": 0.0, "cum": 0.0, "calls": 0.0,
                                                "callers": defaultdict(float)})
    for table in tables:
        for key, row in table.items():
            for field in ("own", "cum", "calls"):
                out[key][field] += row[field] / len(tables)
            for caller, seconds in row["callers"].items():
                out[key]["callers"][caller] += seconds / len(tables)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", default="9169a0a", help="older commit to compare with")
    parser.add_argument("--method", default="FedRCL", help="client algorithm (a name in fedrcl.algorithms)")
    parser.add_argument("--rounds", type=int, default=4, help="rounds per run (the first is not profiled)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each version, alternating")
    parser.add_argument("--top", type=int, default=20, help="rows per table")
    parser.add_argument("--per-step", action="store_true", help="count calls and operator events per step")
    parser.add_argument("--batching", default="off", choices=("off", "on"),
                        help="trainer.client_batching of both versions' runs")
    args = parser.parse_args()
    if args.rounds < 2:
        parser.error("--rounds must be >= 2 (the first round is a warm-up)")
    tables: dict[str, list] = {"old": [], "new": []}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        write_fake_cifar(tmp)
        roots = {"old": extract(args.against, tmp), "new": REPO}
        if args.per_step:
            per_step(roots, tmp)
            return
        for repeat in range(args.repeats):
            for version in (("old", "new") if repeat % 2 == 0 else ("new", "old")):
                stats, rounds = profile_rounds(roots[version], tmp, args.method, args.rounds, args.batching)
                tables[version].append(per_round(stats, rounds))
    old, new = merge(tables["old"]), merge(tables["new"])
    total = {v: sum(row["own"] for row in t.values()) for v, t in (("old", old), ("new", new))}
    print(f"{args.method}, clients batched {args.batching}, profiled CPU seconds per round: old ({args.against}) "
          f"{total['old']:.3f}, "
          f"new {total['new']:.3f}, new/old {total['new'] / total['old']:.3f}")

    for label, prefixes in (("the engine (fedrcl.federated, fedrcl.algorithms, Lightning)", ENGINE),
                            ("the work a raw loop shares (losses, data, models)", WORK)):
        own = {v: sum(row["own"] for key, row in t.items() if key.startswith(prefixes)) * 1e3
               for v, t in (("old", old), ("new", new))}
        print(f"Python own time of {label} per round (kernels excluded): old {own['old']:.1f} ms, "
              f"new {own['new']:.1f} ms")

    print("\nOwn time per round, largest changes (ms; calls per round):")
    print(f"{'old':>9} {'new':>9} {'change':>9} {'calls':>8}  function")
    keys = sorted(set(old) | set(new), key=lambda k: -abs(new[k]["own"] - old[k]["own"]))
    for key in keys[:args.top]:
        o, n = old[key]["own"] * 1e3, new[key]["own"] * 1e3
        print(f"{o:9.2f} {n:9.2f} {n - o:+9.2f} {new[key]['calls']:8.0f}  {key}")

    print("\nfedrcl's and Lightning's own time per round, largest first (ms; calls per round):")
    print(f"{'old':>9} {'new':>9} {'calls':>8}  function")
    mine = [k for k in new if k.startswith(("fedrcl/", "lightning/"))]
    for key in sorted(mine, key=lambda k: -new[k]["own"])[:args.top]:
        print(f"{old[key]['own'] * 1e3:9.2f} {new[key]['own'] * 1e3:9.2f} {new[key]['calls']:8.0f}  {key}")

    print("\nThe framework's functions by cumulative time per round (ms), new against old, with callers:")
    print(f"{'old':>9} {'new':>9} {'change':>9}  function  <- callers (new, ms)")
    framework = [k for k in set(old) | set(new) if k.startswith(FRAMEWORK)]
    for key in sorted(framework, key=lambda k: -abs(new[k]["cum"] - old[k]["cum"]))[:args.top]:
        o, n = old[key]["cum"] * 1e3, new[key]["cum"] * 1e3
        callers = sorted(new[key]["callers"].items(), key=lambda kv: -kv[1])[:2]
        via = ", ".join(f"{c.split(':')[-1]} {s * 1e3:.1f}" for c, s in callers)
        print(f"{o:9.2f} {n:9.2f} {n - o:+9.2f}  {key}  <- {via}")


if __name__ == "__main__":
    main()
