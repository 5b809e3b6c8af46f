"""Progress of a federated run: a bar per round on a terminal, one line per round in a log file or pipe.

``round_progress()`` picks the one that fits ``sys.stderr`` (where tqdm draws): a redrawn bar is what a
terminal wants, but in a log file every redraw is a new line (498 KB for the 60-round quickstart).
"""
from __future__ import annotations

import sys
import time
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ProgressBar, TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import convert_inf

__all__ = ["RoundProgressBar", "RoundLines", "round_progress"]


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
        shown = {k: v for k, v in self.get_metrics(trainer, pl_module).items() if k != "v_num"}
        text = "".join(f"  {k} {v:.4f}" if isinstance(v, float) else f"  {k} {v}" for k, v in shown.items())
        print(f"Round {trainer.current_epoch + 1}/{trainer.max_epochs}{text}  ({seconds:.2f} s)",
              file=sys.stderr, flush=True)


def round_progress() -> ProgressBar:
    """A ``RoundProgressBar`` when stderr is a terminal, else ``RoundLines``."""
    isatty = getattr(sys.stderr, "isatty", None)
    return RoundProgressBar() if isatty is not None and isatty() else RoundLines()
