"""FederatedTrainer: Lightning's Trainer with rounds, clients and a server optimizer."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Optional

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar, TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import convert_inf
from lightning.pytorch.loggers import TensorBoardLogger

from fedrcl.federated.batched import ClientBatching
from fedrcl.federated.federation import Federation
from fedrcl.server import ServerOptimizer

# Trainer arguments the federation sets itself, with Lightning's defaults (anything else is an error).
_OWNED = {"max_epochs": None, "min_epochs": None, "max_steps": -1, "check_val_every_n_epoch": 1,
          "reload_dataloaders_every_n_epochs": 0, "num_sanity_val_steps": None,
          "gradient_clip_val": None}


class RoundProgressBar(TQDMProgressBar):
    """Lightning's progress bar, labelled by round (and never by Lightning's 0-based epoch)."""

    def on_train_epoch_start(self, trainer: L.Trainer, *_: Any) -> None:
        if self._leave:
            self.train_progress_bar = self.init_train_tqdm()
        bar = self.train_progress_bar
        # Label first, then reset: reset() draws the bar, which in a log file is a line of its own.
        bar.set_description(f"Round {trainer.current_epoch + 1}/{trainer.max_epochs}", refresh=False)
        bar.reset(total=convert_inf(self.total_train_batches))


class RoundCheckpoint(ModelCheckpoint):
    """Checkpoint every ``every_n_epochs`` rounds and after the last round; ``last.ckpt`` beside them.

    ``--ckpt_path last`` finds the newest ``last.ckpt`` of any earlier version of the same run name, so a
    resumed run writes a new version folder and never overwrites what the interrupted run wrote.
    """

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        done = trainer.current_epoch + 1
        if self._should_skip_saving_checkpoint(trainer):
            return
        if done % self._every_n_epochs == 0 or done == trainer.max_epochs:
            candidates = self._monitor_candidates(trainer)
            self._save_topk_checkpoint(trainer, candidates)
            self._save_last_checkpoint(trainer, candidates)

    def _find_last_checkpoints(self, trainer: L.Trainer) -> set[str]:
        logger = trainer.logger
        if logger is None or logger.save_dir is None:
            return super()._find_last_checkpoints(trainer)
        run_dir = Path(logger.save_dir) / (logger.name or "")
        return {str(p) for p in run_dir.glob("version_*/checkpoints/last.ckpt")}


class FederatedTrainer(L.Trainer):
    """Lightning's Trainer where one epoch is one federated round.

    Every other Trainer argument (logger, callbacks, precision, accelerator, devices, ...) works as in
    Lightning. The round loop itself lives in ``fedrcl.federated.federation.Federation``.

    Args:
        rounds: communication rounds (Lightning epochs).
        clients_per_round: clients sampled per round (paper: 5 of 100).
        participation: the fraction of clients sampled per round, instead of clients_per_round (set
            that to null).
        local_epochs: local epochs each sampled client trains per round (paper: 5).
        server: server optimizer (``fedrcl.server``); default FedAvg.
        eval_every: evaluate the global model on the test set every this many rounds.
        checkpoint_every: save a checkpoint every this many rounds (and after the last).
        seed: seed of client sampling, local batch order and augmentation (the client split has its own
            ``data.seed``; model initialisation follows ``seed_everything``).
        client_batching: ``on``: train a round's clients together, as one model with a leading client axis
            (one step = one local step of every client; same result as one after another); ``off``: one after
            another; ``auto``: on on CUDA, off elsewhere. Rounds it cannot batch (unequal clients, MOON,
            BatchNorm) run one after another, with a notice.
        compile_clients: compile the batched clients' step with ``torch.compile`` (CUDA graphs on CUDA).
    """

    def __init__(
        self,
        rounds: int = 1000,
        clients_per_round: Optional[int] = 5,
        participation: Optional[float] = None,
        local_epochs: int = 5,
        server: Optional[ServerOptimizer] = None,
        eval_every: int = 1,
        checkpoint_every: int = 50,
        seed: int = 0,
        client_batching: Literal["auto", "on", "off"] = "auto",
        compile_clients: bool = False,
        **kwargs: Any,
    ):
        for key, default in _OWNED.items():
            if kwargs.pop(key, default) != default:
                raise ValueError(f"trainer.{key} is set by fedrcl: use trainer.rounds, trainer.eval_every, "
                                 "model.grad_clip_norm")
        for key, value in (("rounds", rounds), ("eval_every", eval_every), ("checkpoint_every", checkpoint_every)):
            if value < 1:
                raise ValueError(f"trainer.{key} must be >= 1, got {value}")
        self.federation = Federation(clients_per_round, participation, local_epochs, server, seed,
                                     ClientBatching(client_batching, compile_clients))
        callbacks = list(kwargs.pop("callbacks", None) or [])
        if kwargs.get("enable_checkpointing", True) is not False and not any(
                isinstance(c, ModelCheckpoint) for c in callbacks):
            callbacks.append(RoundCheckpoint(filename="round{epoch:04d}", auto_insert_metric_name=False,
                                             every_n_epochs=checkpoint_every, save_top_k=-1, save_last=True))
        if kwargs.get("enable_progress_bar", True) is not False and not any(
                isinstance(c, ProgressBar) for c in callbacks):
            callbacks.append(RoundProgressBar())
        if kwargs.get("logger") in (None, True):
            kwargs["logger"] = TensorBoardLogger(save_dir=kwargs.get("default_root_dir") or "runs", name="fedrcl")
        super().__init__(
            max_epochs=rounds, check_val_every_n_epoch=eval_every, num_sanity_val_steps=0,
            reload_dataloaders_every_n_epochs=1, callbacks=[self.federation, *callbacks], **kwargs)

    @property
    def rounds(self) -> int:
        return self.max_epochs
