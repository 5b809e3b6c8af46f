"""Seeds together: one experiment's seeds as independent federations trained in one program.

``fedrcl seeds --seeds 0 1 2 --together FIT_ARGS`` builds each seed's run exactly as its ``fedrcl fit`` would
(``fedrcl.seeds.fit_args_for_seed``: its own split seed, client sampling, batches, global model, server optimizer
state, accuracy EMA, logger, checkpoints, run folder ``<name>/seed<k>``), and runs each seed's fit, with its clients
batched, in a thread of this process: Lightning's fit loop, so each seed is evaluated, logged, checkpointed, resumed
and stopped by its time limit exactly as its own ``fedrcl fit``, and every callback of the config runs, per step
too. Their rounds meet (``fedrcl.federated.lockstep``): in each round, the local steps of all seeds' clients run as
one step on a stacked client axis, ``seeds x clients_per_round`` long (the stacked engine of batched clients,
``fedrcl.federated.stacked``, whose step is ``fedrcl.federated.client_step.ClientStep``: forward, the method's own
one-client ``local_loss`` or ``client_direction``, backward, per-client clip and SGD in one function, compiled as
one graph with ``trainer.compile_clients``). Clients that differ in step count or batch sizes (each seed's split has
its own) train stacked under a step mask (``fedrcl.contract.step_mask``). Seeds resumed at different rounds train
side by side, each stopping at its own last round (or ``trainer.max_time``); SIGTERM and Ctrl-C end the round and
checkpoint every seed; a second Ctrl-C stops at once.

Each seed's weights equal its own ``fedrcl fit`` within float rounding (``tests/test_together.py``). A method whose
clients read something of their seed that one stacked step cannot give each seed (a global teacher, class
prototypes) is found before the round's first step: the seeds then part and each goes on alone, in its own fit
(``lockstep.check_runs``). What cannot be stacked at all trains one seed after another, said before anything starts:
a method that cannot train batched (``batched.unbatchable``: per-client models, buffers, a step of its own,
16-mixed), several devices, rounds of different shapes.
"""
from __future__ import annotations

import io
import signal
import sys
import threading
import traceback
import warnings
from collections.abc import Hashable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Optional

from fedrcl.contract.exchange import check_method
from fedrcl.federated.batched import unbatchable
from fedrcl.federated.checkpoint import NothingToResume, read_checkpoint, resume_path, run_checkpoints
from fedrcl.federated.lockstep import Lockstep, LockstepAborted, NotTogether, ProcessState, Seat
from fedrcl.federated.preemption import Preempted
from fedrcl.federated.run_folder import hold_run_folders, release_run_folders

__all__ = ["Cohort", "NotTogether", "StoppedTogether", "train_together"]


class SeedRun:
    """One run of the cohort, built as its ``fedrcl fit`` (``cli``): ``key`` is its key in the cohort's runs,
    ``label`` what its lines begin with (``seed 1``; ``lr=0.03 seed 1`` in a sweep), ``seed`` its
    ``trainer.seed``, ``path`` the checkpoint it resumes (``None``: it starts at round 1); after the fit,
    ``stopped`` (the stop signal's ``Preempted``) or ``failed`` (why)."""

    def __init__(self, key: Hashable, cli: Any, label: str):
        self.key, self.label, self.cli = key, label, cli
        self.trainer, self.module, self.datamodule = cli.trainer, cli.model, cli.datamodule
        self.seed = cli.trainer.federation.seed
        self.path: Optional[str] = None
        self.process_state: Optional[ProcessState] = None
        self.stopped: Optional[Preempted] = None
        self.failed: Optional[str] = None

    @property
    def next_round(self) -> int:
        """The round its fit trains next (0-based): after a fit, the rounds done; before, the checkpoint's."""
        if self.trainer.current_epoch or self.path is None:
            return int(self.trainer.current_epoch)
        return int(read_checkpoint(self.path, mmap=True)["epoch"]) + 1


def static_reason(run: SeedRun) -> Optional[str]:
    """Why a seed's run cannot train on the stacked step, from its configuration (``None``: it can)."""
    module, trainer = run.module, run.trainer
    if trainer.federation.batching.mode == "off":
        return "trainer.client_batching is off"
    reason = unbatchable(module, str(trainer.precision))
    if reason is None and trainer.world_size > 1:
        reason = "it runs on several devices or processes"
    return reason


