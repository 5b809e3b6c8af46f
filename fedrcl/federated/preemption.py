"""Preemption: SIGTERM, Ctrl-C (and SLURM's requeue signal) stop a run at the end of the round in progress.

A scheduler that preempts a job (SLURM, Kubernetes, ``timeout``) sends SIGTERM and, some seconds later,
SIGKILL. Lightning's own handler stops the loop after the current *step* and exits with status 0, so the
round is left half-trained, nothing is checkpointed, and the scheduler takes the job for finished.

Here the signal only records a request (``PreemptionSignals``, which takes the place of Lightning's signal
connector; no collective in a signal handler). The round in progress finishes: its clients, aggregation,
evaluation, logs. Then ``Preemption`` (a callback) decides with the other processes, in one all-reduce per
round, and sets Lightning's ``trainer.should_stop``, so ``RoundCheckpoint`` saves the round
(``fedrcl.federated.deadline.stopped_after_round``) and the fit ends as after its last round.
``FederatedTrainer.fit`` then raises ``Preempted``: exit status 128 + the signal (143 for SIGTERM), and the
``fedrcl`` command prints one line with the round and the command that resumes it (``--ckpt_path last``,
which continues bitwise as if the run never stopped).

Ctrl-C (SIGINT) is the same request, from a terminal: the first one says on stderr that the run stops after
the round in progress, checkpointed (exit status 130); a second one stops the run at once (``Interrupted``):
the rounds after the last checkpoint are lost, that checkpoint stays, and the command prints one line with it
and the resume command, no traceback. Lightning's own handling of Ctrl-C (stop after the current step, no
checkpoint, exit status 1; a traceback on a second Ctrl-C) never runs during a fit.

Signals: SIGTERM and SIGINT always. Under SLURM, Lightning's ``SLURMEnvironment`` with ``auto_requeue`` (its
default) adds its ``requeue_signal`` (SIGUSR1 unless set otherwise; ``#SBATCH --signal=USR1@300`` sends it 300 s
before the time limit); after that signal's checkpoint, rank 0 requeues the job with ``scontrol requeue``,
as Lightning does (Lightning itself would save a mid-round checkpoint, which a round cannot resume from).
The processes of a multi-process run all stop after the same round: the process that gets the signal
passes it on to the processes it started (Lightning's launcher), and the per-round decision takes any.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
from typing import Any, Optional

import lightning as L
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector
from lightning.pytorch.trainer.states import TrainerFn

from fedrcl.federated.checkpoint import RoundCheckpoint


class Preempted(SystemExit):
    """The run stopped after a whole round because of a signal; the exit status is 128 + the signal.

    Attributes:
        signal_name: ``SIGTERM``, ``SIGUSR1``, ...
        round: the last round trained (1-based); rounds: the run's total.
        checkpoint: the file ``--ckpt_path last`` resumes from (``None``: checkpointing is off).
        requeued: the ``scontrol requeue`` outcome under SLURM, else ``None``.
        rank: the process's global rank (the ``fedrcl`` command prints the line on rank 0 only).
    """

    def __init__(self, signum: int, round: int, rounds: int, checkpoint: Optional[str],
                 requeued: Optional[str] = None, rank: int = 0):
        super().__init__(128 + signum)
        self.signal_name = signal.Signals(signum).name
        self.round, self.rounds, self.checkpoint = round, rounds, checkpoint
        self.requeued, self.rank = requeued, rank

    def message(self, resume_command: str = "--ckpt_path last") -> str:
        """One line: what stopped the run, after which round, where its checkpoint is, how to resume."""
        stopped = f"fedrcl: stopped by {self.signal_name} after round {self.round}/{self.rounds}"
        if not self.checkpoint:
            return f"{stopped}, no checkpoint (trainer.enable_checkpointing is false): nothing to resume"
        requeued = f"; {self.requeued}" if self.requeued else ""
        return f"{stopped}, checkpoint {self.checkpoint}{requeued}; resume: {resume_command}"

    def __str__(self) -> str:
        return self.message()


class Interrupted(Preempted):
    """A second Ctrl-C: the run stopped at once, in round ``round``; ``checkpoint`` is the last one written before
    it (``None``: none yet), what ``--ckpt_path last`` resumes from; the rounds after it are lost."""

    def message(self, resume_command: str = "--ckpt_path last") -> str:
        stopped = f"fedrcl: stopped by a second {self.signal_name} in round {self.round}/{self.rounds}"
        if not self.checkpoint:
            return f"{stopped}, before its first checkpoint: nothing to resume"
        return f"{stopped}, the rounds after checkpoint {self.checkpoint} lost; resume: {resume_command}"


def _stop_signals(trainer: L.Trainer) -> dict[int, bool]:
    """The signals that stop a fit at the round's end -> whether the job is requeued after it."""
    signals: dict[int, bool] = {signal.SIGTERM: False, signal.SIGINT: False}
    environment = trainer._accelerator_connector.cluster_environment
    if isinstance(environment, SLURMEnvironment) and environment.auto_requeue and environment.requeue_signal:
        signals[environment.requeue_signal] = True
    return signals


