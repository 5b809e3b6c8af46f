"""MoFedSAM client (Qu et al., "Generalized Federated Learning via Sharpness Aware Minimization", ICML 2022,
Algorithm 2): FedSAM's step mixed with FedCM's client-level momentum.

    g = grad F_i(w),   eps = rho g / ||g||   (adaptive: ASAM's),
    v = alpha * grad F_i(w + eps) + (1 - alpha) * Delta_t,   w <- w - lr * v

``Delta_t`` is FedCM's (the last global update over its local steps' lrs, sent with the weights:
``fedrcl.algorithms.fedcm``), the perturbation FedSAM's (``fedrcl.losses.sharpness``). Bytes: FedCM's (twice
FedAvg's download); two gradients per step; every client the same K steps (``data.local_iters_per_epoch`` set).
"""
from __future__ import annotations

from typing import Any

from torch import Tensor

from fedrcl.algorithms.fedavg import Tensors
from fedrcl.algorithms.fedcm import FedCM
from fedrcl.algorithms.fedsam import FedSAM


class MoFedSAM(FedCM, FedSAM):
    """FedCM's momentum on FedSAM's gradient (see the module docstring).

    Args:
        alpha: the SAM gradient's share of the local direction, in (0, 1]. Qu et al. (and FedCM): 0.1.
        rho: SAM's radius (>= 0). Qu et al.: 0.05 to 0.1.
    """

    def __init__(self, alpha: float = 0.1, rho: float = 0.1, **kwargs: Any):
        super().__init__(alpha=alpha, rho=rho, **kwargs)

    def local_gradient(self, params: Tensors, x: Tensor, y: Tensor) -> tuple[Tensors, Tensor, Tensors]:
        return self.sharpness_aware_gradient(params, x, y)