class Cohort:
    """The runs trained together (see the module docstring): a command's seeds, or a sweep's (setting, seed)
    runs.

    Args:
        runs: each run's ``fedrcl fit`` arguments by its key (``--ckpt_path`` among them resumes it: ``last``
            resumes each run that has a checkpoint and starts the others).
        stop: what records a stop signal (``fedrcl.federated.preemption.StopSignal``): read after each round.
        labels: what each run's lines begin with, by key; default ``seed <key>`` (``fedrcl seeds``' keys).
        prog: the command, for its lines (``fedrcl seeds``, ``fedrcl sweep``).
    """

    def __init__(self, runs: Mapping[Hashable, list[str]], stop: Any,
                 labels: Optional[Mapping[Hashable, str]] = None, prog: str = "fedrcl seeds"):
        self.stop, self.prog = stop, prog
        self.what = "seed" if labels is None else "run"
        self.seeds: list[SeedRun] = []  # every run of the cohort (each a federation with its own seed)
        try:
            self._build(runs, labels or {key: f"seed {key}" for key in runs})
        except BaseException:
            self.abandon()
            raise

    def abandon(self) -> None:
        """After a failure before any round was logged (``NotTogether`` among them): remove the run folders
        these starts made (``remove_failed_start``: never one that holds a checkpoint or existed before)."""
        from fedrcl.lightning_cli import remove_failed_start

        for run in self.seeds:
            remove_failed_start(run.cli)

    def _build(self, runs: Mapping[Hashable, list[str]], labels: Mapping[Hashable, str]) -> None:
        """Each run built as its ``fedrcl fit`` would and checked; nothing written but its run folder's lock."""
        from fedrcl.cli import split_ckpt_path
        from fedrcl.lightning_cli import build_cli

        for key, args in runs.items():
            args, ckpt_path = split_ckpt_path(args)
            run = SeedRun(key, build_cli(args, run=False), labels[key])
            run.process_state = ProcessState.now()  # as its fit would find it: seeded, its model initialised
            self.seeds.append(run)
            hold_run_folders(run.trainer)
            reason = static_reason(run)
            if reason is not None:
                raise NotTogether(f"{run.label}: {reason}")
            check_method(run.module, run.trainer.federation.server, training=True)
            run.path = self._checkpoint(run, ckpt_path)
        shapes = {(r.trainer.federation.clients_per_round, r.trainer.federation.local_epochs,
                   r.datamodule.local_iters_per_epoch, r.trainer.precision) for r in self.seeds}
        if len(shapes) > 1:
            raise NotTogether("the runs' rounds differ in shape (clients per round, local epochs, steps or "
                              "precision)")
        sizes = {r.datamodule.batch_size for r in self.seeds}
        if len(sizes) > 1:
            raise NotTogether(f"the runs' batch sizes differ ({sorted(sizes)}: data.batch_size null with "
                              "--vary_split); set data.batch_size")

    def _checkpoint(self, run: SeedRun, ckpt_path: Optional[str]) -> Optional[str]:
        """The checkpoint ``run`` resumes from: ``last`` where its run folder has none starts it anew; where it
        has checkpoints but none usable, the command stops naming this run alone (the others can resume)."""
        if ckpt_path is None:
            return None
        where, found = run_checkpoints(run.trainer)
        if ckpt_path == "last" and not found:
            print(f"{self.prog}: {run.label}: no checkpoint in {where}; it starts at round 1", flush=True)
            return None
        try:
            return resume_path(run.trainer, run.module, run.datamodule, ckpt_path)
        except NothingToResume as error:
            raise NothingToResume(
                f"{run.label}: --ckpt_path last: nothing to resume under {error.where} ({error.found} checkpoint "
                f"file(s), none usable: see the warnings above); to start {run.label} anew and resume the "
                f"others, move {error.where} away and run the same command again", error.where, error.found) from None

    # -- the run ----------------------------------------------------------------------------------------
    def fit(self) -> None:
        """Every run's fit, each in its thread, their rounds in lockstep, each to its last round (or a stop).
        A second Ctrl-C (``KeyboardInterrupt`` here) stops every run at once."""
        active = [run for run in self.seeds if run.next_round < (run.trainer.max_epochs or 0)]
        lockstep = Lockstep([run.label for run in active], self.stop, self._say)
        threads = []
        for index, run in enumerate(active):
            run.trainer.federation.batching.mode = "on"  # together means stacked, on the CPU too
            run.trainer.federation.lockstep = Seat(lockstep, index)
            threads.append(threading.Thread(target=self._fit, args=(run,), name=run.label, daemon=True))
        with labelled_output({thread.name: thread.name for thread in threads}), process_hooks_kept():
            for thread in threads:
                thread.start()
            try:
                for thread in threads:
                    while thread.is_alive():
                        thread.join(0.2)
            except KeyboardInterrupt:
                lockstep._abort("a second Ctrl-C")
                for thread in threads:
                    thread.join()
                raise

    def _fit(self, run: SeedRun) -> None:
        """Run ``run``'s fit (in its thread), recording how it ended; it leaves the lockstep then."""
        from fedrcl.cli import report_user_error

        seat = run.trainer.federation.lockstep
        try:
            with seat.lockstep.running(seat.index, run.process_state):
                run.trainer.fit(run.module, datamodule=run.datamodule, ckpt_path=run.path)
        except Preempted as stopped:
            run.stopped = stopped
        except LockstepAborted as error:
            run.failed = str(error)
        except SystemExit as exit_:
            if exit_.code not in (0, None):
                run.failed = f"exit status {exit_.code}"
        except Exception as error:  # noqa: BLE001 (one run's failure is said; the others go on)
            run.failed = f"{error}"
            if not report_user_error(error, prog=f"{self.prog}: {run.label}", argv=[]):
                traceback.print_exc()
        finally:
            run.trainer.federation.lockstep = None
            release_run_folders(run.trainer)

    def _say(self, line: str) -> None:
        print(f"{self.prog}: --together: {line}; each {self.what} goes on alone, in its own fit", flush=True)

    def stopped_where(self) -> str:
        """`` (seed 0 after round 3/10, ...)`` for the command's stop line."""
        return " (" + ", ".join(f"{r.label} after round {r.next_round}/{r.trainer.max_epochs}"
                                for r in self.seeds) + ")"


