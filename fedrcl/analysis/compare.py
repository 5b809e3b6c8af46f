"""Comparing two methods' curves: where one passes the other.

The paper's headline is a crossing: FedRCL below FedAvg early, above it later. ``crossing`` finds it on two
logged curves (e.g. ``val/acc_ema`` of two runs), on the rounds both logged.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from fedrcl.analysis.runs import Curve

__all__ = ["Crossing", "crossing"]


@dataclass(frozen=True)
class Crossing:
    """Where ``challenger`` is above ``reference`` on their common rounds.

    Attributes:
        first_above: the first common round where the challenger is strictly above; ``None`` if never.
        above_from: the first common round from which it stays strictly above through ``last_common``;
            ``None`` if it is not above at ``last_common``.
        last_common: the last round both curves logged.
        gap_at_last: challenger minus reference at ``last_common``.
    """

    first_above: Optional[int]
    above_from: Optional[int]
    last_common: int
    gap_at_last: float


def crossing(reference: Curve, challenger: Curve) -> Crossing:
    """The rounds where ``challenger`` passes ``reference`` (both ``(rounds, values)``, rounds ascending)."""
    rounds, ref_idx, ch_idx = np.intersect1d(reference[0], challenger[0], return_indices=True)
    if not len(rounds):
        raise ValueError("the two curves have no round in common")
    gaps = np.asarray(challenger[1])[ch_idx] - np.asarray(reference[1])[ref_idx]
    above = gaps > 0
    first = int(rounds[np.argmax(above)]) if above.any() else None
    # the last round that is not above, and the round after it
    below = np.flatnonzero(~above)
    if above[-1]:
        above_from = int(rounds[below[-1] + 1]) if len(below) else int(rounds[0])
    else:
        above_from = None
    return Crossing(first, above_from, int(rounds[-1]), float(gaps[-1]))
