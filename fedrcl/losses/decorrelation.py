"""Decorrelation penalty of FedDecorr.

Reference: Y. Shi, J. Liang, W. Zhang, V. Y. F. Tan, S. Bai, "Towards Understanding and Mitigating
Dimensional Collapse in Heterogeneous Federated Learning", ICLR 2023.

For a batch of representations ``z`` (``[N, d]``), standardise each dimension over the batch
(``z_hat = (z - mean) / std``) and take the correlation matrix ``K = z_hat^T z_hat / N``:

    L = ||K||_F^2 / d^2

The paper's definition, followed here. The authors' released code differs in two details: it averages
only the off-diagonal entries (the diagonal is the constant 1 here, so it adds ``1 / d`` and no gradient)
and divides the squared entries of ``z_hat^T z_hat`` by ``N`` rather than ``N^2``, which scales the
penalty by ``N`` (absorbed into its coefficient).
"""
from __future__ import annotations

import torch
from torch import Tensor


def decorrelation_loss(z: Tensor, eps: float = 1e-8) -> Tensor:
    """``||K||_F^2 / d^2`` of the correlation matrix ``K`` of ``z`` (``[N, d]``), in at least float32.

    The standard deviation is the biased one (so ``K`` has a unit diagonal); ``eps`` is added to the
    variance, so a constant dimension standardises to 0 and contributes nothing. A batch of one sample
    has no correlations: the loss is 0.
    """
    if z.dim() != 2:
        raise ValueError(f"z must be 2-D [N, d], got shape {tuple(z.shape)}")
    n, d = z.shape
    z = z.to(torch.promote_types(z.dtype, torch.float32))
    if n < 2:
        return z.sum() * 0
    centred = z - z.mean(dim=0, keepdim=True)
    z_hat = centred / torch.sqrt(centred.pow(2).mean(dim=0, keepdim=True) + eps)
    corr = z_hat.T @ z_hat / n
    return corr.pow(2).sum() / d ** 2
