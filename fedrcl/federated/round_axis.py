"""Loggers plot every metric against the round (1-based), not against Lightning's optimizer-step count.

Lightning's documented way is to log a metric named ``step``; that metric then also lands in
``trainer.callback_metrics``, and every ``ModelCheckpoint`` file name with ``{step}`` shows the round
instead of the step. Instead, each logger's ``log_metrics`` is given the round as its step.
"""
from __future__ import annotations

import functools
from typing import Any, Optional

import lightning as L


def log_against_rounds(trainer: L.Trainer) -> None:
    """Make every logger of ``trainer`` record metrics at step ``trainer.current_epoch + 1`` (idempotent).

    ``logger.log_metrics.__wrapped__`` is the logger's own method, for metrics of a round already ended."""
    for logger in trainer.loggers:
        if getattr(logger.log_metrics, "against_rounds", False):
            continue
        original = logger.log_metrics

        @functools.wraps(original)
        def log_metrics(metrics: dict[str, Any], step: Optional[int] = None, _original=original) -> None:
            _original({k: v for k, v in metrics.items() if k != "epoch"}, step=trainer.current_epoch + 1)

        log_metrics.against_rounds = True  # type: ignore[attr-defined]  # marks the wrapper
        logger.log_metrics = log_metrics  # type: ignore[method-assign]  # the logger's own, wrapped
