"""The lease's probe: which execution mode trains the paper's round fastest on this GPU, and correctly.

    python3 bench/gpu_lease_probe.py --result probe.json        (bench/gpu_lease_run.py runs it, with a time limit)

In one process, with the lease's own ``fedrcl fit`` settings (``gpu_lease_run.fit_args``, FedRCL, bf16-mixed):

1. one tiny round (1 local epoch of 2 steps) clients one after another: the reference;
2. the same round batched (``trainer.client_batching on``): its update of the global weights must equal the
   reference's (relative norm of the difference of the two updates) within twice what bf16 changes in the
   reference's update (the same round in float32), at least ``TOLERANCE_FLOOR``, at most ``TOLERANCE_CAP``;
3. ``ROUNDS`` timed paper rounds of each mode that passed, at most ``--cap`` seconds each (the median after
   the first, which holds the compilation);
4. the same for batched + compiled (``compile_clients``) last, since its compilation may take long: a probe cut
   short by its limit still leaves the other modes measured.

A mode that raises, differs from the reference or is not finite is dropped with the reason, and never costs the
lease: the lease trains in the fastest mode left (sequential at worst). ``probe.json`` is rewritten after each
step: per mode its relative difference, seconds per round, compile seconds, GPU busy fraction, or why it was
dropped; at the end the chosen ``mode`` and ``room_for_third`` (one run of that mode keeps the GPU busy at most
``ROOM_BUSY`` of the time, so a third run side by side costs the other two little). ``GPU_LEASE_BREAK``
(``MODE=error`` or ``MODE=unequal``, comma-separated) breaks a mode on purpose: the rehearsal's failing branch.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gpu_lease_fit import save_cache  # noqa: E402
from gpu_round import RoundTimer  # noqa: E402
from gpu_lease_run import MODES, Lease, fit_args, write_json  # noqa: E402

from fedrcl.algorithms import FedAvg  # noqa: E402
from fedrcl.cli import FedRCLCLI, FedRCLParser  # noqa: E402
from fedrcl.data.datamodule import FederatedDataModule  # noqa: E402
from fedrcl.federated import batched  # noqa: E402
from fedrcl.federated.trainer import FederatedTrainer  # noqa: E402

# Equal means: the relative difference of the two updates is at most twice what bf16 itself changes in the
# sequential update (against float32), kept within these bounds; a client on a wrong batch or weight slice
# changes it by about 1.
TOLERANCE_FLOOR, TOLERANCE_CAP = 0.1, 0.5
ROUNDS = 3  # timed paper rounds per mode, the first one not counted
ROOM_BUSY = 0.4
QUIET = ["--trainer.logger", "false", "--trainer.enable_checkpointing", "false",
         "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]


def build(mode: str, lease: Lease, extra: list[str]) -> FedRCLCLI:
    """The model, data and trainer ``fedrcl fit`` would build for the lease's FedRCL run, not run."""
    args = fit_args("FedRCL", mode, lease)[1:] + QUIET + extra
    return FedRCLCLI(FedAvg, FederatedDataModule, trainer_class=FederatedTrainer, subclass_mode_model=True,
                     parser_class=FedRCLParser, seed_everything_default=0, save_config_callback=None,
                     run=False, args=args)


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


class RoundClock(RoundTimer):
    """``bench/gpu_round.py``'s round timer that also stops the fit after ``rounds`` rounds, or once the rounds
    after the first (which holds the compilation) have taken ``cap`` seconds; at least two rounds."""

    def __init__(self, rounds: int, cap: float):
        super().__init__("cuda" if torch.cuda.is_available() else "cpu")
        self.rounds, self.cap = rounds, cap

    def on_train_epoch_end(self, trainer, pl_module):
        super().on_train_epoch_end(trainer, pl_module)
        if len(self.seconds) >= self.rounds or (len(self.seconds) >= 2 and sum(self.seconds[1:]) > self.cap):
            trainer.should_stop = True


def broken(mode: str) -> str | None:
    pairs = (item.split("=", 1) for item in os.environ.get("GPU_LEASE_BREAK", "").split(",") if "=" in item)
    return dict(pairs).get(mode)


