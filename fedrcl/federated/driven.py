"""A federated run driven outside Lightning's fit loop: Flower's server (``fedrcl.flower.server``), whose rounds
Flower's ``Strategy.start`` drives. Every other run is a ``fedrcl fit`` (seeds together too: one fit per seed,
``fedrcl.federated.together``).

Such a driver builds the run as ``fedrcl fit`` does (same objects, seeds, initial weights), then runs its own
rounds; ``DrivenRun`` is the run's end of each round, as ``fedrcl fit`` ends it (scalars, the round's line, user
callbacks' round hooks, the round's checkpoint, ``trainer.max_time``, the privacy budget, the closing summary). The
functions give it the rest of ``fedrcl fit``'s run folder: the module attached and set up for fitting,
``--ckpt_path`` resumed (``open_run``), ``config.yaml``, ``split.json``, checkpoint callbacks and the TensorBoard
layout (``write_run_folder``), central evaluation (``evaluate``), each round's scalars with TensorBoard's accuracy
copies (``log_round``), and round checkpoints that ``--ckpt_path last`` of ``fedrcl fit`` reads (``save_round``).
What of the config's callbacks such a run does not call is named before it starts (``not_run``).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, ModelSummary, ProgressBar, Timer
from lightning.pytorch.cli import SaveConfigCallback
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.trainer.states import RunningStage, TrainerFn

from fedrcl.analysis.layout import ACCURACY_FIRST, ScalarLayout
from fedrcl.federated.checkpoint import RoundCheckpoint, read_checkpoint
from fedrcl.federated.federation import Federation, RoundCallback, client_callbacks
from fedrcl.federated.local_update import attach
from fedrcl.federated.preemption import Preemption
from fedrcl.federated.progress import SHOWN, RoundLines, RoundLog, RunClock, round_line, run_summary

# What a driven run calls of a user's callback (its rounds are not Lightning's: no step, no validation loop)
ROUND_HOOKS = ("on_train_start", "on_train_epoch_start", "on_train_epoch_end", "on_train_end")
# Lightning's per-step and evaluation-loop hooks, which a driven run never calls (named before it starts)
STEP_HOOKS = ("on_train_batch_start", "on_train_batch_end", "on_before_backward", "on_after_backward",
              "on_before_optimizer_step", "on_before_zero_grad", "on_validation_start", "on_validation_end",
              "on_validation_epoch_start", "on_validation_epoch_end", "on_validation_batch_start",
              "on_validation_batch_end")


# fedrcl's own defaults, whose work a driven run does itself (the round's line, the TensorBoard layout, the
# checkpoints, the time limit; a signal is the driver's to handle) or that only print at fit's start
OWN_CALLBACKS = (SaveConfigCallback, ModelCheckpoint, ModelSummary, ProgressBar, Federation, Preemption,
                 ScalarLayout, RoundLog, RoundLines, Timer)


def round_callbacks(trainer: L.Trainer) -> list[L.Callback]:
    """The config's callbacks whose round hooks (``ROUND_HOOKS``) a driven run calls: a user's own, not fedrcl's
    (``OWN_CALLBACKS``, and fedrcl's analysis callbacks, ``RoundCallback`` objects that a driven run calls as such)."""
    return [c for c in trainer.callbacks  # type: ignore[attr-defined]
            if not isinstance(c, OWN_CALLBACKS) and not type(c).__module__.startswith("fedrcl.")]


def not_run(trainer: L.Trainer) -> list[str]:
    """What of the config's callbacks a driven run does not call (its rounds are not Lightning's), named before
    it starts: each user callback's per-step or evaluation-loop hook (``STEP_HOOKS``; its round hooks run) and,
    as the clients' local models are not in this process (Flower's nodes hold them), the ``RoundCallback`` parts:
    fedrcl's analysis callbacks whole, a user's ``on_client_end`` and ``round_metrics``."""
    named, users = [], round_callbacks(trainer)
    for client_callback in client_callbacks(trainer):
        name = type(client_callback).__name__
        if client_callback not in users:  # fedrcl's own: nothing of it runs
            named.append(name)
        else:  # a user's: its round hooks run, not these
            named += [f"{name}.{hook}" for hook in ("on_client_end", "round_metrics")
                      if getattr(type(client_callback), hook) is not getattr(RoundCallback, hook)]
    for callback in users:
        named += [f"{type(callback).__name__}.{hook}" for hook in STEP_HOOKS
                  if getattr(type(callback), hook) is not getattr(L.Callback, hook)]
    return named


@dataclasses.dataclass
class DrivenRun:
    """One federation driven outside Lightning's fit loop (a Flower server's run): where it stands, and the
    round's end as ``fedrcl fit`` ends a round: the scalars (``train/*`` means, ``train/lr``, ``time/round_seconds``, ``val/acc`` and its EMA, the
    privacy accountant's, the ledger's) logged, the round's line, the user callbacks' round hooks, the round's
    checkpoint (written before anything of the next round begins), the time limit (``trainer.max_time``) and the
    privacy budget (``max_epsilon``); a stop (a signal, a failure) checkpoints the last round done."""

    trainer: Any
    module: Any
    datamodule: Any
    say: Callable[[str], None] = print  # how its lines are told
    next_round: int = 0
    steps: int = 0  # the clients' local steps so far (``global_step``)
    clock: RunClock = dataclasses.field(default_factory=RunClock)
    saved: bool = True  # whether the last round done is checkpointed
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    stopped: Optional[str] = None  # why it stopped before its last round (``trainer.max_time``, the budget)
    failed: Optional[str] = None  # why it failed (a diverged round: its last checkpoint is its last good round)

    @property
    def done(self) -> bool:
        return self.stopped is not None or self.failed is not None or self.next_round >= self.trainer.max_epochs

    def timer(self) -> Optional[Timer]:
        return next((c for c in self.trainer.callbacks if isinstance(c, Timer)), None)

    def open(self) -> None:
        """Write the run folder, start the clock and the time limit, call the callbacks' ``on_train_start``."""
        write_run_folder(self.trainer, self.module, self.datamodule)
        self.clock.fit_started(self.trainer)
        timer = self.timer()
        if timer is not None:
            timer.on_train_start(self.trainer, self.module)
        self._call("on_train_start")

    def begin_round(self) -> None:
        """A round begins: the callbacks' ``on_train_epoch_start``."""
        self._call("on_train_epoch_start")

    def end_round(self, steps: int, train: dict[str, float], seconds: float,
                  accuracies: Optional[dict[str, float]] = None,
                  extra: Optional[dict[str, float]] = None) -> dict[str, float]:
        """Round ``next_round`` has ended with ``steps`` client steps, its ``train/*`` means and ``accuracies``
        (the new global model's ``val/acc`` and, with a validation split, ``test/acc``, if evaluated: ``evaluate``);
        ``extra``: the driver's own scalars. Returns the round's metrics."""
        trainer, module, round_idx = self.trainer, self.module, self.next_round
        self.steps += steps
        metrics = {**train, "train/lr": float(module.client_lr(round_idx, 0)), "time/round_seconds": seconds}
        if accuracies:
            metrics.update({**accuracies, **module.accuracy_emas(accuracies)})
        privacy = trainer.federation.privacy
        metrics.update(privacy.metrics() if privacy is not None else {})
        _, ledger = trainer.federation.ledger.metrics()
        log_round(trainer, round_idx, {**metrics, **ledger, **(extra or {})})
        shown: dict[str, Any] = {k: metrics[k] for k in SHOWN if k in metrics}
        self.say(round_line(trainer, shown, self.clock))
        self.clock.round_started()
        self.saved = save_round(trainer, module, round_idx, self.steps, round_end=lambda: self._call(
            "on_train_epoch_end"))
        self.metrics, self.next_round = metrics, round_idx + 1
        timer = self.timer()
        left = timer.time_remaining() if timer is not None else None
        if left is not None and left <= 0 and not self.done:
            self.stopped = f"trainer.max_time reached after round {round_idx + 1}"
        elif privacy is not None and not self.done and privacy.budget_spent():
            self.stopped = privacy.budget_line(round_idx + 1)
        if self.stopped is not None:
            self.checkpoint_now()
        return metrics

    def checkpoint_now(self) -> None:
        """Checkpoint the last round done, if it is not yet."""
        if not self.saved and self.next_round > 0:
            self.saved = save_round(self.trainer, self.module, self.next_round - 1, self.steps, now=True)

    def close(self, stopping: bool = False) -> None:
        """The run ends (``stopping``: by a signal or a failure: the last round done is checkpointed first): the
        callbacks' ``on_train_end``, the logs closed, the stop and the summary told."""
        if stopping:
            self.checkpoint_now()
        self._call("on_train_end")
        for logger in self.trainer.loggers:
            logger.finalize("success" if self.done and not stopping and not self.failed else "failed")
        if self.stopped:
            self.say(f"stopped early: {self.stopped}")
        for line in run_summary(self.trainer, self.clock, self.metrics).splitlines():
            self.say(line)

    def _call(self, hook: str) -> None:
        for callback in round_callbacks(self.trainer):
            if getattr(type(callback), hook) is getattr(RoundCallback, hook, None):
                continue  # RoundCallback's own fit-loop logging of ``round_metrics``: ``end_round`` logs them
            getattr(callback, hook)(self.trainer, self.module)


def open_run(trainer: L.Trainer, module: Any, datamodule: Any, path: Optional[str]) -> tuple[int, int]:
    """Attach ``module`` and ``datamodule`` to ``trainer`` for fitting, set up its federation (the resume
    fingerprint) and resume checkpoint ``path`` if given (``resume``); nothing is written yet. Returns the
    first round's index and the local steps so far."""
    attach(trainer, module, datamodule)
    trainer.state.fn, trainer.state.stage = TrainerFn.FITTING, RunningStage.TRAINING
    trainer.federation.setup(trainer, module, "fit")  # type: ignore[attr-defined]  # a FederatedTrainer
    return resume(trainer, module, path) if path is not None else (0, 0)


def write_run_folder(trainer: L.Trainer, module: Any, datamodule: Any) -> None:
    """``config.yaml`` and ``split.json`` as ``fedrcl fit`` writes them, the checkpoint callbacks set up and
    TensorBoard's layout (val/acc first)."""
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, SaveConfigCallback):
            callback.setup(trainer, module, "fit")
    datamodule.export_split()
    for callback in trainer.checkpoint_callbacks:
        callback.setup(trainer, module, "fit")
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, ScalarLayout):
            callback.on_fit_start(trainer, module)


