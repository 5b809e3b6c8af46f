"""FedSpeed's local direction and prox-correction (Sun et al., "FedSpeed: Larger Local Interval, Less
Communication Round, and Higher Generalization Accuracy", ICLR 2023, Algorithm 1).

At a local step from ``w`` (the round's global weights ``x``, the client's prox-correction ``g_hat``):

    g1 = grad F_i(w),   g2 = grad F_i(w + rho g1 / ||g1||),   g~ = (1 - alpha) g1 + alpha g2
    w <- w - lr * (g~ - g_hat + (w - x) / lam)

and after the K steps, ending at ``y``: ``g_hat <- g_hat - (y - x) / lam``; the client sends ``y - lam g_hat``
(with the new ``g_hat``), whose mean over the round's clients is the new global model.
"""
from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor


def fedspeed_direction(g1: Mapping[str, Tensor], g2: Mapping[str, Tensor], correction: Mapping[str, Tensor],
                       weights: Mapping[str, Tensor], anchor: Mapping[str, Tensor], alpha: float, lam: float
                       ) -> dict[str, Tensor]:
    """``(1 - alpha) g1 + alpha g2 - g_hat + (w - x) / lam`` per tensor (``correction``: ``g_hat``; ``anchor``:
    ``x``)."""
    return {k: (1 - alpha) * g1[k] + alpha * g2[k] - correction[k] + (w - anchor[k].to(w.dtype)) / lam
            for k, w in weights.items()}


def prox_correction_update(correction: Tensor, end: Tensor, start: Tensor, lam: float) -> Tensor:
    """``g_hat - (y - x) / lam``: the client's prox-correction after a round that ended at ``y`` from ``x``."""
    return correction - (end - start) / lam


def corrected_model(end: Tensor, correction: Tensor, lam: float) -> Tensor:
    """``y - lam g_hat``: the model a FedSpeed client sends (``g_hat`` already updated)."""
    return end - lam * correction