def update(cli: FedRCLCLI, start: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([(v.float() - start[k].float()).flatten().cpu()
                      for k, v in cli.model.backbone.state_dict().items()])


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def tiny_round(mode: str, lease: Lease, start: dict | None, extra: tuple[str, ...] = ()
               ) -> tuple[FedRCLCLI, dict, torch.Tensor]:
    if broken(mode) == "error":
        raise RuntimeError(f"forced by GPU_LEASE_BREAK ({mode}=error)")
    cli = build(mode, lease, ["--trainer.rounds", "1", "--trainer.local_epochs", "1",
                              "--data.local_iters_per_epoch", "2", *extra])
    first = {k: v.detach().clone() for k, v in cli.model.backbone.state_dict().items()}
    if start is not None and not all(torch.equal(first[k], v) for k, v in start.items()):
        raise AssertionError("the models of two modes start from different weights (seed)")
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    return cli, first, update(cli, first)


def time_rounds(mode: str, lease: Lease, tiny: FedRCLCLI, cap: float) -> dict:
    """Paper rounds in ``mode``, on the tiny round's model and batching (its compiled step is reused)."""
    clock, busy = RoundClock(ROUNDS, cap), Busy()
    cli = build(mode, lease, ["--trainer.rounds", str(ROUNDS)])
    cli.trainer.federation.batching = tiny.trainer.federation.batching
    cli.trainer.callbacks.append(clock)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        busy.start()
    cli.trainer.fit(tiny.model, datamodule=cli.datamodule)
    busy.running = False
    timed = clock.seconds[1:] or clock.seconds
    result = {"seconds_per_round": round(statistics.median(timed), 4), "rounds_timed": len(timed),
              "first_round_seconds": round(clock.seconds[0], 2), "gpu_busy": busy.fraction()}
    if torch.cuda.is_available():
        result["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    compile_s = tiny.trainer.federation.batching.compile_seconds
    if compile_s is not None:
        result["compile_seconds"] = round(compile_s, 1)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--result", type=Path, required=True)
    parser.add_argument("--cap", type=float, default=30.0,
                        help="seconds of timed rounds per mode, after the first round (compilation)")
    args = parser.parse_args()
    lease = Lease()
    torch.set_float32_matmul_precision("high")
    if not torch.cuda.is_available():  # the rehearsal: a compiler-free backend, as the CPU tests use
        batched.COMPILE_BACKEND = "aot_eager"
    report: dict = {"modes": {name: {} for name in MODES}}
    write_json(args.result, report)
    reference, start, ref_update = tiny_round("sequential", lease, None)
    float32_update = tiny_round("sequential", lease, start, ("--trainer.precision", "32-true"))[2]
    report["bf16_against_float32"] = round(relative(ref_update, float32_update), 5)
    report["tolerance"] = round(min(TOLERANCE_CAP, max(TOLERANCE_FLOOR, 2 * report["bf16_against_float32"])), 5)
    report["modes"]["sequential"]["relative_difference"] = 0.0
    tiny = {"sequential": reference}
    for mode in ("batched", "sequential", "batched+compiled"):
        entry = report["modes"][mode]
        started = time.perf_counter()
        try:
            if mode != "sequential":
                tiny[mode], _, mode_update = tiny_round(mode, lease, start)
                if broken(mode) == "unequal":
                    mode_update = 2 * mode_update
                rel = relative(mode_update, ref_update)
                entry["relative_difference"] = round(rel, 5)
                if not torch.isfinite(mode_update).all() or not rel <= report["tolerance"]:
                    entry["dropped"] = (f"differs from sequential: relative difference of the round's update "
                                        f"{rel:.3g} > {report['tolerance']}")
            if "dropped" not in entry:
                entry.update(time_rounds(mode, lease, tiny[mode], args.cap))
        except Exception as error:  # noqa: BLE001 (any failure of a mode drops that mode only)
            first = (str(error).strip().splitlines() or [""])[0][:300]
            entry["dropped"] = f"error: {type(error).__name__}: {first}"
        entry["probe_seconds"] = round(time.perf_counter() - started, 1)
        print(f"probe: {mode}: {entry}", flush=True)
        write_json(args.result, report)
    usable = {m: e for m, e in report["modes"].items() if "seconds_per_round" in e and "dropped" not in e}
    mode = min(usable, key=lambda m: usable[m]["seconds_per_round"])
    for name, entry in usable.items():
        if name != mode:
            entry["dropped"] = (f"slower: {entry['seconds_per_round']:.3f} s/round against "
                                f"{usable[mode]['seconds_per_round']:.3f} for {mode}")
    busy = usable[mode].get("gpu_busy")
    report["mode"] = mode
    report["room_for_third"] = os.environ.get("LEASE_ROOM") == "1" or (busy is not None and busy <= ROOM_BUSY)
    save_cache(lease.work / "compile_cache" / "probe.bin")
    write_json(args.result, report)
    print(f"probe: mode {mode}, room for a third run: {report['room_for_third']}", flush=True)


if __name__ == "__main__":
    main()