def evaluate(module: Any, datamodule: Any) -> dict[str, float]:
    """Top-1 accuracy of ``module``'s global model on each evaluation set (``val/acc``: the test set, or with a
    validation split the validation set, and then ``test/acc``), by its ``validation_step``."""
    module.eval()
    precision = module.trainer.precision_plugin  # the run's precision, as fit's evaluation loop applies it
    accuracies = {}
    for index, (prefix, batches) in enumerate(datamodule.evaluation_sets().items()):
        metric = module.val_acc if index == 0 else module.test_acc
        with torch.no_grad(), precision.val_step_context():
            for batch_idx, batch in enumerate(batches):
                module.validation_step(precision.convert_input(batch), batch_idx, index)
        accuracies[f"{prefix}/acc"] = float(metric.compute().item())
        metric.reset()
    module.train()
    return accuracies


def log_round(trainer: L.Trainer, round_idx: int, metrics: dict[str, float]) -> None:
    """Write a round's scalars to the run's loggers at step ``round_idx + 1`` (fedrcl's round axis), before the
    round's checkpoint as ``fedrcl fit`` does; TensorBoard also gets the ``accuracy/`` copies it opens on."""
    accuracy = {copy: metrics[tag] for tag, copy in ACCURACY_FIRST.items() if tag in metrics}
    for logger in trainer.loggers:
        log_metrics = getattr(logger.log_metrics, "__wrapped__", logger.log_metrics)
        first = accuracy if isinstance(logger, TensorBoardLogger) else {}
        log_metrics({**metrics, **first}, step=round_idx + 1)


