"""The validation split: a share of every training client's samples held out, pooled as the validation set.

A sweep chooses its setting by the accuracy on this set, never on the test set (``data.val_fraction``,
``fedrcl report --select val``). The hold-out is per client, so the validation set has the federation's own
label mix and the test set stays untouched; a held-out sample never trains. Which samples are held out depends
only on the client's part, the fraction and the data seed (not on the method, the round or a resume).
"""
from __future__ import annotations

import numpy as np

# The evaluation tags, in the order a round line shows them: ``val/*`` the validation set (the test set without a
# validation split), ``test/*`` the test set (with one).
ACCURACIES = ("val/acc", "val/acc_ema", "test/acc", "test/acc_ema")
# A stream key that no other use of the data seed draws from (``np.random.SeedSequence([seed, KEY, client])``).
HOLD_OUT_STREAM = 7


def held_out_count(num_samples: int, fraction: float) -> int:
    """How many of a client's ``num_samples`` are held out: ``round(fraction * n)`` (half to even, Python's
    ``round``), at least one when the fraction is positive, and never all (a client keeps one sample to train on)."""
    if fraction <= 0 or num_samples < 2:
        return 0
    return min(max(1, round(fraction * num_samples)), num_samples - 1)


def hold_out(parts: list[np.ndarray], fraction: float, seed: int) -> tuple[list[np.ndarray], np.ndarray]:
    """Client ``k``'s part split into ``held_out_count(len, fraction)`` samples drawn without replacement by
    ``SeedSequence([seed, HOLD_OUT_STREAM, k])`` and the rest. Returns the training parts (each in its given
    order, the held-out samples removed) and the validation set: every client's held-out indices, client after
    client, each client's ascending."""
    if not 0 <= fraction < 1:
        raise ValueError(f"data.val_fraction must be in [0, 1), got {fraction}")
    train, held = [], []
    for k, part in enumerate(parts):
        part = np.asarray(part, dtype=np.int64)
        count = held_out_count(len(part), fraction)
        rng = np.random.default_rng(np.random.SeedSequence([seed, HOLD_OUT_STREAM, k]))
        chosen = np.zeros(len(part), dtype=bool)
        chosen[rng.choice(len(part), size=count, replace=False)] = True
        train.append(part[~chosen])
        held.append(np.sort(part[chosen]))
    return train, np.concatenate(held) if held else np.zeros(0, dtype=np.int64)
