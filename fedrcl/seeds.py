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
The exit status is 1 when any seed failed (the others still run).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Optional

import yaml

__all__ = ["fit_args_for_seed", "main", "resolved_config", "run_name"]

DEFAULT_LOGGER = "lightning.pytorch.loggers.TensorBoardLogger"


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
                      vary_split: bool = False) -> list[str]:
    """The ``fedrcl fit`` arguments of seed ``seed``: ``fit_args`` then the seeds and the run name."""
    save_dir, name, class_path = run_name(config)
    args = [*fit_args, "--seed_everything", str(seed), "--trainer.seed", str(seed)]
    if vary_split:
        args += ["--data.seed", str(seed)]
    if class_path is None:
        logger = {"class_path": DEFAULT_LOGGER,
                  "init_args": {"save_dir": save_dir, "name": f"{name}/seed{seed}"}}
        return [*args, f"--trainer.logger={json.dumps(logger)}"]
    return [*args, "--trainer.logger.init_args.name", f"{name}/seed{seed}"]


def _run_in_process(runs: dict[int, list[str]]) -> list[int]:
    """Each seed's fit in turn, in this process; a failed seed is reported and cleaned up as ``fedrcl fit``
    would (a fedrcl error in one line, anything else with its traceback) and the others still run."""
    from fedrcl.cli import report_user_error
    from fedrcl.lightning_cli import FedRCLCLI, build_cli, remove_failed_start

    failed = []
    for seed, args in runs.items():
        print(f"fedrcl seeds: seed {seed}: fedrcl fit {' '.join(args)}", flush=True)
        cli = FedRCLCLI.__new__(FedRCLCLI)
        try:
            build_cli(["fit", *args], cli)
        except SystemExit as stop:
            if stop.code not in (0, None):
                failed.append(seed)
        except Exception as error:  # noqa: BLE001 (a bad seed must not stop the others)
            remove_failed_start(cli)
            if not report_user_error(error, prog=f"fedrcl seeds: seed {seed}"):
                traceback.print_exc()
            failed.append(seed)
    return failed


def _run_processes(runs: dict[int, list[str]], parallel: int, log_dir: Path) -> list[int]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // parallel)))
    log_dir.mkdir(parents=True, exist_ok=True)
    pending, running, failed = list(runs.items()), {}, []
    while pending or running:
        while pending and len(running) < parallel:
            seed, args = pending.pop(0)
            log = open(log_dir / f"seed{seed}.log", "a", encoding="utf-8")
            print(f"fedrcl seeds: seed {seed} started (log: {log.name})", flush=True)
            proc = subprocess.Popen([sys.executable, "-m", "fedrcl.cli", "fit", *args], stdout=log,
                                    stderr=subprocess.STDOUT, env=env)
            running[seed] = proc, log
        for seed, (proc, log) in list(running.items()):
            if proc.poll() is not None:
                log.close()
                del running[seed]
                print(f"fedrcl seeds: seed {seed} finished with exit status {proc.returncode}", flush=True)
                if proc.returncode != 0:
                    failed.append(seed)
        time.sleep(0.5)
    return failed


def main(argv: Optional[list[str]] = None) -> None:
    """``fedrcl seeds --seeds K [K ...] [--parallel N] [--vary_split] FIT_ARGS...``."""
    parser = argparse.ArgumentParser(
        prog="fedrcl seeds", usage="fedrcl seeds --seeds K [K ...] [--parallel N] [--vary_split] FIT_ARGS...",
        description="One `fedrcl fit` per seed, each in its own run folder <name>/seed<k>.",
        epilog="Any other argument goes to every `fedrcl fit` (see `fedrcl fit --help`).")
    parser.add_argument("--seeds", type=int, nargs="+", required=True, help="the seeds, e.g. 0 1 2")
    parser.add_argument("--parallel", type=int, default=1,
                        help="fits at a time: 1 runs them one after another in this process (default); N > 1 "
                             "runs up to N processes")
    parser.add_argument("--vary_split", action="store_true",
                        help="also set data.seed (the client split) to each seed; fixed otherwise")
    args, fit_args = parser.parse_known_args(argv)
    # LightningCLI warns when given args while sys.argv holds others: here that is the point.
    warnings.filterwarnings("ignore", message=".*LightningCLI's args parameter.*")
    if len(set(args.seeds)) != len(args.seeds):
        parser.error(f"--seeds has repeated seeds: {args.seeds}")
    if args.parallel < 1:
        parser.error(f"--parallel must be >= 1, got {args.parallel}")
    if "--print_config" in fit_args or any(a.startswith("--print_config=") for a in fit_args):
        parser.error("--print_config: use `fedrcl fit ... --print_config` for one run")
    config = resolved_config(fit_args)
    try:
        save_dir, name, _ = run_name(config)
    except ValueError as err:
        parser.error(str(err))
    runs = {seed: fit_args_for_seed(fit_args, config, seed, args.vary_split) for seed in args.seeds}
    if args.parallel == 1:
        failed = _run_in_process(runs)
    else:
        failed = _run_processes(runs, args.parallel, Path(save_dir) / name)
    where = Path(save_dir) / name
    if failed:
        print(f"fedrcl seeds: seeds {failed} failed; the others are in {where}/seed<k>", file=sys.stderr)
        raise SystemExit(1)
    print(f"fedrcl seeds: {len(runs)} runs in {where}/seed<k>; summary: fedrcl report {where}", flush=True)
