"""The divergence guard: a non-finite loss or non-finite weights stop the run, naming round and client.

Checked once per client, never per step: the round loop sums a client's step losses on the device and asks
``all_finite`` (one host synchronisation) when the client's weights are folded into the round's sum; the new
global weights are checked once per round, after the server step. The run stops before the round's
checkpoint, so the last checkpoint on disk is the last good one, and ``--ckpt_path last`` finds it.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Optional

import torch
from torch import Tensor


class DivergenceError(RuntimeError):
    """Training produced a non-finite loss or non-finite weights."""


def all_finite(tensors: Iterable[Tensor]) -> bool:
    """Whether every floating-point entry of ``tensors`` is finite (one host synchronisation in all)."""
    flags = [torch.isfinite(t).all() for t in tensors if t.is_floating_point()]
    return bool(torch.stack(flags).all()) if flags else True


def client_failure(loss_sum: Optional[Tensor], weights: Mapping[str, Tensor]) -> Optional[str]:
    """What went wrong on a client that just finished: "non-finite loss", "non-finite weights" or ``None``."""
    if loss_sum is not None and not all_finite([loss_sum]):
        return "non-finite loss"
    if not all_finite(weights.values()):
        return "non-finite weights"
    return None


def divergence_message(round_idx: int, failures: Mapping[int, str], hint: str) -> str:
    """The one line a diverged run stops with (``round_idx`` 0-based, shown 1-based as in the logs)."""
    clients = ", ".join(f"client {k} ({why})" for k, why in failures.items()) or "a client on another process"
    return f"training diverged in round {round_idx + 1}: {clients}. Nothing of this round was saved. {hint}"
