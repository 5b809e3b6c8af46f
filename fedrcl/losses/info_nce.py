"""Self-supervised InfoNCE (NT-Xent) between two augmented views of a batch (FedCL, FedRCL's Table 3).

Reference: T. Chen, S. Kornblith, M. Norouzi, G. Hinton, "A Simple Framework for Contrastive Learning of
Visual Representations" (SimCLR), ICML 2020.

With ``u_1..u_2B`` the L2-normalised representations of both views (``u_i`` and ``u_{i+B}`` are views of one
image) and ``p(i)`` the index of ``i``'s other view:

    L = (1/2B) sum_i -log( e^{u_i.u_p(i)/t} / sum_{k != i} e^{u_i.u_k/t} )

Labels are not used: every other image of the batch, of any class, is a negative.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def info_nce(view1: Tensor, view2: Tensor, temperature: float = 0.05) -> Tensor:
    """NT-Xent between ``view1`` and ``view2`` (``[B, D]`` each, row ``i`` of both from one image)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if view1.dim() != 2 or view1.shape != view2.shape or view1.shape[0] < 1:
        raise ValueError(f"views must be two non-empty [B, D] of one shape, got {tuple(view1.shape)} and "
                         f"{tuple(view2.shape)}")
    b = view1.shape[0]
    dtype = torch.promote_types(view1.dtype, torch.float32)
    u = F.normalize(torch.cat([view1, view2]).to(dtype), dim=1)
    self_pairs = torch.eye(2 * b, dtype=torch.bool, device=u.device)
    sim = (u @ u.T / temperature).masked_fill(self_pairs, float("-inf"))  # not in place: runs under vmap
    partner = torch.cat([torch.arange(b, 2 * b), torch.arange(b)]).to(u.device)
    return F.cross_entropy(sim, partner)
