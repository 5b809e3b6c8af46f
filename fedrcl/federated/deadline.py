"""``trainer.max_time`` at round boundaries: a run stopped by its time limit ends on a whole round.

Lightning turns ``max_time`` into its ``Timer`` callback checked after every *step*, which would stop a
federated round half-way: some clients trained, nothing aggregated, a client's local weights in the model.
A ``FederatedTrainer`` checks the same ``Timer`` after every *round* instead (``interval="epoch"``: one
Lightning epoch is one round), once the round's evaluation is logged, and ``RoundCheckpoint`` saves the round
it stops after (``stopped_after_round``), so ``--ckpt_path`` continues it on the curve of a run that never
stopped. As in Lightning, the time counted is training time, and a resumed run goes on counting from the time
its checkpoint recorded (the Timer's state is in the checkpoint): ``max_time`` is the run's whole budget.
``training_seconds`` reads that time from a checkpoint, for a limit per session (``bench/gpu_lease.sh``).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any, Optional, Union

import lightning as L
from lightning.pytorch.callbacks import Callback, Timer

MaxTime = Union[str, timedelta, dict[str, int]]


def round_timer(max_time: Optional[MaxTime], callbacks: Sequence[Callback]) -> list[Callback]:
    """The callbacks that enforce ``max_time``: Lightning's ``Timer`` checked after each round; none without
    ``max_time``, or when ``callbacks`` already hold a ``Timer`` (Lightning's rule: the user's own wins)."""
    if max_time is None or any(isinstance(c, Timer) for c in callbacks):
        return []
    return [Timer(duration=max_time, interval="epoch")]


def stopped_after_round(trainer: L.Trainer) -> bool:
    """Whether training stops after this epoch and the epoch ran all of its round's steps (a stop asked for
    in mid-round, e.g. by a step-interval ``Timer`` of the user's, leaves no round to checkpoint)."""
    done = trainer.fit_loop.epoch_loop.batch_progress.current.completed
    return bool(trainer.should_stop) and done >= trainer.num_training_batches


def training_seconds(checkpoint: Mapping[str, Any]) -> float:
    """Training seconds a checkpoint's ``Timer`` had counted (0 when it was written without one)."""
    timer = checkpoint.get("callbacks", {}).get("Timer", {})
    return float(timer.get("time_elapsed", {}).get("train", 0.0))