def save_round(trainer: Any, module: Any, round_idx: int, steps: int, now: bool = False,
               round_end: Optional[Callable[[], None]] = None) -> bool:
    """Mark round ``round_idx`` done in the trainer's loop state (``global_step``: the clients' local steps so
    far), call ``round_end`` (the callbacks' ``on_train_epoch_end``, which in ``fedrcl fit`` run before the
    checkpoint, with ``trainer.current_epoch`` the round's index), then let ``RoundCheckpoint`` write its files
    as at the end of a ``fedrcl fit`` round, so ``--ckpt_path last`` reads them; ``now``: write them whether due
    or not (a run that stops). Returns whether a round checkpoint was written."""
    loop = trainer.fit_loop
    loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step.total.completed = steps
    progresses = (loop.epoch_progress.current, loop.epoch_progress.total)
    for progress in progresses:
        progress.ready = progress.started = progress.processed = round_idx + 1
        progress.completed = round_idx
    if round_end is not None:
        round_end()
    written = any(isinstance(c, RoundCheckpoint) and (now or c.due(trainer)) for c in trainer.checkpoint_callbacks)
    for callback in trainer.checkpoint_callbacks:
        if now and isinstance(callback, RoundCheckpoint):
            callback.save(trainer)
        else:
            callback.on_train_epoch_end(trainer, module)
    for progress in progresses:
        progress.completed = round_idx + 1
    return written


def resume(trainer: Any, module: Any, path: str) -> tuple[int, int]:
    """Load checkpoint ``path`` into the run's objects as ``fedrcl fit`` resumes: the module (global weights,
    accuracy EMA, client-state manifest), the federation (server memory, ledger, resume segments) and the
    time limit's count (``trainer.max_time``). Returns the next round's index and the local steps so far.
    Read with ``weights_only``, never executed."""
    checkpoint = read_checkpoint(path)
    module.load_state_dict(checkpoint["state_dict"])
    module.on_load_checkpoint(checkpoint)
    federation = trainer.federation  # a FederatedTrainer
    federation.load_state_dict(checkpoint["callbacks"][federation.state_key])
    federation.on_train_start(trainer, module)  # a new segment if resume_allow_changes changed keys
    for callback in trainer.callbacks:
        if isinstance(callback, Timer) and callback.state_key in checkpoint["callbacks"]:
            callback.load_state_dict(checkpoint["callbacks"][callback.state_key])
    first_round = int(checkpoint["epoch"]) + 1
    loop = trainer.fit_loop
    for progress in (loop.epoch_progress.current, loop.epoch_progress.total):  # rounds done, as fit restores them
        progress.ready = progress.started = progress.processed = progress.completed = first_round
    return first_round, int(checkpoint["global_step"])
