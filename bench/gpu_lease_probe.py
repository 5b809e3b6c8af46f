"""The lease's probe: which execution mode trains the seeds together correctly, and how one seed compares with
three seeds together on this GPU.

    python3 bench/gpu_lease_probe.py --result probe.json --profile probe_profile.txt   (run by gpu_lease_run.py)

In one process, with the lease's own settings (``gpu_lease_run.fit_args``, bf16-mixed):

1. **Correct.** One tiny FedRCL round (1 local epoch of 2 steps) of seeds 0, 1, 2, each alone with clients one
   after another: the references; seed 0's round in float32 gives the tolerance (twice what bf16 changes in its
   update, at least ``TOLERANCE_FLOOR``, at most ``TOLERANCE_CAP``). Then the same round of the three seeds
   together (``fedrcl.federated.together.Cohort``), batched, then batched + compiled: each seed's update of the
   global weights must equal its reference's (relative norm of the difference) within the tolerance; a client
   on a wrong batch, weight slice or seed changes it by about 1.
2. **Decide.** The first mode that passed (batched + compiled, then batched) must also train one paper round of
   FedRCL's three seeds together; the first that does is the lease's ``mode`` (written at once: a probe cut
   short by its limit after this still decides). None: ``sequential`` (the lease trains seed 0 alone).
3. **Measure** in that mode, FedRCL's three seeds, FedAvg's three, then each method's seed 0 alone (each on
   its own on the GPU): the first paper round (its compilation) and ``ROUNDS`` timed rounds (seconds per round
   with the evaluation of every seed; ``gpu_busy_nvml``: the GPU's busy fraction sampled by NVML meanwhile);
   for FedRCL one more round under ``torch.profiler``: ``gpu_busy``, the union of the GPU's kernel and copy
   intervals over that round's wall time, and the top kernels by GPU time, appended to ``--profile`` (on the
   CPU rehearsal: the top CPU operators, and no busy fraction).

A mode that raises, differs from its reference or is not finite is dropped with the reason and never costs the
lease. ``probe.json`` is rewritten after each step. ``GPU_LEASE_BREAK`` (``MODE=error`` or ``MODE=unequal``,
comma-separated) breaks a mode on purpose: the rehearsal's failing branch.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
import warnings
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gpu_lease_fit import save_cache  # noqa: E402
from gpu_lease_run import SEEDS, Lease, fit_args, write_json  # noqa: E402

from fedrcl.federated import batched  # noqa: E402
from fedrcl.federated.together import Cohort  # noqa: E402
from fedrcl.lightning_cli import build_cli  # noqa: E402

# Equal means: the relative difference of the two updates is at most twice what bf16 itself changes in the
# sequential update (against float32), kept within these bounds.
TOLERANCE_FLOOR, TOLERANCE_CAP = 0.1, 0.5
ROUNDS = 2  # timed paper rounds per measurement, after the first (compilation) and before the profiled one
TOP_KERNELS = 15
TINY = ["--trainer.rounds", "1", "--trainer.local_epochs", "1", "--data.local_iters_per_epoch", "2"]
QUIET = ["--trainer.logger", "false", "--trainer.enable_checkpointing", "false",
         "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]


class NoStop:
    """The cohort's stop record: no signal."""

    signum = None


def seed_args(method: str, mode: str, lease: Lease, seed: int, extra: list[str]) -> list[str]:
    """Seed ``seed``'s ``fedrcl fit`` arguments as ``fedrcl seeds`` makes them, without logger or checkpoints."""
    return [*fit_args(method, mode, lease), "--seed_everything", str(seed), "--trainer.seed", str(seed),
            *QUIET, *extra]


def broken(mode: str) -> str | None:
    pairs = (item.split("=", 1) for item in os.environ.get("GPU_LEASE_BREAK", "").split(",") if "=" in item)
    return dict(pairs).get(mode)


def weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().cpu().clone() for k, v in module.backbone.state_dict().items()}