class PreemptionSignals(_SignalConnector):
    """Lightning's signal connector for a ``FederatedTrainer``: during ``fit``, a stop signal is recorded
    (``signum``) and passed on to the processes this one started; Lightning's ``received_sigterm`` stays
    false, so its loops do not stop in mid-round. Outside ``fit`` (``validate``, ``test``) nothing is
    installed: a signal ends the process as it would without fedrcl."""

    def __init__(self, trainer: L.Trainer) -> None:
        super().__init__(trainer)
        self.signum: Optional[int] = None
        self.requeue = False

    def register_signal_handlers(self) -> None:
        self.received_sigterm, self.signum, self.requeue = False, None, False
        self._original_handlers = {}
        if os.name == "nt" or self.trainer.state.fn != TrainerFn.FITTING:
            return
        self._original_handlers = self._get_current_signal_handlers()
        self._requeue_after = _stop_signals(self.trainer)
        for signum in self._requeue_after:
            self._register_signal(signum, self._record)

    def _record(self, signum: int, _: Any) -> None:
        if self.signum is None:
            self.signum, self.requeue = signum, self._requeue_after.get(signum, False)
            launcher = self.trainer.strategy.launcher
            # The processes Lightning started (``ddp`` over popen) stop too. Ctrl-C reaches them from the
            # terminal already (one process group): passing it on would be their second one.
            if launcher is not None and signum != signal.SIGINT:
                launcher.kill(signum)
            if signum == signal.SIGINT and self.trainer.is_global_zero:
                trainer = self.trainer
                # os.write: a print() here could land inside another print() of this thread
                os.write(2, f"\nfedrcl: Ctrl-C: stopping after round {trainer.current_epoch + 1}/"
                            f"{trainer.max_epochs}, checkpointed; Ctrl-C again stops now, losing the rounds since "
                            f"the last checkpoint\n"
                            .encode())
        elif signum == signal.SIGINT:
            raise Interrupted(signum, self.trainer.current_epoch + 1, self.trainer.max_epochs or 0,
                              last_checkpoint(self.trainer), rank=self.trainer.global_rank)


