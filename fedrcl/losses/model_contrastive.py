"""MOON's model-contrastive loss.

Reference: Q. Li, B. He, D. Song, "Model-Contrastive Federated Learning", CVPR 2021, eq. (3).

With ``z`` the local model's representation of a sample, ``z_glob`` the round's global model's and ``z_prev``
the client's previous local model's, and ``sim`` the cosine similarity:

    l_con = -log( e^{sim(z, z_glob)/t} / (e^{sim(z, z_glob)/t} + e^{sim(z, z_prev)/t}) ),  mean over the batch

Both other representations are constants. Without a previous model (``z_prev=None``: the client's first
participation) there is no negative and the term is ``-log(1) = 0``, as in the MOON code's first round,
whose pool of previous models is still empty.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor


def model_contrastive_loss(z: Tensor, z_global: Tensor, z_prev: Optional[Tensor],
                           temperature: float = 0.5) -> Tensor:
    """``l_con`` averaged over the batch (scalar); ``z*`` are ``[B, D]``."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if z.dim() != 2 or z.shape != z_global.shape or (z_prev is not None and z_prev.shape != z.shape):
        raise ValueError("z, z_global and z_prev must all be [B, D] of one shape")
    if z_prev is None:
        return z.sum() * 0.0  # keeps the graph and the device; no negative, no loss
    dtype = torch.promote_types(z.dtype, torch.float32)
    z = z.to(dtype)
    pos = F.cosine_similarity(z, z_global.detach().to(dtype), dim=1)
    neg = F.cosine_similarity(z, z_prev.detach().to(dtype), dim=1)
    logits = torch.stack([pos, neg], dim=1) / temperature
    return -F.log_softmax(logits, dim=1)[:, 0].mean()
