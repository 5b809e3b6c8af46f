"""FedProc's global prototypical contrastive loss and the class statistics clients report for it.

Reference: X. Mu, Y. Shen, K. Cheng, X. Geng, J. Fu, T. Zhang, Z. Zhang, "FedProc: Prototypical Contrastive
Federated Learning on Non-IID Data", Future Generation Computer Systems 143, 2023.

With ``z`` a sample's representation, ``c_j`` the global prototype of class ``j`` (the count-weighted mean of
the clients' class-mean representations) and ``sim`` the cosine similarity:

    L_pc = -log( e^{sim(z, c_y)/t} / sum_{j in A} e^{sim(z, c_j)/t} ),  mean over samples with y in A

``A`` is the set of classes that have a prototype (some client has reported samples of that class).
Samples of classes outside ``A`` add nothing; without any prototype the loss is 0.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def class_feature_sums(features: Tensor, labels: Tensor, num_classes: int) -> tuple[Tensor, Tensor]:
    """``([C, D], [C])``: per-class sums of ``features`` (``[B, D]``) and per-class sample counts."""
    sums = torch.zeros(num_classes, features.shape[1], dtype=features.dtype, device=features.device)
    sums.index_add_(0, labels, features)
    return sums, torch.bincount(labels, minlength=num_classes).to(features.dtype)


def prototype_contrastive_loss(z: Tensor, labels: Tensor, prototypes: Tensor, available: Tensor,
                               temperature: float = 1.0) -> Tensor:
    """``L_pc`` (scalar); ``prototypes`` ``[C, D]``, ``available`` ``[C]`` bool (the set ``A``)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    # Masks and fixed shapes, no data-dependent branch: it runs under torch.func.vmap (batched clients).
    keep = available[labels]
    dtype = torch.promote_types(z.dtype, torch.float32)
    sim = F.normalize(z.to(dtype), dim=1) @ F.normalize(prototypes.to(dtype), dim=1).T / temperature
    # A finite floor rather than -inf: exp() of it is 0 all the same, and a row with no class stays finite.
    sim = sim.masked_fill(~available, torch.finfo(dtype).min / 2)
    per_sample = -sim.log_softmax(dim=1).gather(1, labels.unsqueeze(1)).squeeze(1)
    per_sample = torch.where(keep, per_sample, torch.zeros_like(per_sample))
    return per_sample.sum() / keep.sum().clamp(min=1)