class LabelledLines(io.TextIOBase):
    """A text stream whose lines written by a labelled thread begin with its label (``seed 1: Round 3/8 ...``)."""

    def __init__(self, stream: Any, labels: Mapping[str, str]):
        self.stream, self.labels = stream, labels
        self._at_line_start: dict[str, bool] = {}

    def write(self, text: str) -> int:
        name = threading.current_thread().name
        label = self.labels.get(name)
        if label is None:
            return self.stream.write(text)
        out, start = [], self._at_line_start.get(name, True)
        for line in text.splitlines(keepends=True):
            out.append(f"{label}: {line}" if start else line)
            start = line.endswith("\n")
        self._at_line_start[name] = start
        self.stream.write("".join(out))
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return int(self.stream.fileno())


@contextmanager
def labelled_output(labels: Mapping[str, str]) -> Iterator[None]:
    """``sys.stdout`` and ``sys.stderr`` labelled per thread (``LabelledLines``) while the runs' threads print."""
    streams = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = LabelledLines(sys.stdout, labels), LabelledLines(sys.stderr, labels)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = streams


@contextmanager
def process_hooks_kept() -> Iterator[None]:
    """The warning filters and ``threading.excepthook`` as they were before the runs' fits, each of which sets
    them for its span (``FederatedTrainer.fit``): spans that overlap in threads would restore them out of order."""
    excepthook = threading.excepthook
    try:
        with warnings.catch_warnings():
            yield
    finally:
        threading.excepthook = excepthook


def train_together(runs: Mapping[Hashable, list[str]], stop: Any, labels: Optional[Mapping[Hashable, str]] = None,
                   prog: str = "fedrcl seeds") -> Cohort:
    """Build and train the runs together (``Cohort``'s arguments; ``NotTogether``: they cannot, and nothing was
    written)."""
    cohort = Cohort(runs, stop, labels, prog)
    cohort.fit()
    stopped = [run.stopped for run in cohort.seeds if run.stopped is not None]
    if stopped:
        raise StoppedTogether(cohort, int(stopped[0].code) - 128)  # type: ignore[arg-type]  # 128 + signal
    return cohort


class StoppedTogether(Exception):
    """A stop signal ended the seeds after a round, every seed checkpointed."""

    def __init__(self, cohort: Cohort, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.cohort, self.signum = cohort, signum
