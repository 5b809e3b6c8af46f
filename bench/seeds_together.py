"""K seeds trained together in one process (``fedrcl seeds --together``) against K separate runs (CPU).

For K = 1 .. ``--seeds``: seconds per seed-round and peak memory of seeds 0 .. K-1 trained together (one
process, every seed's clients in one batched local step on a stacked axis) against the same seeds run
separately: one after another, each its own process (``fedrcl seeds --seeds k``, which is one ``fedrcl fit``
of seed k). The separate runs train their clients one after another (the CPU default, ``client_batching:
auto``) and batched (``--trainer.client_batching on``: the step that together stacks, one seed at a time);
with ``--trainer.compile_clients true`` the compiled step together is compared to compiled batched runs.
Every configuration is a child process of its own (``OMP_NUM_THREADS=--threads``, a fresh run folder); seed
k-1 alone and the K seeds together run in turn, so that a drifting load falls on both. Each together run
compiles into an empty cache (``TORCHINDUCTOR_CACHE_DIR``); the separate runs of one kind share one, as one
user's runs would: the first compiles, the later ones reuse it.

A seed-round is one round of one seed. Its seconds are the wall time between that seed's consecutive round
lines as they reach this process (the whole round: local steps, aggregation, evaluation, logging,
checkpoints), divided by K for seeds together, which share each round; the first round (compilation, warm-up)
is left out and the median taken over the other rounds of every seed. On a machine shared with other jobs the
wall time moves with their load, so the child's CPU time (user + system, all threads, read from ``/proc`` as
each round line arrives) is measured over the same rounds too: its mean per seed-round does not count the
time other jobs hold the core. Peak memory is the child's maximum resident set (``os.wait4``), for separate
runs the largest of their K processes; process CPU is each process's whole CPU time (start-up, compilation,
every round), summed over separate processes. Ratios are together over separate, from this one run. A run
that falls back to one seed or one client after another fails the bench; that together and batched alone did
the same work is shown by each seed's last ``train/loss``. Last line: ``together_over_separate=`` for the
largest K, eager together against clients one after another (wall, then CPU time). Linux only (``/proc``).

    python bench/seeds_together.py [--setting digits|cifar10] [--seeds 3] [--rounds R] [--no-compile]
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# The fit arguments of each setting on the CPU (paths relative to the repository root, the children's cwd),
# and its rounds per run.
SETTINGS = {
    # configs/quickstart.yaml: FedRCL, small CNN on 8x8 digits, 5 of 20 clients a round, 2 local epochs of 4
    # steps of batch 24 (equal steps, which batching needs; about 0.2 s a round on one thread): a round is
    # mostly per-step overhead, where stacking may pay. Its RepresentationMonitor is dropped (measured: the
    # rounds' training, not an analysis callback's evaluation).
    "digits": (["--config", "configs/quickstart.yaml", "--trainer.callbacks", "[]",
                "--data.local_iters_per_epoch", "4"], 12),
    # configs/cpu/cifar10_a01_resnet8.yaml: FedRCL, ResNet-18-GN width 8 on CIFAR-10 (../shared/data), 5 of
    # 100 clients a round, 1 local epoch of 10 steps of batch 50 (about 2.7 s a round): compute-bound. No
    # evaluation (10,000 test images would take most of the round).
    "cifar10": (["--config", "configs/cpu/cifar10_a01_resnet8.yaml", "--trainer.local_epochs", "1",
                 "--trainer.eval_every", str(10 ** 6)], 4),
}
BATCHED = ["--trainer.client_batching", "on"]
COMPILED = ["--trainer.compile_clients", "true"]
# Table rows per K: (together's step, the separate runs' clients) -- eager against the CPU default and against
# batched clients (the same step, one seed at a time), compiled against batched and compiled.
COMPARISONS = [("eager", "one after another"), ("eager", "batched"), ("compiled", "compiled")]
# ``trainer.client_batching``'s notice that a round trains its clients one after another after all.
FALLBACK = "clients trained one after another"
# A round line: ``Round 3/8  val/acc 0.93  (0.41 s; elapsed ...)``, ``seed 1: `` before it when together.
ROUND_LINE = re.compile(r"^(?:seed (\d+): )?Round (\d+)/\d+\s.*\(\d+\.\d+ s; ")


def cpu_seconds(pid: int) -> float:
    """The CPU time (user + system, all threads) process ``pid`` has used so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime


TICKS = os.sysconf("SC_CLK_TCK")


@dataclass
class Child:
    """One child process: when each seed's round lines arrived (wall clock, the child's CPU time), and its
    whole CPU time and peak memory."""

    arrivals: dict[int, dict[int, tuple[float, float]]] = field(default_factory=dict)  # seed -> round -> ...
    cpu: float = 0.0
    wall: float = 0.0
    peak_mb: float = 0.0


