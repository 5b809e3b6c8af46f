"""FitNet hints between the local model's and the global model's features.

Reference: A. Romero, N. Ballas, S. E. Kahou, A. Chassang, C. Gatta, Y. Bengio, "FitNets: Hints for Thin
Deep Nets", ICLR 2015; used on top of FedAvg as a baseline by FedMLB (Kim et al., ICML 2022) and FedRCL.

Per feature level ``l``, with local features ``h_l`` and the global model's ``g_l`` (``[B, C_l]``):

    hint_l = MSE(h_l, g_l) = mean over batch and channels of (h_l - g_l)^2

Student and teacher share one architecture, so no regressor is needed between them.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor


def hint_losses(local_features: Sequence[Tensor], global_features: Sequence[Tensor]) -> Tensor:
    """``[L]``: the MSE between local and global features at each level (global ones are constants)."""
    if len(local_features) != len(global_features) or not local_features:
        raise ValueError(f"need the same, non-zero number of local and global levels, got "
                         f"{len(local_features)} and {len(global_features)}")
    losses = []
    for level, (h, g) in enumerate(zip(local_features, global_features)):
        if h.shape != g.shape:
            raise ValueError(f"level {level}: local features {tuple(h.shape)} vs global {tuple(g.shape)}")
        dtype = torch.promote_types(h.dtype, torch.float32)
        losses.append(F.mse_loss(h.to(dtype), g.detach().to(dtype)))
    return torch.stack(losses)