def update(module: torch.nn.Module, start: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([(v - start[k]).flatten() for k, v in weights(module).items()])


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def reference(seed: int, lease: Lease, *extra: str) -> tuple[dict, torch.Tensor]:
    """Seed ``seed``'s tiny FedRCL round alone, clients one after another: its start weights and update."""
    cli = build_cli(seed_args("FedRCL", "sequential", lease, seed, [*TINY, *extra]), run=False)
    start = weights(cli.model)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    return start, update(cli.model, start)


def tiny_together(mode: str, lease: Lease, references: dict[int, tuple[dict, torch.Tensor]]) -> dict[int, float]:
    """The tiny round of every seed together in ``mode``: each seed's relative difference from its reference."""
    if broken(mode) == "error":
        raise RuntimeError(f"forced by GPU_LEASE_BREAK ({mode}=error)")
    cohort = Cohort({k: seed_args("FedRCL", mode, lease, k, TINY) for k in SEEDS}, NoStop())
    starts = {run.seed: weights(run.module) for run in cohort.seeds}
    for k, start in starts.items():
        if not all(torch.equal(start[name], v) for name, v in references[k][0].items()):
            raise AssertionError(f"seed {k} starts from other weights together than alone (seed)")
    cohort.fit()
    found = {}
    for run in cohort.seeds:
        mine = update(run.module, starts[run.seed])
        if broken(mode) == "unequal":
            mine = 2 * mine
        found[run.seed] = relative(mine, references[run.seed][1]) if torch.isfinite(mine).all() else float("inf")
    return found


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Busy(threading.Thread):
    """The GPU's busy fraction (NVML's utilization), sampled every 0.1 s while running."""

    def __init__(self):
        super().__init__(daemon=True)
        self.samples: list[float] = []
        self.running = True

    def run(self) -> None:
        while self.running:
            try:
                self.samples.append(torch.cuda.utilization() / 100)
            except Exception:  # noqa: BLE001 (no GPU, no NVML: no samples)
                return
            time.sleep(0.1)

    def fraction(self) -> float | None:
        return round(statistics.mean(self.samples), 3) if self.samples else None


def more_rounds(cohort: Cohort, rounds: int) -> float:
    """Train every seed of ``cohort`` ``rounds`` more rounds; the wall seconds, the GPU's work included."""
    for run in cohort.seeds:
        run.trainer.fit_loop.max_epochs = run.next_round + rounds
    sync()
    started = time.perf_counter()
    cohort.fit()
    sync()
    return time.perf_counter() - started


def profile_summary(prof: torch.profiler.profile, wall: float) -> tuple[float | None, list[str]]:
    """The GPU's busy fraction of a profiled stretch of ``wall`` seconds (the union of its kernel and copy
    intervals) and the top kernels by GPU time; without GPU events (the CPU rehearsal) no fraction and the top
    CPU operators by inclusive time. Read from kineto's raw events (building the profiler's event tree took
    seconds per round even at toy scale)."""
    events = prof.profiler.kineto_results.events()
    device = [e for e in events if e.device_type() == torch.autograd.DeviceType.CUDA]
    unit = "GPU" if device else "CPU (incl.)"
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in device or [e for e in events if e.device_type() == torch.autograd.DeviceType.CPU]:
        totals[e.name()][0] += 1
        totals[e.name()][1] += e.duration_ns() / 1e6
    fraction = None
    if device:
        busy, end = 0, 0
        for first, last in sorted((e.start_ns(), e.start_ns() + e.duration_ns()) for e in device):
            busy += max(0, last - max(first, end))
            end = max(end, last)
        fraction = round(busy / 1e9 / wall, 3)
    overall = sum(ms for _, ms in totals.values()) or 1.0
    lines = [f"{'calls':>7} {unit + ' ms':>12} {'share':>6}  name"]
    for name, (calls, ms) in sorted(totals.items(), key=lambda item: -item[1][1])[:TOP_KERNELS]:
        lines.append(f"{calls:7d} {ms:12.2f} {ms / overall:6.1%}  {name[:150]}")
    return fraction, lines


def measure(method: str, seeds: int, mode: str, lease: Lease, profile: Path | None) -> dict:
    """One paper round (compilation) and ``ROUNDS`` timed of ``method``'s first ``seeds`` seeds together in
    ``mode``, alone on the GPU; then, with a ``profile`` file, one profiled round."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    cohort = Cohort({k: seed_args(method, mode, lease, k, ["--trainer.rounds", "1"]) for k in SEEDS[:seeds]},
                    NoStop())
    result = {"first_round_seconds": round(more_rounds(cohort, 1), 2)}
    busy = Busy()
    if torch.cuda.is_available():
        busy.start()
    result["seconds_per_round"] = round(more_rounds(cohort, ROUNDS) / ROUNDS, 4)
    busy.running = False
    result["gpu_busy_nvml"] = busy.fraction()
    if torch.cuda.is_available():
        result["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    if profile is None:
        return result
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        wall = more_rounds(cohort, 1)
    result["gpu_busy"], lines = profile_summary(prof, wall)
    result["profiled_round_seconds"] = round(wall, 3)
    with open(profile, "a") as f:
        f.write(f"== {method}, {seeds} seed(s) together, {mode}: one profiled round of {wall:.3f} s "
                f"(timed rounds {result['seconds_per_round']:.3f} s), GPU busy {result['gpu_busy']} "
                f"(profiler), {result['gpu_busy_nvml']} (NVML)\n" + "\n".join(lines) + "\n\n")
    return result


def error_text(error: BaseException) -> str:
    first = (str(error).strip().splitlines() or [""])[0][:300]
    return f"error: {type(error).__name__}: {first}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--result", type=Path, required=True)
    parser.add_argument("--profile", type=Path, required=True, help="the top-kernel summary, appended to")
    args = parser.parse_args()
    lease = Lease()
    warnings.filterwarnings("ignore", message=".*LightningCLI's args parameter.*")  # args given on purpose
    torch.set_float32_matmul_precision("high")
    if not torch.cuda.is_available():  # the rehearsal: a compiler-free backend, as the CPU tests use
        batched.COMPILE_BACKEND = "aot_eager"
    args.profile.unlink(missing_ok=True)
    report: dict = {"modes": {"batched+compiled": {}, "batched": {}}, "seeds_together": {}}
    write_json(args.result, report)
    references = {k: reference(k, lease) for k in SEEDS}
    float32 = reference(0, lease, "--trainer.precision", "32-true")[1]
    report["bf16_against_float32"] = round(relative(references[0][1], float32), 5)
    report["tolerance"] = round(min(TOLERANCE_CAP, max(TOLERANCE_FLOOR, 2 * report["bf16_against_float32"])), 5)
    for mode in ("batched", "batched+compiled"):
        entry, started = report["modes"][mode], time.perf_counter()
        try:
            differences = tiny_together(mode, lease, references)
            entry["relative_difference"] = {str(k): round(v, 5) for k, v in differences.items()}
            worst = max(differences.values())
            if not worst <= report["tolerance"]:
                entry["dropped"] = (f"differs from sequential: relative difference of a seed's update "
                                    f"{worst:.3g} > {report['tolerance']}")
        except Exception as error:  # noqa: BLE001 (any failure of a mode drops that mode only)
            entry["dropped"] = error_text(error)
        entry["probe_seconds"] = round(time.perf_counter() - started, 1)
        print(f"probe: {mode}: {entry}", flush=True)
        write_json(args.result, report)
    table = report["seeds_together"]
    for mode in ("batched+compiled", "batched"):  # the first that passed and trains a paper round
        if "dropped" in report["modes"][mode]:
            continue
        try:
            table.setdefault("FedRCL", {})[str(len(SEEDS))] = measure("FedRCL", len(SEEDS), mode, lease, args.profile)
        except Exception as error:  # noqa: BLE001
            report["modes"][mode]["dropped"] = f"paper round: {error_text(error)}"
            write_json(args.result, report)
            continue
        report["mode"] = mode
        break
    report.setdefault("mode", "sequential")
    for mode in report["modes"]:
        if mode != report["mode"]:
            report["modes"][mode].setdefault("dropped", f"not needed: {report['mode']} passed first")
    write_json(args.result, report)
    print(f"probe: mode {report['mode']}", flush=True)
    if report["mode"] != "sequential":
        for method, seeds in (("FedAvg", len(SEEDS)), ("FedRCL", 1), ("FedAvg", 1)):
            row = table.setdefault(method, {})
            try:
                row[str(seeds)] = measure(method, seeds, report["mode"], lease,
                                          args.profile if method == "FedRCL" else None)
            except Exception as error:  # noqa: BLE001 (the lease trains on; the table says why)
                row[str(seeds)] = {"error": error_text(error)}
            for rows in table.values():
                one, many = rows.get("1", {}), rows.get(str(len(SEEDS)), {})
                if "seconds_per_round" in one and "seconds_per_round" in many:
                    rows["ratio"] = round(many["seconds_per_round"] / one["seconds_per_round"], 3)
            print(f"probe: {method}, {seeds} seed(s): {row[str(seeds)]}", flush=True)
            write_json(args.result, report)
    save_cache(lease.work / "compile_cache" / "probe.bin")


if __name__ == "__main__":
    main()