@dataclass
class Measured:
    """One configuration (K seeds, together or separate): the figures of its table row."""

    rounds: list[float]  # wall seconds per seed-round, rounds 2 on of every seed
    cpu: list[float]  # each seed's CPU seconds per seed-round over rounds 2 on
    peak_mb: float
    process_cpu: float
    wall: float
    losses: list[float]  # each seed's last train/loss: the same work together and separate

    @property
    def seed_round(self) -> float:
        return statistics.median(self.rounds)

    @property
    def seed_round_cpu(self) -> float:
        return statistics.mean(self.cpu)


def run_child(fit_args: list[str], seeds: list[int], together: bool, save_dir: Path, cache: Path,
              threads: int, timeout: float) -> Child:
    """``fedrcl seeds --seeds SEEDS [--together] FIT_ARGS`` in a child process, its round lines timed as they
    arrive; raises with the output's tail when it fails, times out or does not train the seeds together."""
    command = [sys.executable, "-m", "fedrcl.cli", "seeds", "--seeds", *map(str, seeds),
               *(["--together"] if together else []), *fit_args,
               "--trainer.logger.init_args.save_dir", str(save_dir)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1",
           "TORCHINDUCTOR_CACHE_DIR": str(cache)}
    child, tail = Child(), deque[str](maxlen=30)
    batched = together or "--trainer.client_batching" in fit_args
    started = time.perf_counter()
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    killer = threading.Timer(timeout, os.killpg, (proc.pid, signal.SIGKILL))
    killer.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            now = time.perf_counter(), cpu_seconds(proc.pid)
            tail.append(line)
            if batched and FALLBACK in line:
                raise RuntimeError(f"{' '.join(command)}: not batched:\n" + "".join(tail))
            found = ROUND_LINE.match(line)
            if found is None:
                continue
            if together != (found.group(1) is not None):  # together prefixes each line with its seed
                raise RuntimeError(f"{' '.join(command)}: not {'together' if together else 'separate'}:\n"
                                   + "".join(tail))
            seed = int(found.group(1)) if together else seeds[0]
            child.arrivals.setdefault(seed, {})[int(found.group(2))] = now
        _, status, usage = os.wait4(proc.pid, 0)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)  # its whole process group, then reaped
        proc.wait()
        raise
    finally:
        killer.cancel()
    child.wall, child.cpu = time.perf_counter() - started, usage.ru_utime + usage.ru_stime
    child.peak_mb = usage.ru_maxrss / 1024  # kB on Linux
    code = os.waitstatus_to_exitcode(status)
    if code != 0 or sorted(child.arrivals) != seeds:
        raise RuntimeError(f"{' '.join(command)}: exit status {code}, round lines of seeds "
                           f"{sorted(child.arrivals)}:\n" + "".join(tail))
    return child


def periods(arrivals: dict[int, tuple[float, float]]) -> list[float]:
    """Wall seconds between consecutive round lines of one seed, from round 2 on (round 1 is the warm-up)."""
    rounds = sorted(arrivals)
    return [arrivals[r][0] - arrivals[r - 1][0] for r in rounds[1:] if r - 1 in arrivals]


def round_cpu(arrivals: dict[int, tuple[float, float]]) -> float:
    """The child's CPU seconds per round from its round-1 line to its last round line of one seed."""
    first, last = min(arrivals), max(arrivals)
    return (arrivals[last][1] - arrivals[first][1]) / (last - first)


def last_loss(save_dir: Path, seed: int) -> float:
    """A seed's last logged ``train/loss`` (its run folder ``<name>/seed<k>``)."""
    from fedrcl.analysis.runs import load_scalars

    (run,) = save_dir.glob(f"*/seed{seed}")
    return float(load_scalars(run)["train/loss"][1][-1])


def together(fit_args: list[str], k: int, root: Path, threads: int, timeout: float) -> Measured:
    """Seeds 0 .. k-1 trained together in one process (compiling into an empty cache)."""
    save_dir, cache = Path(tempfile.mkdtemp(dir=root)), Path(tempfile.mkdtemp(dir=root))
    child = run_child(fit_args, list(range(k)), True, save_dir, cache, threads, timeout)
    return Measured([p / k for s in range(k) for p in periods(child.arrivals[s])],
                    [round_cpu(child.arrivals[s]) / k for s in range(k)], child.peak_mb, child.cpu,
                    child.wall, [last_loss(save_dir, s) for s in range(k)])


def alone(fit_args: list[str], seed: int, root: Path, cache: Path, threads: int, timeout: float) -> Measured:
    """One seed in its own process (``fedrcl seeds --seeds SEED``: one ``fedrcl fit``), compiling into
    ``cache``, which the seeds alone of one kind share (a later one reuses the first one's compilation, as
    separate runs of one user would)."""
    save_dir = Path(tempfile.mkdtemp(dir=root))
    child = run_child(fit_args, [seed], False, save_dir, cache, threads, timeout)
    return Measured(periods(child.arrivals[seed]), [round_cpu(child.arrivals[seed])], child.peak_mb,
                    child.cpu, child.wall, [last_loss(save_dir, seed)])


