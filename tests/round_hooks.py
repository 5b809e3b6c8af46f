"""A user's Lightning callback that writes down the round hooks it sees, for the tests that check that every
backend calls them (``--trainer.callbacks+=round_hooks.RoundHooks --trainer.callbacks.path FILE``)."""
from __future__ import annotations

from pathlib import Path

import lightning as L


class RoundHooks(L.Callback):
    """Appends ``start``, ``round_start N``, ``round_end N`` (Lightning's 0-based ``current_epoch``) and ``end`` to
    ``path``, one line each."""

    def __init__(self, path: str):
        self.path = Path(path)

    def _write(self, line: str) -> None:
        with self.path.open("a") as out:
            out.write(line + "\n")

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._write("start")

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._write(f"round_start {trainer.current_epoch}")

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._write(f"round_end {trainer.current_epoch}")

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._write("end")


class StepHooks(L.Callback):
    """Appends ``step N B`` (the round, the round's Lightning step) to ``path`` at each training step's end."""

    def __init__(self, path: str):
        self.path = Path(path)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: object, batch: object,
                           batch_idx: int) -> None:
        with self.path.open("a") as out:
            out.write(f"step {trainer.current_epoch} {batch_idx}\n")
