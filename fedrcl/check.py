"""``fedrcl check``: does a method give the same numbers on every backend? A method author's check.

    fedrcl check --config configs/quickstart.yaml --model my_method.MyMethod
    fedrcl check --config configs/quickstart.yaml --model my_method.MyMethod --backends sequential batched

Runs the same ``fedrcl fit`` (every argument that is not this command's own is passed on) for ``--rounds``
rounds on each backend: ``sequential`` (clients one after another, the reference), ``batched``
(``trainer.client_batching on``), ``together`` (the run's seed trained together with the next seed in one
program, ``fedrcl seeds --together``; compared on the run's seed), ``processes`` (two CPU processes,
``trainer.strategy ddp``) and ``flower`` (Flower's simulation, ``python -m fedrcl.flower``; only where Flower
is installed), each as a process of its
own with its run folder in a scratch folder (removed after), on the CPU (where every backend is
deterministic) and in float64 (``--trainer.precision 64-true``), so that what batched clients or processes
sum in another order stays far below the tolerance; both override the config's. Then prints one table row
per backend: its seconds, the largest relative difference of its final global weights to the sequential
run's (per tensor ``max|a - b| / max|a|``) and the verdict: ``agrees`` (bitwise, or within ``TOLERANCE``:
float64 sums in another order, in batched kernels or an all-reduce, differ near 1e-16, a method that breaks
the contract by 1e-4 and more), ``fell back`` (agrees, but the backend did not run what it names: batched
clients or seeds trained one after another, said in its notice), ``differs``, ``timed out after N s`` (``--timeout``), or ``refused`` /
``failed`` with the run's own error line. Exit
status 1 when any backend does not agree.

Where a method differs, the contract it breaks is in the tutorial (docs/tutorial.md, "The contract"): what a
client receives is fixed when the round starts, a loss keeps no state, a client never sees another client.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

BACKENDS = ("sequential", "batched", "together", "processes", "flower")
OURS = re.compile(r"fedrcl( \w+)?: error: ")  # fedrcl's own error line (``fedrcl fit: error: ...``)
TOLERANCE = 1e-9  # float64: sums in another order (batched kernels, all-reduce) stay near 1e-16
# What each backend adds to the fit arguments, and the module it runs.
BACKEND_ARGS: dict[str, tuple[str, tuple[str, ...]]] = {
    "sequential": ("fedrcl.cli", ("fit", "--trainer.client_batching", "off")),
    "batched": ("fedrcl.cli", ("fit", "--trainer.client_batching", "on")),
    "together": ("fedrcl.cli", ("seeds", "--together")),  # and --seeds: the run's seed and the next
    "processes": ("fedrcl.cli", ("fit", "--trainer.client_batching", "off", "--trainer.devices", "2",
                                 "--trainer.strategy", "ddp")),
    "flower": ("fedrcl.flower", ("--trainer.client_batching", "off")),
}
# Set after the user's arguments, on every backend: the CPU, where every backend is deterministic (CUDA's
# convolution backward is not), and float64.
COMMON_ARGS = ("--trainer.accelerator", "cpu", "--trainer.precision", "64-true", "--trainer.enable_progress_bar",
               "false")


def max_relative_difference(reference: Mapping[str, Any], other: Mapping[str, Any]) -> float:
    """Of two state dicts (name -> tensor): the largest, over tensors, of ``max|a - b| / max|a|``
    (``max|a - b|`` where ``a`` is all zeros); ``inf`` when the two hold other names or shapes, or the other
    non-finite values where the reference has none."""
    import torch

    if reference.keys() != other.keys() or any(reference[k].shape != other[k].shape for k in reference):
        return float("inf")
    worst = 0.0
    for name, a in reference.items():
        a, b = a.double(), other[name].double()
        if not bool(torch.isfinite(b).all()) and bool(torch.isfinite(a).all()):
            return float("inf")  # non-finite weights never agree
        diff = float((a - b).abs().max()) if a.numel() else 0.0
        scale = float(a.abs().max()) if a.numel() else 0.0
        worst = max(worst, diff / scale if scale > 0 else diff)
    return worst


@dataclass
class BackendRun:
    """One backend's run: its seconds, its final global weights (``None``: it did not finish) and what it said."""

    backend: str
    seconds: float
    weights: Optional[dict[str, Any]]
    output: str
    returncode: int
    timed_out: Optional[float] = None  # the --timeout it ran past (and was stopped at)


def available(backend: str, fit_args: Sequence[str]) -> Optional[str]:
    """Why ``backend`` cannot run here, or ``None``."""
    if backend == "flower" and not all(importlib.util.find_spec(m) for m in ("flwr", "ray")):
        return "Flower's simulation extra is not installed (pip install -e '.[flower]')"
    if backend == "together" and run_seed(fit_args) is None:
        return ("the config's seed_everything and trainer.seed differ, and fedrcl seeds sets both to the seed: "
                "no seed of it is the sequential run")
    return None


@functools.lru_cache(maxsize=4)
def _run_seed(fit_args: tuple[str, ...]) -> Optional[int]:
    from fedrcl.seeds import resolved_config

    config = resolved_config(list(fit_args))
    seed = config.get("seed_everything")
    return seed if isinstance(seed, int) and (config.get("trainer") or {}).get("seed") == seed else None