class Preemption(L.Callback):
    """After each round's evaluation and logs: if any process got a stop signal, stop after this round."""

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        connector = trainer._signal_connector
        asked = isinstance(connector, PreemptionSignals) and connector.signum is not None
        if trainer.world_size > 1:  # every process stops after the same round
            assert isinstance(connector, PreemptionSignals)  # a FederatedTrainer's, as is this callback
            signum = connector.signum or 0
            packed = torch.tensor([signum, int(connector.requeue)], device=trainer.strategy.root_device)
            dist.all_reduce(packed, op=dist.ReduceOp.MAX)
            if packed[0].item() and not asked:
                connector.signum, connector.requeue = int(packed[0].item()), bool(packed[1].item())
            asked = bool(packed[0].item())
        federation = getattr(trainer, "federation", None)
        outside = getattr(federation, "stop_signal", None)  # a fit in a thread: its process's signal (Flower)
        if outside is not None and outside.signum is not None and isinstance(connector, PreemptionSignals):
            connector.signum, asked = connector.signum or outside.signum, True
        seat = getattr(federation, "lockstep", None)
        if seat is not None:  # seeds together: every run stops after the same round
            signum = seat.round_end(connector.signum if isinstance(connector, PreemptionSignals) else None)
            if signum is not None and isinstance(connector, PreemptionSignals):
                connector.signum = connector.signum or signum
            asked = signum is not None
        rounds = trainer.max_epochs
        assert rounds is not None  # an int during fit
        if asked and trainer.current_epoch + 1 < rounds:
            trainer.should_stop = True


def stop_signal(trainer: Optional[L.Trainer]) -> Optional[int]:
    """The stop signal a fit of ``trainer`` received, if any: also one that came in its last round (that fit
    ends as usual), which a caller running several fits (``fedrcl seeds``) must still obey."""
    connector = getattr(trainer, "_signal_connector", None)
    return connector.signum if isinstance(connector, PreemptionSignals) else None


def last_checkpoint(trainer: L.Trainer) -> Optional[str]:
    """The ``last.ckpt`` this fit wrote, or ``None`` (none yet, or checkpointing is off)."""
    rounds = [c for c in trainer.checkpoint_callbacks if isinstance(c, RoundCheckpoint)]
    return (rounds[0].last_model_path or None) if rounds else None


def preempted(trainer: L.Trainer) -> Optional[Preempted]:
    """The ``Preempted`` a finished ``fit`` ends in, or ``None`` (no signal, or the run had trained all of its
    rounds when it came). Requeues a SLURM job after the requeue signal (rank 0)."""
    connector = trainer._signal_connector
    if not isinstance(connector, PreemptionSignals) or connector.signum is None or not trainer.should_stop:
        return None
    done = trainer.current_epoch  # the loop counted the stopped round as completed
    checkpoint = last_checkpoint(trainer)
    requeued = requeue_slurm_job() if connector.requeue and trainer.is_global_zero else None
    assert trainer.max_epochs is not None  # an int once fit has run
    return Preempted(connector.signum, done, trainer.max_epochs, checkpoint or None, requeued,
                     trainer.global_rank)


def requeue_slurm_job() -> str:
    """``scontrol requeue`` this SLURM job (an array task as ``<array job>_<task>``); what happened, in words."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array_job else os.environ.get("SLURM_JOB_ID", "")
    if not re.fullmatch(r"[0-9_]+", job):
        return f"not requeued (SLURM_JOB_ID {job!r} is not a job id)"
    try:
        result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"scontrol requeue {job} failed ({error})"
    if result.returncode != 0:
        return f"scontrol requeue {job} failed ({(result.stderr or result.stdout).strip()[:200]})"
    return f"SLURM job {job} requeued"


class StopSignal:
    """Records SIGTERM and Ctrl-C while a run that fedrcl drives itself is going (``fedrcl seeds`` between fits,
    with ``--parallel`` and ``--together``; a Flower simulation), so that it ends after the rounds or seeds in
    progress instead of being killed between two of them; a second Ctrl-C stops it at once. A fit in this
    process installs its own handlers meanwhile (``Preemption``)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.signum: Optional[int] = None

    def __enter__(self) -> "StopSignal":
        self._previous = {signum: signal.signal(signum, self._record) for signum in self.SIGNALS}
        return self

    def __exit__(self, *exc: Any) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _record(self, signum: int, _: Any) -> None:
        if signum == signal.SIGINT and self.signum == signal.SIGINT:
            raise KeyboardInterrupt  # the second Ctrl-C: ``fedrcl`` ends in one line
        self.signum = self.signum or signum
