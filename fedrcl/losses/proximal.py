"""Proximal term of FedProx.

Reference: T. Li, A. K. Sahu, M. Zaheer, M. Sanjabi, A. Talwalkar, V. Smith, "Federated Optimization in
Heterogeneous Networks", MLSys 2020.

    prox(w, w_g) = sum_i ||w_i - w_g,i||^2

over the model's parameter tensors ``w_i`` and the round's global weights ``w_g,i``; FedProx adds
``mu / 2 * prox`` to the client's loss.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor


def squared_distance(weights: Iterable[Tensor], anchors: Iterable[Tensor]) -> Tensor:
    """``sum_i ||weights_i - anchors_i||^2`` (scalar, float32 or wider); gradients flow into ``weights`` only.

    The two sequences must pair tensors of equal shapes, in the same order.
    """
    total = None
    for w, a in zip(weights, anchors, strict=True):
        if w.shape != a.shape:
            raise ValueError(f"weight of shape {tuple(w.shape)} paired with an anchor of shape {tuple(a.shape)}")
        term = (w - a.detach()).pow(2).sum(dtype=torch.promote_types(w.dtype, torch.float32))
        total = term if total is None else total + term
    if total is None:
        raise ValueError("squared_distance needs at least one weight tensor")
    return total
