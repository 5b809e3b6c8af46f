"""FedMLB's losses on the hybrid pathways.

Reference: J. Kim, G. Kim, B. Han, "Multi-Level Branched Regularization for Federated Learning", ICML 2022.

The local model's main pathway gives logits ``z``; hybrid pathway ``k`` (local blocks up to level ``k``,
then the frozen global model's blocks) gives ``z_k``. Per pathway:

    CE_k = CE(z_k, y)
    KL_k = KL( softmax(z_k / T) || softmax(z / T) ) = sum_c p_k(c) log(p_k(c) / p(c)),  mean over the batch

The hybrid output is the soft target of the main pathway; gradients flow through both (the global blocks
are frozen, but the local blocks below the graft point learn from both terms), as in the authors' code.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor


def hybrid_branch_losses(main_logits: Tensor, branch_logits: Sequence[Tensor], labels: Tensor,
                         temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """``([K], [K])``: the cross-entropy of each hybrid pathway and its KL to the main pathway."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if not branch_logits:
        raise ValueError("need at least one hybrid pathway")
    dtype = torch.promote_types(main_logits.dtype, torch.float32)
    log_p_main = F.log_softmax(main_logits.to(dtype) / temperature, dim=1)
    ces, kls = [], []
    for z in branch_logits:
        if z.shape != main_logits.shape:
            raise ValueError(f"hybrid logits {tuple(z.shape)} vs main {tuple(main_logits.shape)}")
        z = z.to(dtype)
        ces.append(F.cross_entropy(z, labels))
        # F.kl_div(log_p_main, log_p_k, reduction="batchmean", log_target=True), written out: kl_div has no
        # vmap batching rule (batched clients would loop over it).
        log_p_k = F.log_softmax(z / temperature, dim=1)
        kls.append((log_p_k.exp() * (log_p_k - log_p_main)).sum() / z.shape[0])
    return torch.stack(ces), torch.stack(kls)
