"""``fedrcl seeds``: one ``fedrcl fit`` per seed, each in its own run folder ``<name>/seed<k>``.

    fedrcl seeds --seeds 0 1 2 --config configs/quickstart.yaml
    fedrcl seeds --seeds 0 1 2 --parallel 3 --config configs/cpu/cifar10_a01_cnn.yaml \
        --model fedrcl.algorithms.FedAvg
    fedrcl report runs                   # the "Seeds" table: mean ± std, n and 95% interval per experiment

Every argument that is not one of this command's own (``--seeds``, ``--parallel``, ``--vary_split``) is a
``fedrcl fit`` argument, passed on as given (configs, overrides, ``--ckpt_path last`` to resume every seed).
Run ``k`` adds ``--seed_everything k --trainer.seed k`` (initialisation; client sampling, batches and
augmentation), with ``--vary_split`` also ``--data.seed k`` (the client split, fixed otherwise), and logs
under the configured logger name plus ``/seed<k>`` (``runs/quickstart/seed0/version_0``).

``--parallel 1`` (the default) runs the seeds one after another in this process, exactly as ``fedrcl fit``
would; ``--parallel N`` runs up to N ``fedrcl fit`` processes at a time, each writing its console output to
``<save_dir>/<name>/seed<k>.log`` and, unless ``OMP_NUM_THREADS`` is set, using ``cores // N`` threads.
Every ``PROGRESS_SECONDS`` it prints one line with each running seed's round, read from its log, and the time
all seeds will take (``seeds_left``). The exit status is 1 when any seed failed (the others still run). SIGTERM
stops the seeds in progress after their round, checkpointed, as it stops ``fedrcl fit``; no other seed starts;
one line names the seeds stopped and not started and the command that finishes them (the stopped ones with
``--ckpt_path last``); exit status 143. Ctrl-C (SIGINT) does the same, exit status 130: the fits get it from the
terminal (it is not passed on again, which would be their second one and stop them at once).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Optional

import yaml

if TYPE_CHECKING:
    from fedrcl.federated.preemption import StopSignal

__all__ = ["fit_args_for_seed", "main", "progress_line", "resolved_config", "run_name", "seeds_left"]

DEFAULT_LOGGER = "lightning.pytorch.loggers.TensorBoardLogger"
SEED_LIMIT = 2**32  # seeds are 0 <= seed < 2**32 (numpy's SeedSequence-free generators, Lightning's seed_everything)


def resolved_config(fit_args: list[str]) -> dict[str, Any]:
    """The configuration ``fedrcl fit <fit_args>`` would run (LightningCLI's ``--print_config``)."""
    from fedrcl.lightning_cli import build_cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            build_cli(["fit", *fit_args, "--print_config"])
        except SystemExit as stop:
            if stop.code not in (0, None):
                raise
    return yaml.safe_load(out.getvalue()) or {}


def run_name(config: dict[str, Any]) -> tuple[str, str, Optional[str]]:
    """``(save_dir, name, logger class path)`` of the run's logger; class path ``None`` for fedrcl's default
    logger (``TensorBoardLogger`` under ``trainer.default_root_dir`` or ``runs``, name ``fedrcl``)."""
    trainer = config.get("trainer") or {}
    logger = trainer.get("logger")
    if logger in (None, True):
        return trainer.get("default_root_dir") or "runs", "fedrcl", None
    if not isinstance(logger, dict) or "name" not in (logger.get("init_args") or {}):
        raise ValueError("fedrcl seeds needs trainer.logger to be one logger with a name (e.g. "
                         f"TensorBoardLogger or CSVLogger), got {logger!r}")
    args = logger["init_args"]
    return str(args.get("save_dir") or "."), str(args["name"] or "lightning_logs"), logger["class_path"]


def fit_args_for_seed(fit_args: list[str], config: dict[str, Any], seed: int,
                      vary_split: bool = False, folder: Optional[str] = None) -> list[str]:
    """The ``fedrcl fit`` arguments of seed ``seed``: ``fit_args`` then the seeds and the run name,
    ``<name>/seed<k>``, or ``<name>/<folder>/seed<k>`` (a sweep's setting)."""
    save_dir, name, class_path = run_name(config)
    args = [*fit_args, "--seed_everything", str(seed), "--trainer.seed", str(seed)]
    if vary_split:
        args += ["--data.seed", str(seed)]
    run = f"{name}/seed{seed}" if folder is None else f"{name}/{folder}/seed{seed}"
    if class_path is None:
        logger = {"class_path": DEFAULT_LOGGER, "init_args": {"save_dir": save_dir, "name": run}}
        return [*args, f"--trainer.logger={json.dumps(logger)}"]
    return [*args, "--trainer.logger.init_args.name", run]


@dataclass
class Outcome:
    """How the runs (by key: a seed; a sweep's (setting, seed)) ended: ``failed`` (an error), ``stopped`` (by
    ``signum``, checkpointed: resumable with ``--ckpt_path last``) and ``not_started`` (a stop signal came
    first); the others finished."""

    failed: list[Any] = field(default_factory=list)
    stopped: list[Any] = field(default_factory=list)
    not_started: list[Any] = field(default_factory=list)
    signum: Optional[int] = None
    where: str = ""  # the round and checkpoint a seed in this process stopped at


PROGRESS_SECONDS = 60.0  # --parallel: a line on the running seeds this often
ROUND_LINE = re.compile(r"^Round (\d+)/(\d+)\s.*?(?:left|run about) ([^)]+)\)\s*$", re.M)


def seconds_of(text: str) -> Optional[float]:
    """``1:02:05`` -> 3725, ``1:15`` -> 75, ``5.8 days`` -> 501120 (as ``fedrcl.federated.progress`` writes
    them); ``?`` -> None."""
    text = text.strip()
    if text.endswith(" days"):
        return float(text.removesuffix(" days")) * 86400
    if not re.fullmatch(r"\d+(:\d\d){1,2}", text):
        return None
    seconds = 0.0
    for part in text.split(":"):
        seconds = seconds * 60 + int(part)
    return seconds


def seeds_left(running_left: list[float], waiting: int, seed_seconds: float, parallel: int) -> float:
    """The time until the last seed ends: each of ``waiting`` seeds takes ``seed_seconds`` and starts when one
    of the ``parallel`` slots (the running seeds, ``running_left`` seconds from their end) frees up."""
    slots = sorted([*running_left, *[0.0] * (parallel - len(running_left))])
    for _ in range(waiting):
        slots[0] += seed_seconds
        slots.sort()
    return max(slots, default=0.0)


def progress_line(logs: dict[int, Path], waiting: list[int], parallel: int, elapsed: dict[int, float]) -> str:
    """``fedrcl seeds: seed 0 round 12/60 (left 0:40), seed 1 round 11/60 (left 0:42); waiting: [2]; all seeds
    about 1:30 more``, from each running seed's last round line (``elapsed``: how long it has run)."""
    from fedrcl.federated.progress import days_or_duration

    parts, lefts, totals = [], [], []
    for seed, log in logs.items():
        try:
            with open(log, "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - 16384))
                tail = f.read().decode("utf-8", "replace")
        except OSError:
            tail = ""
        found = list(ROUND_LINE.finditer(tail))
        if not found:
            parts.append(f"seed {seed} starting")
            continue
        done, rounds, left_text = found[-1].groups()
        parts.append(f"seed {seed} round {done}/{rounds} (left {left_text.strip()})")
        left = seconds_of(left_text)
        if left is not None:
            lefts.append(left)
            totals.append(elapsed[seed] + left)
    line = f"fedrcl seeds: {', '.join(parts)}" + (f"; waiting: {waiting}" if waiting else "")
    if lefts and len(lefts) == len(logs):  # every running seed has an estimate: the one of all seeds
        left = seeds_left(lefts, len(waiting), sum(totals) / len(totals), parallel)
        line += f"; all seeds about {days_or_duration(left)} more"
    return line


def _run_in_process(runs: Mapping[Any, list[str]], stop: StopSignal, labels: Optional[Mapping[Any, str]] = None,
                    prog: str = "fedrcl seeds") -> Outcome:
    """Each run's fit in turn, in this process (``runs``: by key, a seed here; ``labels``: what its lines name
    it, ``seed <key>`` by default); a failed run is reported and cleaned up as ``fedrcl fit`` would (a fedrcl
    error in one line, anything else with its traceback) and the others still run. A stop signal ends the run
    in progress after its round (checkpointed) and starts no other."""
    from fedrcl.cli import report_user_error
    from fedrcl.federated.preemption import Preempted, stop_signal
    from fedrcl.lightning_cli import FedRCLCLI, build_cli, remove_failed_start

    outcome, seeds = Outcome(), list(runs)
    labels = labels or {seed: f"seed {seed}" for seed in seeds}
    for i, seed in enumerate(seeds):
        if stop.signum is not None:
            outcome.not_started, outcome.signum = seeds[i:], stop.signum
            break
        print(f"{prog}: {labels[seed]}: fedrcl fit {' '.join(runs[seed])}", flush=True)
        cli = FedRCLCLI.__new__(FedRCLCLI)
        try:
            build_cli(["fit", *runs[seed]], cli)
            stop.signum = stop.signum or stop_signal(getattr(cli, "trainer", None))  # came in its last round
        except Preempted as preempted:
            outcome.stopped, outcome.not_started = [seed], seeds[i + 1:]
            assert isinstance(preempted.code, int)  # 128 + the signal
            outcome.signum = preempted.code - 128
            outcome.where = f" ({labels[seed]} after round {preempted.round}/{preempted.rounds}, checkpoint " \
                            f"{preempted.checkpoint})"
            break
        except SystemExit as exit_:
            if exit_.code not in (0, None):
                outcome.failed.append(seed)
        except Exception as error:  # noqa: BLE001 (a bad seed must not stop the others)
            remove_failed_start(cli)
            if not report_user_error(error, prog=f"{prog}: {labels[seed]}", argv=runs[seed]):
                traceback.print_exc()
            outcome.failed.append(seed)
    return outcome


def _run_processes(runs: dict[int, list[str]], parallel: int, log_dir: Path, stop: StopSignal) -> Outcome:
    """Up to ``parallel`` ``fedrcl fit`` processes at a time. A stop signal is passed on to the running fits,
    which stop after their round (exit status 128 + signal), and no other seed starts."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // parallel)))
    log_dir.mkdir(parents=True, exist_ok=True)
    pending, outcome = list(runs.items()), Outcome()
    running: dict[int, tuple[subprocess.Popen[bytes], io.TextIOWrapper]] = {}
    started: dict[int, float] = {}
    passed_on: Optional[int] = None  # the stop signal passed on to the running fits
    reported = time.monotonic()
    while pending or running:
        if stop.signum is not None and passed_on is None:
            outcome.signum, outcome.not_started, pending = stop.signum, [s for s, _ in pending], []
            passed_on = stop.signum
            for proc, _ in running.values():
                if stop.signum != signal.SIGINT:  # Ctrl-C reached them from the terminal already
                    proc.send_signal(stop.signum)
        while pending and len(running) < parallel:
            seed, args = pending.pop(0)
            log = open(log_dir / f"seed{seed}.log", "a", encoding="utf-8")
            print(f"fedrcl seeds: seed {seed} started (log: {log.name})", flush=True)
            proc = subprocess.Popen([sys.executable, "-m", "fedrcl.cli", "fit", *args], stdout=log,
                                    stderr=subprocess.STDOUT, env=env)
            running[seed], started[seed] = (proc, log), time.monotonic()
        if running and time.monotonic() - reported >= PROGRESS_SECONDS:
            reported = time.monotonic()
            logs = {seed: Path(log.name) for seed, (_, log) in running.items()}
            print(progress_line(logs, [s for s, _ in pending], parallel,
                                {seed: reported - started[seed] for seed in running}), flush=True)
        for seed, (proc, log) in list(running.items()):
            if proc.poll() is not None:
                log.close()
                del running[seed]
                print(f"fedrcl seeds: seed {seed} finished with exit status {proc.returncode}", flush=True)
                if passed_on is not None and proc.returncode == 128 + passed_on:
                    outcome.stopped.append(seed)
                elif proc.returncode != 0:
                    outcome.failed.append(seed)
        time.sleep(0.5)
    outcome.failed, outcome.stopped = ([s for s in runs if s in done] for done in (outcome.failed, outcome.stopped))
    return outcome  # in the order the seeds were given, not the order they ended


def _run_together(runs: Mapping[Any, list[str]], stop: StopSignal, labels: Optional[Mapping[Any, str]] = None,
                  prog: str = "fedrcl seeds") -> Outcome:
    """The runs (by key, with ``labels`` as in ``_run_in_process``) trained together in this process
    (``fedrcl.federated.together``); when they cannot be, said in one line, one after another
    (``_run_in_process``). An error stops every run (a fedrcl error in one line)."""
    from fedrcl.cli import report_user_error
    from fedrcl.federated.together import NotTogether, StoppedTogether, train_together

    what = "seed" if labels is None else "run"
    try:
        cohort = train_together(runs, stop, labels, prog)
    except NotTogether as reason:
        print(f"{prog}: --together: {reason}; the {what}s train one after another instead", flush=True)
        return _run_in_process(runs, stop, labels, prog)
    except StoppedTogether as stopped:
        left = [r.key for r in stopped.cohort.seeds if r.next_round < r.trainer.max_epochs]
        return Outcome(stopped=left, signum=stopped.signum, where=stopped.cohort.stopped_where())
    except Exception as error:  # noqa: BLE001 (said as fedrcl fit says it)
        if not report_user_error(error, prog=f"{prog} --together", argv=next(iter(runs.values()))):
            traceback.print_exc()
        return Outcome(failed=list(runs))
    return Outcome(failed=[run.key for run in cohort.seeds if run.failed])


def resume_command(seeds_args: list[str], fit_args: list[str], outcome: Outcome) -> str:
    """The command line(s) that finish what a stop signal interrupted: the stopped seeds with ``--ckpt_path
    last``, then the seeds not started as they were asked for."""
    from fedrcl.cli import split_ckpt_path

    commands = []
    for seeds, extra in ((outcome.stopped, [*split_ckpt_path(fit_args)[0], "--ckpt_path", "last"]),
                         (outcome.not_started, fit_args)):
        if seeds:
            commands.append(shlex.join(["fedrcl", "seeds", "--seeds", *map(str, seeds), *seeds_args, *extra]))
    return " && ".join(commands)


def main(argv: Optional[list[str]] = None) -> None:
    """``fedrcl seeds --seeds K [K ...] [--parallel N | --together] [--vary_split] FIT_ARGS...``."""
    parser = argparse.ArgumentParser(
        prog="fedrcl seeds",
        usage="fedrcl seeds --seeds K [K ...] [--parallel N | --together] [--vary_split] FIT_ARGS...",
        description="One `fedrcl fit` per seed, each in its own run folder <name>/seed<k>; with --together, the "
                    "seeds' federations in one program, their clients in one batched step.",
        epilog="Any other argument goes to every `fedrcl fit` (see `fedrcl fit --help`).")
    parser.add_argument("--seeds", type=int, nargs="+", required=True, help="the seeds, e.g. 0 1 2")
    parser.add_argument("--parallel", type=int, default=1,
                        help="fits at a time: 1 runs them one after another in this process (default); N > 1 "
                             "runs up to N processes")
    parser.add_argument("--together", action="store_true",
                        help="train the seeds' federations together in this process, every seed's clients in one "
                             "batched local step (compiled with --trainer.compile_clients true); each seed's run "
                             "and files are its fit's. A method that cannot be batched trains the seeds one after "
                             "another, with a notice")
    parser.add_argument("--vary_split", action="store_true",
                        help="also set data.seed (the client split) to each seed; fixed otherwise")
    args, fit_args = parser.parse_known_args(argv)
    # LightningCLI warns when given args while sys.argv holds others: here that is the point.
    warnings.filterwarnings("ignore", message=".*LightningCLI's args parameter.*")
    outside = [seed for seed in args.seeds if not 0 <= seed < SEED_LIMIT]
    if outside:
        parser.error(f"--seeds {outside[0]}: a seed must be 0 <= seed < 2**32 (numpy's and torch's "
                     "generators take no other)")
    if len(set(args.seeds)) != len(args.seeds):
        parser.error(f"--seeds has repeated seeds: {args.seeds}")
    if args.parallel < 1:
        parser.error(f"--parallel must be >= 1, got {args.parallel}")
    if args.together and args.parallel != 1:
        parser.error("--together trains the seeds in one process: drop --parallel")
    if "--print_config" in fit_args or any(a.startswith("--print_config=") for a in fit_args):
        parser.error("--print_config: use `fedrcl fit ... --print_config` for one run")
    config = resolved_config(fit_args)
    try:
        save_dir, name, _ = run_name(config)
    except ValueError as err:
        parser.error(str(err))
    runs = {seed: fit_args_for_seed(fit_args, config, seed, args.vary_split) for seed in args.seeds}
    where = Path(save_dir) / name
    from fedrcl.federated.preemption import StopSignal

    with StopSignal() as stop:
        if args.together:
            outcome = _run_together(runs, stop)
        elif args.parallel == 1:
            outcome = _run_in_process(runs, stop)
        else:
            outcome = _run_processes(runs, args.parallel, where, stop)
    if outcome.failed:
        print(f"fedrcl seeds: seeds {outcome.failed} failed; the others are in {where}/seed<k>", file=sys.stderr)
    if outcome.signum is not None:
        own = [*(["--parallel", str(args.parallel)] if args.parallel != 1 else []),
               *(["--together"] if args.together else []), *(["--vary_split"] if args.vary_split else [])]
        resume = resume_command(own, fit_args, outcome) or "nothing left to run"
        print(f"fedrcl seeds: stopped by {signal.Signals(outcome.signum).name}{outcome.where}; stopped after a "
              f"round: {outcome.stopped or 'none'}, not started: {outcome.not_started or 'none'}; resume: {resume}",
              file=sys.stderr, flush=True)
        raise SystemExit(128 + outcome.signum)
    if outcome.failed:
        raise SystemExit(1)
    print(f"fedrcl seeds: {len(runs)} runs in {where}/seed<k>; summary: fedrcl report {where}", flush=True)