def separate(runs: list[Measured]) -> Measured:
    """Seeds run one after another, each alone: all their rounds, the largest peak, the summed times."""
    return Measured([x for r in runs for x in r.rounds], [x for r in runs for x in r.cpu],
                    max(r.peak_mb for r in runs), sum(r.process_cpu for r in runs), sum(r.wall for r in runs),
                    [x for r in runs for x in r.losses])


def table(rows: list[tuple[int, str, Measured, Measured]]) -> str:
    """The markdown table: per K and comparison, separate and together and their ratio."""
    lines = ["| K | together vs separate | s per seed-round | ratio | CPU s per seed-round | ratio | peak MB "
             "| ratio | process CPU s | ratio |",
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for k, label, sep, tog in rows:
        cells = [f"{sep.seed_round:.3f} / {tog.seed_round:.3f}", f"{tog.seed_round / sep.seed_round:.2f}",
                 f"{sep.seed_round_cpu:.3f} / {tog.seed_round_cpu:.3f}",
                 f"{tog.seed_round_cpu / sep.seed_round_cpu:.2f}",
                 f"{sep.peak_mb:.0f} / {tog.peak_mb:.0f}", f"{tog.peak_mb / sep.peak_mb:.2f}",
                 f"{sep.process_cpu:.0f} / {tog.process_cpu:.0f}", f"{tog.process_cpu / sep.process_cpu:.2f}"]
        lines.append(f"| {k} | {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setting", choices=sorted(SETTINGS), default="digits")
    parser.add_argument("--seeds", type=int, default=3, help="K runs from 1 to this")
    parser.add_argument("--rounds", type=int, help="rounds per run, the first a warm-up (default: the "
                        "setting's, digits 12, cifar10 4)")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every child")
    parser.add_argument("--no-compile", action="store_true", help="leave out --trainer.compile_clients true")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per child process")
    args = parser.parse_args()
    setting, rounds = SETTINGS[args.setting]
    rounds = args.rounds or rounds
    if args.seeds < 1 or rounds < 2:
        parser.error("--seeds must be >= 1 and --rounds >= 2 (the first round is a warm-up)")
    fit_args = [*setting, "--trainer.rounds", str(rounds)]
    alone_args = {"one after another": [], "batched": BATCHED, "compiled": [*BATCHED, *COMPILED]}
    together_args = {"eager": [], "compiled": COMPILED}
    if args.no_compile:
        del alone_args["compiled"], together_args["compiled"]
    alone_runs: dict[str, list[Measured]] = {name: [] for name in alone_args}
    stacked: dict[str, list[Measured]] = {name: [] for name in together_args}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        caches = {name: Path(tempfile.mkdtemp(dir=root)) for name in alone_args}
        for k in range(1, args.seeds + 1):  # seed k-1 alone, then k seeds together: in turn
            for name, extra in alone_args.items():
                run = alone([*fit_args, *extra], k - 1, root, caches[name], args.threads, args.timeout)
                alone_runs[name].append(run)
                print(f"seed {k - 1} alone, clients {name}: {run.wall:.0f} s ({run.process_cpu:.0f} s CPU), "
                      f"peak {run.peak_mb:.0f} MB", flush=True)
            for name, extra in together_args.items():
                run = together([*fit_args, *extra], k, root, args.threads, args.timeout)
                stacked[name].append(run)
                print(f"{k} seeds together, {name}: {run.wall:.0f} s ({run.process_cpu:.0f} s CPU), "
                      f"peak {run.peak_mb:.0f} MB", flush=True)
    comparisons = [(step, name) for step, name in COMPARISONS if step in stacked]
    rows = [(k, f"{step} vs {name}", separate(alone_runs[name][:k]), stacked[step][k - 1])
            for k in range(1, args.seeds + 1) for step, name in comparisons]
    print(f"\n{args.setting}, {rounds} rounds, OMP_NUM_THREADS={args.threads}; "
          "cells: separate / together\n")
    print(table(rows))
    differences = [abs(a - b) / abs(b) for step, name in comparisons if name != "one after another"
                   for a, b in zip(stacked[step][-1].losses, separate(alone_runs[name]).losses)]
    print(f"\nlast train/loss of each seed, together against batched alone: relative difference "
          f"<= {max(differences):.1e}")
    default, eager = separate(alone_runs["one after another"]), stacked["eager"][-1]
    print(f"together_over_separate={eager.seed_round / default.seed_round:.3f} (CPU time "
          f"{eager.seed_round_cpu / default.seed_round_cpu:.3f})")


if __name__ == "__main__":
    main()
