"""TensorBoard's Custom Scalars layout of a fedrcl run: test accuracy and its EMA first.

TensorBoard's Scalars tab orders the cards by tag prefix (``comm/``, ``repr/``, ``time/``, ``train/``,
``val/``), so the table metric ``val/acc_ema`` comes last, after the byte counters. Its Custom Scalars tab
shows instead the layout a run writes into its event file: here ``val/acc`` and ``val/acc_ema`` on one chart
first, then the loss and its parts, the learning rate, the seconds per round and the bytes sent. The
``FederatedTrainer`` adds ``ScalarLayout`` to every run; it writes the layout once, when training starts
(a resumed run writes it into its new version folder).

TensorBoard opens on its Time Series tab, whose groups of cards (a tag's first ``/`` part) come in name order
with the first two expanded: ``comm/`` and ``time/``, with ``val/`` last and collapsed. So each evaluation
also writes ``val/acc`` and ``val/acc_ema`` under ``accuracy/`` (``ACCURACY_FIRST``): the first group, open
above the others in the Time Series and Scalars tabs (``docs/tensorboard_accuracy_first.png``). Only TensorBoard shows the copies: ``fedrcl report``, ``fedrcl plot``, the notebooks and the configs keep
reading and monitoring ``val/acc`` and ``val/acc_ema``, the one name of each metric.
"""
from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.loggers import TensorBoardLogger

__all__ = ["ACCURACY_FIRST", "SCALAR_LAYOUT", "ScalarLayout"]

ACCURACY_FIRST = {"val/acc": "accuracy/val/acc", "val/acc_ema": "accuracy/val/acc_ema"}
"""The metrics TensorBoard shows first -> the tag of their copy in its first group of cards."""

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
    """Writes ``SCALAR_LAYOUT`` to the run's TensorBoard loggers at the start of training, and after each
    evaluation the ``ACCURACY_FIRST`` copies of its accuracy (rank 0 only)."""

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero or trainer.sanity_checking:
            return
        copies = {copy: float(trainer.callback_metrics[tag]) for tag, copy in ACCURACY_FIRST.items()
                  if tag in trainer.callback_metrics}
        for logger in trainer.loggers:
            if copies and isinstance(logger, TensorBoardLogger):
                logger.log_metrics(copies)  # at the round, as every metric (fedrcl.federated.round_axis)

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_custom_scalars(SCALAR_LAYOUT)
