"""A federated run driven outside Lightning's fit loop: Flower's server (``fedrcl.flower.server``) and seeds
trained together (``fedrcl.federated.together``).

Such a driver builds the run as ``fedrcl fit`` does (same objects, seeds, initial weights), then runs its own
rounds; these functions give it the rest of ``fedrcl fit``'s run folder: the module attached and set up for
fitting, ``--ckpt_path`` resumed (``open_run``), ``config.yaml``, ``split.json``, checkpoint callbacks and the
TensorBoard layout (``write_run_folder``), central evaluation with the accuracy EMA (``evaluate``), each
round's scalars with TensorBoard's accuracy copies (``log_round``), and round checkpoints that
``--ckpt_path last`` of ``fedrcl fit`` reads (``save_round``). Callbacks of the config that such a run does
not call are named before it starts (``not_run``).
"""
from __future__ import annotations

from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, ModelSummary, ProgressBar, Timer
from lightning.pytorch.cli import SaveConfigCallback
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.trainer.states import RunningStage, TrainerFn

from fedrcl.analysis.layout import ACCURACY_FIRST, ScalarLayout
from fedrcl.data.datamodule import EvalBatches
from fedrcl.federated.checkpoint import RoundCheckpoint, read_checkpoint
from fedrcl.federated.federation import Federation
from fedrcl.federated.local_update import attach
from fedrcl.federated.preemption import Preemption
from fedrcl.federated.progress import RoundLines, RoundLog


def not_run(trainer: L.Trainer, handled: tuple[type, ...] = ()) -> list[str]:
    """The config's callbacks that a driven run does not call (its rounds are not Lightning's), among them every
    ``RoundCallback``: their ``on_client_end`` needs each client's local model inside Lightning's round loop.
    The run names them before it starts. Not named: fedrcl's own defaults, whose work the driver does (the
    round's line, the TensorBoard layout, the checkpoints; a signal is the driver's to handle) or that only
    print at fit's start (the model summary), and the ``handled`` types (a ``Timer`` where the driver keeps
    ``trainer.max_time``)."""
    kept = (SaveConfigCallback, ModelCheckpoint, ModelSummary, ProgressBar, Federation, Preemption, ScalarLayout,
            RoundLog, RoundLines, *handled)
    return [type(c).__name__ for c in trainer.callbacks if not isinstance(c, kept)]  # type: ignore[attr-defined]


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


def evaluate(module: Any, datamodule: Any) -> float:
    """Top-1 accuracy of ``module``'s global model on the test set (its ``validation_step``), and the EMA."""
    module.eval()
    precision = module.trainer.precision_plugin  # the run's precision, as fit's evaluation loop applies it
    with torch.no_grad(), precision.val_step_context():
        for batch_idx, batch in enumerate(EvalBatches(datamodule)):
            module.validation_step(precision.convert_input(batch), batch_idx)
    module.train()
    acc = module.val_acc.compute().item()
    module.val_acc.reset()
    module.update_acc_ema(acc)
    return float(acc)


def log_round(trainer: L.Trainer, round_idx: int, metrics: dict[str, float]) -> None:
    """Write a round's scalars to the run's loggers at step ``round_idx + 1`` (fedrcl's round axis), before the
    round's checkpoint as ``fedrcl fit`` does; TensorBoard also gets the ``accuracy/`` copies it opens on."""
    accuracy = {copy: metrics[tag] for tag, copy in ACCURACY_FIRST.items() if tag in metrics}
    for logger in trainer.loggers:
        log_metrics = getattr(logger.log_metrics, "__wrapped__", logger.log_metrics)
        first = accuracy if isinstance(logger, TensorBoardLogger) else {}
        log_metrics({**metrics, **first}, step=round_idx + 1)


def save_round(trainer: Any, module: Any, round_idx: int, steps: int, now: bool = False) -> bool:
    """Mark round ``round_idx`` done in the trainer's loop state (``global_step``: the clients' local steps so
    far), then let ``RoundCheckpoint`` write its files as at the end of a ``fedrcl fit`` round (while
    ``trainer.current_epoch`` is the round's index), so ``--ckpt_path last`` reads them; ``now``: write them
    whether due or not (a run that stops). Returns whether a round checkpoint was written."""
    loop = trainer.fit_loop
    loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step.total.completed = steps
    progresses = (loop.epoch_progress.current, loop.epoch_progress.total)
    for progress in progresses:
        progress.ready = progress.started = progress.processed = round_idx + 1
        progress.completed = round_idx
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
