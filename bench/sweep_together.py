"""K settings of a sweep trained together (``fedrcl sweep --together``) against one after another (CPU).

For K = 1, 3 and 9 settings of FedRCL on the quickstart (digits, small CNN, 5 of 20 clients a round, 2 local
epochs of 4 steps of batch 24; its RepresentationMonitor dropped, as together runs no trainer callbacks), one
seed each: the client lr (0.1; 0.05, 0.1, 0.2) and, for 9, by the penalty weight beta (0.5, 1, 2), so that
both kinds of mapped values are in the cohort. Each configuration is one ``fedrcl sweep`` child process
(``OMP_NUM_THREADS=--threads``, a fresh run folder): with ``--together`` all K runs in one stacked step; without,
each run is its own ``fedrcl fit`` in the same process, one after another (what the sweep does without
``--together``). Together and one after another run in turn for each K, so that a drifting load falls on both.

A setting-round is one round of one setting. Its seconds are the wall time between a run's consecutive round
lines as they reach this process (the whole round: local steps, aggregation, evaluation, logging, checkpoints),
divided by K together, where the K runs share each round; each run's first round (warm-up) is left out and the
median taken over the other rounds of every run. The child's CPU time (user + system, all threads, read from
``/proc`` as each round line arrives) over the same rounds is shown too: on a machine shared with other jobs
the wall time moves with their load, the CPU time much less. Ratios are together over one after another, from
this one run. A together run that falls back (a ``--together:`` line) fails the bench. Linux only (``/proc``).

    python bench/sweep_together.py [--rounds 8] [--threads 1]
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
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
from seeds_together import cpu_seconds  # noqa: E402  (the same /proc reading as the seeds bench)

FIT_ARGS = ["--config", "configs/quickstart.yaml", "--trainer.callbacks", "[]", "--data.local_iters_per_epoch", "4"]
GRIDS = {1: ["model.lr=0.1"], 3: ["model.lr=0.05,0.1,0.2"], 9: ["model.lr=0.05,0.1,0.2", "model.beta=0.5,1,2"]}
# Round lines: together ``lr=0.1 seed 0: Round 3/8 ...``; one after another, each fit's own ``Round 3/8 ...``
# after the sweep's ``fedrcl sweep: lr=0.1 seed 0: fedrcl fit ...``.
TOGETHER_LINE = re.compile(r"^(\S+) seed 0: Round (\d+)/\d+\s")
STARTS = re.compile(r"^fedrcl sweep: (\S+) seed 0: fedrcl fit ")
ALONE_LINE = re.compile(r"^Round (\d+)/\d+\s")


def run_sweep(grid: list[str], together: bool, rounds: int, save_dir: Path, threads: int,
              timeout: float) -> dict[str, dict[int, tuple[float, float]]]:
    """``fedrcl sweep --grid GRID --seeds 0 [--together]`` in a child process: for each setting, when each of its
    round lines arrived (wall clock, the child's CPU seconds). Raises with the output's tail when the child
    fails, falls back or times out."""
    command = [sys.executable, "-m", "fedrcl.cli", "sweep", "--grid", *grid, "--seeds", "0", "--rounds", str(rounds),
               *(["--together"] if together else []), *FIT_ARGS, "--trainer.logger.init_args.save_dir", str(save_dir)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    arrivals: dict[str, dict[int, tuple[float, float]]] = {}
    tail, current = deque[str](maxlen=30), ""
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    killer = threading.Timer(timeout, os.killpg, (proc.pid, signal.SIGKILL))
    killer.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            now = time.perf_counter(), cpu_seconds(proc.pid)
            tail.append(line)
            if "--together:" in line:
                raise RuntimeError(f"{' '.join(command)}: not together:\n" + "".join(tail))
            if together and (found := TOGETHER_LINE.match(line)):
                arrivals.setdefault(found.group(1), {})[int(found.group(2))] = now
            elif not together and (started := STARTS.match(line)):
                current = started.group(1)
            elif not together and (found := ALONE_LINE.match(line)):
                arrivals.setdefault(current, {})[int(found.group(1))] = now
        code = proc.wait()
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    finally:
        killer.cancel()
    if code != 0 or any(len(r) != rounds for r in arrivals.values()) or not arrivals:
        raise RuntimeError(f"{' '.join(command)}: exit status {code}, rounds seen "
                           f"{ {k: len(v) for k, v in arrivals.items()} }:\n" + "".join(tail))
    return arrivals


def per_setting_round(arrivals: dict[str, dict[int, tuple[float, float]]], together: bool) -> tuple[float, float]:
    """The median wall seconds and the mean CPU seconds per setting-round, rounds 2 on of every run (together:
    each round's time shared by the K runs)."""
    share = len(arrivals) if together else 1
    walls, cpus = [], []
    for rounds in arrivals.values():
        done = sorted(rounds)
        walls += [(rounds[r][0] - rounds[r - 1][0]) / share for r in done[1:]]
        cpus.append((rounds[done[-1]][1] - rounds[done[0]][1]) / (done[-1] - done[0]) / share)
    return statistics.median(walls), statistics.mean(cpus)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8, help="rounds per run, the first a warm-up (default 8)")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every child (default 1)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per child process")
    args = parser.parse_args()
    if args.rounds < 2:
        parser.error("--rounds must be >= 2 (the first round is a warm-up)")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for k, grid in GRIDS.items():
            measured = {}
            for together in (False, True):
                save_dir = Path(tempfile.mkdtemp(dir=tmp))
                started = time.perf_counter()
                arrivals = run_sweep(grid, together, args.rounds, save_dir, args.threads, args.timeout)
                measured[together] = per_setting_round(arrivals, together)
                print(f"{k} settings {'together' if together else 'one after another'}: "
                      f"{time.perf_counter() - started:.0f} s", flush=True)
            rows.append((k, measured[False], measured[True]))
    print(f"\nquickstart (FedRCL, digits), {args.rounds} rounds per setting, OMP_NUM_THREADS={args.threads}; "
          "cells: one after another / together\n")
    print("| settings | s per setting-round | ratio | CPU s per setting-round | ratio |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for k, (wall_a, cpu_a), (wall_t, cpu_t) in rows:
        print(f"| {k} | {wall_a:.3f} / {wall_t:.3f} | {wall_t / wall_a:.2f} | {cpu_a:.3f} / {cpu_t:.3f} | "
              f"{cpu_t / cpu_a:.2f} |")
    k, (wall_a, cpu_a), (wall_t, cpu_t) = rows[-1]
    print(f"\ntogether_over_one_after_another={wall_t / wall_a:.3f} at {k} settings (CPU time {cpu_t / cpu_a:.3f})")


if __name__ == "__main__":
    main()
