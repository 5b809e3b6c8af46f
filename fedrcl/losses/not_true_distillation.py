"""Not-true distillation of FedNTD.

Reference: G. Lee, M. Jeong, Y. Shin, S. Bae, S.-Y. Yun, "Preservation of the Global Knowledge by
Not-True Distillation in Federated Learning", NeurIPS 2022.

With ``q~`` the softmax at temperature ``T`` over the classes other than the true label ``y``:

    L_NTD = KL(q~_global || q~_local) = sum_{c != y} q~_g(c) * log(q~_g(c) / q~_l(c)),  mean over the batch

The global model's logits are a constant (the teacher). The authors' code multiplies this by ``T^2``
(the usual distillation gradient scaling); the paper's equation, followed here, does not. The two agree at
the default ``T = 1``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def not_true_logits(logits: Tensor, labels: Tensor) -> Tensor:
    """``logits`` (``[B, C]``) without each row's true-class column: ``[B, C - 1]``, class order kept."""
    b, c = logits.shape
    j = torch.arange(c - 1, device=logits.device).expand(b, c - 1)
    return logits.gather(1, j + (j >= labels.unsqueeze(1)).long())


def not_true_distillation(local_logits: Tensor, global_logits: Tensor, labels: Tensor,
                          temperature: float = 1.0) -> Tensor:
    """``KL(q~_global || q~_local)`` over the not-true classes, averaged over the batch (scalar)."""
    if local_logits.dim() != 2 or local_logits.shape != global_logits.shape:
        raise ValueError(f"local and global logits must both be [B, C], got {tuple(local_logits.shape)} and "
                         f"{tuple(global_logits.shape)}")
    if local_logits.shape[1] < 2:
        raise ValueError("not-true distillation needs at least 2 classes")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    dtype = torch.promote_types(local_logits.dtype, torch.float32)
    log_q_local = F.log_softmax(not_true_logits(local_logits.to(dtype), labels) / temperature, dim=1)
    log_q_global = F.log_softmax(not_true_logits(global_logits.detach().to(dtype), labels) / temperature, dim=1)
    # F.kl_div(log_q_local, log_q_global, reduction="batchmean", log_target=True), written out: kl_div has no
    # vmap batching rule (batched clients would loop over it).
    return (log_q_global.exp() * (log_q_global - log_q_local)).sum() / local_logits.shape[0]
