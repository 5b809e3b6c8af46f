"""Per-client clipping of a round's update, and adaptive clipping: pure functions.

DP-FedAvg (McMahan et al., ICLR 2018) bounds each client's influence on the round by clipping its update
``delta_k = w_k - sent`` (every floating-point entry the server averages, as one vector) to L2 norm ``C``:
``delta_k * min(1, C / ||delta_k||)``. Adaptive clipping (Andrew et al., "Differentially Private Learning with
Adaptive Clipping", NeurIPS 2021, geometric update) moves ``C`` towards the ``gamma`` quantile of the update
norms: ``C <- C * exp(-eta * (b - gamma))``, ``b`` the (noised) fraction of clients whose update was *not*
clipped (``||delta_k|| <= C``): more unclipped clients than the target lowers ``C``.
"""
from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import Tensor


def update_norm(weights: Mapping[str, Tensor], sent: Mapping[str, Tensor]) -> float:
    """``||w - sent||_2`` over every floating-point entry of ``sent``, summed in float64."""
    squares = [(weights[k].double() - v.double()).square().sum() for k, v in sent.items() if v.is_floating_point()]
    return math.sqrt(float(torch.stack(squares).sum())) if squares else 0.0


def clip_update(weights: Mapping[str, Tensor], sent: Mapping[str, Tensor], clip_norm: float
                ) -> tuple[Mapping[str, Tensor], float]:
    """``sent + (w - sent) * min(1, clip_norm / ||w - sent||)`` and the update's norm before clipping.

    An update within the norm returns ``weights`` itself (not a copy, not recomputed: bit for bit what the
    client sent); a clipped one is computed in float64 and cast back to each entry's dtype."""
    norm = update_norm(weights, sent)
    if norm <= clip_norm:
        return weights, norm
    factor = clip_norm / norm
    clipped = {k: (v.double() + (weights[k].double() - v.double()) * factor).to(v.dtype)
               if v.is_floating_point() else weights[k] for k, v in sent.items()}
    return clipped, norm


def adaptive_clip_norm(clip_norm: float, unclipped_fraction: float, target_quantile: float,
                       learning_rate: float) -> float:
    """Andrew et al.'s geometric update: ``C * exp(-learning_rate * (unclipped_fraction - target_quantile))``."""
    return clip_norm * math.exp(-learning_rate * (unclipped_fraction - target_quantile))
