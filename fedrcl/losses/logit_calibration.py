"""Logit-calibrated cross-entropy of FedLC.

Reference: J. Zhang, Z. Li, B. Li, J. Xu, S. Wu, S. Ding, C. Wu, "Federated Learning with Label
Distribution Skew via Logits Calibration", ICML 2022.

With the client's label count ``n_c`` of each class ``c`` and logits ``f``:

    L = -log softmax(f - tau * n^(-1/4))_y = CE(f_c - tau * n_c^(-1/4), y)

A rare class gets a large margin subtracted, so the local model is pushed less hard to raise it above
the frequent ones.

Classes the client does not hold (``n_c = 0``): ``n_c^(-1/4) = inf``, so for ``tau > 0`` their calibrated
logit is ``-inf``: they leave the softmax (probability 0, gradient 0 to their logits). This is the limit of
the paper's formula, and it is what the paper argues for: local training should not push down the
logits of classes the client never sees. ``tau = 0`` gives plain cross-entropy. A label of a class whose
count is 0 gives an infinite loss, which cannot happen when the counts are the client's own labels.
"""
from __future__ import annotations

from typing import Union

import torch
import torch.nn.functional as F
from torch import Tensor


def calibration_offsets(class_counts: Tensor, tau: Union[float, Tensor]) -> Tensor:
    """``tau * n_c^(-1/4)`` per class (``inf`` where ``n_c = 0`` and ``tau > 0``; all 0 when ``tau = 0``).

    ``tau`` may be a 0-dim tensor (a sweep's runs trained together each set their own, ``fedrcl sweep``): the
    same values without a branch on it (its sign is the caller's to check)."""
    if class_counts.dim() != 1:
        raise ValueError(f"class_counts must be 1-D [C], got shape {tuple(class_counts.shape)}")
    counts = class_counts.to(torch.promote_types(class_counts.dtype, torch.float32))
    if isinstance(tau, Tensor):
        held = torch.where(counts > 0, counts, torch.ones_like(counts)).pow(-0.25)  # no inf * 0 where tau = 0
        return torch.where(counts > 0, tau * held, torch.where(tau > 0, torch.inf, 0.0).to(counts.dtype))
    if tau < 0:
        raise ValueError(f"tau must be >= 0, got {tau}")
    if tau == 0:
        return torch.zeros_like(counts)
    return tau * counts.pow(-0.25)


def calibrated_cross_entropy(logits: Tensor, labels: Tensor, class_counts: Tensor,
                             tau: Union[float, Tensor] = 1.0) -> Tensor:
    """Mean over the batch of ``CE(logits - tau * class_counts^(-1/4), labels)``.

    ``logits`` is ``[B, C]``, ``labels`` ``[B]``, ``class_counts`` ``[C]`` (the client's label counts).
    """
    if logits.dim() != 2 or class_counts.shape != logits.shape[1:]:
        raise ValueError(f"logits [B, C] and class_counts [C] do not match: {tuple(logits.shape)} vs "
                         f"{tuple(class_counts.shape)}")
    return F.cross_entropy(logits - calibration_offsets(class_counts, tau), labels)