def run_seed(fit_args: Sequence[str]) -> Optional[int]:
    """The run's seed (``seed_everything``, equal to ``trainer.seed``), which ``fedrcl seeds`` reproduces;
    ``None`` when the two differ."""
    return _run_seed(tuple(fit_args))


def run_backend(backend: str, fit_args: Sequence[str], rounds: int, scratch: Path, timeout: float) -> BackendRun:
    """``fedrcl fit`` (or Flower's simulation) of ``fit_args`` on ``backend``, its run folder under
    ``scratch/<backend>``."""
    from fedrcl.federated.checkpoint import read_checkpoint  # torch: where a run is read, not at the start

    module, extra = BACKEND_ARGS[backend]
    save_dir, folder = scratch / backend, ""
    if backend == "together":  # the run's seed with the next one; compared on the run's seed's folder
        seed = run_seed(fit_args)
        assert seed is not None  # available(): the config's seeds agree
        extra, folder = (*extra, "--seeds", str(seed), str(seed + 1)), f"seed{seed}"
    command = [sys.executable, "-m", module, *extra, *fit_args, "--trainer.rounds", str(rounds), *COMMON_ARGS,
               "--trainer.logger.init_args.save_dir", str(save_dir)]
    # The children import what this process can (the method's own file included), single-threaded by default.
    path = os.pathsep.join([*(p for p in sys.path if p), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1"}
    started, timed_out = time.perf_counter(), None
    # In this folder (the arguments' relative paths hold), in a process group of its own: a second process
    # (DDP) or Ray's workers end with it, whatever happens.
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, code, timed_out = f"did not finish in {timeout:g} s\n{proc.communicate()[0]}", 124, timeout
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    seconds = time.perf_counter() - started
    checkpoints = sorted(p for p in save_dir.rglob("last.ckpt") if not folder or folder in p.parts)
    weights = read_checkpoint(checkpoints[-1])["state_dict"] if code == 0 and checkpoints else None
    return BackendRun(backend, seconds, weights, output, code, timed_out)


def error_line(output: str) -> str:
    """The run's own error line: fedrcl's (``fedrcl: error: ...``), else the last exception named in its output
    (a node's, on Flower), else its last line."""
    lines = [line.strip() for line in output.strip().splitlines() if line.strip()]
    ours = [line for line in lines if OURS.match(line)]
    raised = [line for line in lines if re.match(r"[\w.]*(Error|Exception|Failure)\b", line)]
    return (ours or raised or lines or ["no output"])[-1]


def verdict(run: BackendRun, reference: Optional[BackendRun]) -> tuple[str, str]:
    """``(difference, verdict)`` cells of ``run`` against the sequential ``reference``."""
    if run.timed_out is not None:
        return "", f"timed out after {run.timed_out:g} s (--timeout)"
    if run.weights is None:
        line = error_line(run.output)
        ours = OURS.match(line)
        return "", f"refused: {line[ours.end():]}" if ours else f"failed: {line}"
    if reference is None or run is reference:
        return "reference", "" if reference is run else "no sequential run to compare with"
    if reference.weights is None:
        return "", "no sequential run to compare with"
    difference = max_relative_difference(reference.weights, run.weights)
    rule = "bitwise" if difference == 0 else f"<= {TOLERANCE:g}"
    if difference > TOLERANCE:
        return f"{difference:.2g}", f"differs (allowed: <= {TOLERANCE:g})"
    if run.backend == "batched" and "clients trained one after another" in run.output:
        return f"{difference:.2g}", f"fell back ({rule}): its clients trained one after another (see its notice)"
    if run.backend == "together" and "fedrcl seeds: --together:" in run.output:
        how = "each seed went on alone" if "goes on alone" in run.output else "the seeds trained one after another"
        return f"{difference:.2g}", f"fell back ({rule}): {how} (see its notice)"
    return f"{difference:.2g}", f"agrees ({rule})"


def table(runs: Sequence[BackendRun]) -> tuple[str, bool]:
    """The markdown table of ``runs`` and whether every backend agrees."""
    reference = next((r for r in runs if r.backend == "sequential"), None)
    rows = ["| backend | seconds | max relative difference to sequential | verdict |", "|---|--:|--:|---|"]
    ok = True
    for run in runs:
        difference, word = verdict(run, reference)
        ok &= run.weights is not None and (run is reference or word.startswith(("agrees", "fell back")))
        rows.append(f"| {run.backend} | {run.seconds:.1f} | {difference} | {word} |")
    return "\n".join(rows), ok


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(
        prog="fedrcl check", description=__doc__.split("\n")[0],
        epilog="Every other argument is fedrcl fit's (--config, --model, --data.*, ...).")
    parser.add_argument("--rounds", type=int, default=3, help="rounds run on each backend (default 3)")
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS),
                        help="backends to run (default: all that are installed); sequential is the reference")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds each backend's run may take")
    known, fit_args = parser.parse_known_args(argv)
    if known.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {known.rounds}")
    backends = [b for b in BACKENDS if b in known.backends]
    runs = []
    with tempfile.TemporaryDirectory(prefix="fedrcl-check-") as scratch:
        for backend in backends:
            missing = available(backend, fit_args)
            if missing is not None:
                print(f"fedrcl check: {backend} skipped: {missing}", file=sys.stderr)
                continue
            print(f"fedrcl check: {backend} ...", file=sys.stderr, flush=True)
            runs.append(run_backend(backend, fit_args, known.rounds, Path(scratch), known.timeout))
    text, ok = table(runs)
    print(text)
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
