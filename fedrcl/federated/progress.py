"""Progress of a federated run: a bar per round on a terminal, one line per round in a log file or pipe.

``round_progress()`` picks the one that fits ``sys.stderr`` (where tqdm draws): a redrawn bar is what a
terminal wants, but in a log file every redraw is a new line (498 KB for the 60-round quickstart). With
``--trainer.enable_progress_bar false`` a run still prints its line per round (``RoundLog``), unless its
logger is off too (``--trainer.logger false``).

``quiet_lightning()`` silences what Lightning prints that says nothing about a federated run: the tip to
install another logging product, the ``LeafSpec`` deprecation raised inside Lightning itself (torch 2.10+),
and the advice to lower ``log_every_n_steps`` (a round's metrics are logged once per round, whatever the
step count). Lightning's other lines stay: the seed, the devices, the checkpoint a run restores from.
"""
from __future__ import annotations

import logging
import sys
import time
import warnings
from typing import Any, Optional

import lightning as L
from lightning.pytorch.callbacks import ProgressBar, TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import convert_inf

__all__ = ["RoundProgressBar", "RoundLines", "RoundLog", "round_progress", "quiet_lightning"]


def round_line(trainer: L.Trainer, metrics: dict[str, Any], seconds: float) -> str:
    """``Round 12/60  val/acc 0.9306  val/acc_ema 0.8812  (0.41 s)``."""
    shown = {k: v for k, v in metrics.items() if k != "v_num"}
    text = "".join(f"  {k} {v:.4f}" if isinstance(v, float) else f"  {k} {v}" for k, v in shown.items())
    return f"Round {trainer.current_epoch + 1}/{trainer.max_epochs}{text}  ({seconds:.2f} s)"


class RoundProgressBar(TQDMProgressBar):
    """Lightning's progress bar, labelled by round (and never by Lightning's 0-based epoch)."""

    def on_train_epoch_start(self, trainer: L.Trainer, *_: Any) -> None:
        if self._leave:
            self.train_progress_bar = self.init_train_tqdm()
        bar = self.train_progress_bar
        # Label first, then reset: reset() draws the bar, which in a log file is a line of its own.
        bar.set_description(f"Round {trainer.current_epoch + 1}/{trainer.max_epochs}", refresh=False)
        bar.reset(total=convert_inf(self.total_train_batches))


class RoundLines(ProgressBar):
    """One line per round on stderr, after the round's evaluation::

        Round 12/60  val/acc 0.9306  val/acc_ema 0.8812  (0.41 s)

    The metrics are the progress bar's (``prog_bar=True`` logs); evaluation runs print nothing here
    (Lightning prints their result table).
    """

    def __init__(self) -> None:
        super().__init__()
        self._enabled = True
        self._start = 0.0

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start = time.perf_counter()

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self._enabled:
            return
        seconds = time.perf_counter() - self._start
        print(round_line(trainer, self.get_metrics(trainer, pl_module), seconds), file=sys.stderr, flush=True)


class RoundLog(L.Callback):
    """``RoundLines`` for a run without a progress bar (Lightning refuses a ``ProgressBar`` callback then)."""

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start = time.perf_counter()

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        metrics = {k: v.item() if hasattr(v, "item") else v for k, v in trainer.progress_bar_metrics.items()}
        if trainer.is_global_zero:
            print(round_line(trainer, metrics, time.perf_counter() - self._start), file=sys.stderr, flush=True)


def round_progress(enable_progress_bar: Optional[bool] = True, logger: Any = None) -> Optional[L.Callback]:
    """A ``RoundProgressBar`` when stderr is a terminal, else ``RoundLines``; without a progress bar,
    ``RoundLog`` (``None`` if the logger is off too)."""
    if enable_progress_bar is False:
        return None if logger is False else RoundLog()
    isatty = getattr(sys.stderr, "isatty", None)
    return RoundProgressBar() if isatty is not None and isatty() else RoundLines()


class _NoAdverts(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("\N{ELECTRIC LIGHT BULB} Tip:")


def quiet_lightning() -> None:
    """Silence Lightning's lines that are noise for a federated run (see the module docstring); idempotent."""
    log = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if not any(isinstance(f, _NoAdverts) for f in log.filters):
        log.addFilter(_NoAdverts())
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)` is deprecated")
    warnings.filterwarnings("ignore", message=r".*is smaller than the logging interval Trainer\(log_every_n_steps")
