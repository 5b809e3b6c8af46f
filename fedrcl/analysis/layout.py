"""TensorBoard's Custom Scalars layout of a fedrcl run: test accuracy and its EMA first.

TensorBoard's Scalars tab orders the cards by tag prefix (``comm/``, ``repr/``, ``time/``, ``train/``,
``val/``), so the table metric ``val/acc_ema`` comes last, after the byte counters. Its Custom Scalars tab
shows instead the layout a run writes into its event file: here ``val/acc`` and ``val/acc_ema`` on one chart
first, then the loss and its parts, the learning rate, the seconds per round and the bytes sent. The
``FederatedTrainer`` adds ``ScalarLayout`` to every run; it writes the layout once, when training starts
(a resumed run writes it into its new version folder).
"""
from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.loggers import TensorBoardLogger

__all__ = ["SCALAR_LAYOUT", "ScalarLayout"]

SCALAR_LAYOUT: dict[str, dict[str, list[Any]]] = {
    "accuracy": {"val/acc and val/acc_ema (EMA 0.9, the paper's table metric)":
                 ["Multiline", [r"^val/acc$", r"^val/acc_ema$"]]},
    "loss": {"train/loss and its parts": ["Multiline", [r"^train/loss"]]},
    "learning rate": {"train/lr": ["Multiline", [r"^train/lr$"]]},
    "seconds per round": {"time/": ["Multiline", [r"^time/"]]},
    "bytes": {"comm/": ["Multiline", [r"^comm/"]]},
}
"""``SummaryWriter.add_custom_scalars``' layout: ``{category: {chart title: ["Multiline", [tag regexes]]}}``,
categories in the order TensorBoard shows them."""


class ScalarLayout(L.Callback):
    """Writes ``SCALAR_LAYOUT`` to the run's TensorBoard loggers at the start of training (rank 0 only)."""

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_custom_scalars(SCALAR_LAYOUT)
