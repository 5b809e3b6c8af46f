"""FedSAM client (Qu et al., "Generalized Federated Learning via Sharpness Aware Minimization", ICML 2022;
Caldarola et al., "Improving Generalization in Federated Learning by Seeking Flat Minima", ECCV 2022, with
FedASAM): every local step at the gradient of the worst nearby point.

    g = grad F_i(w),   eps = rho g / ||g||   (adaptive: rho T_w^2 g / ||T_w g||, T_w = abs(w) + eta),
    w <- w - lr * grad F_i(w + eps)

``F_i`` is the method's whole local loss (``local_loss``: cross-entropy here, the server's client term
included), both gradients on the same batch (``fedrcl.losses.sharpness``). The engine then clips the direction,
adds weight decay and momentum and steps by the client lr, as for a gradient; the logged loss is ``F_i(w)``.
Two forward and backward passes per step; FedAvg's bytes.

Any client loss through the SAM step: a class that puts ``FedSAM`` before the loss's method, e.g.
``class FedRCLSAM(FedSAM, FedRCL): pass`` (the RCL loss, SAM's step; its options are both classes').
"""
from __future__ import annotations

from typing import Any

from torch import Tensor

from fedrcl.algorithms.fedavg import FedAvg, Tensors
from fedrcl.losses.sharpness import asam_scale, sam_perturbation


class FedSAM(FedAvg):
    """FedAvg's loss with SAM's (or ASAM's) local step (see the module docstring).

    Args:
        rho: the perturbation radius (>= 0; 0 is FedAvg's step). Qu et al.: 0.05 to 0.1; Caldarola et al.:
            SAM 0.1 (CIFAR), ASAM 0.7 with eta 0.2.
        adaptive: ASAM's scale-invariant perturbation (FedASAM) instead of SAM's.
        eta: ASAM's ``T_w = |w| + eta`` offset (adaptive only; >= 0). ASAM's default 0.01.
    """

    def __init__(self, rho: float = 0.1, adaptive: bool = False, eta: float = 0.01, **kwargs: Any):
        super().__init__(**kwargs)
        if rho < 0:
            raise ValueError(f"model.init_args.rho must be >= 0, got {rho}")
        if eta < 0:
            raise ValueError(f"model.init_args.eta must be >= 0, got {eta}")
        self.rho, self.adaptive, self.eta = rho, adaptive, eta

    def client_direction(self, params: Tensors, x: Tensor, y: Tensor) -> tuple[Tensors, Tensor, Tensors]:
        return self.sharpness_aware_gradient(params, x, y)

    def sharpness_aware_gradient(self, params: Tensors, x: Tensor, y: Tensor) -> tuple[Tensors, Tensor, Tensors]:
        """``grad F_i(w + eps)`` with the loss and its parts at ``w`` (tensor operations only: mappable)."""
        g, loss, parts = self.loss_gradient(params, x, y)
        eps = sam_perturbation(g, self.rho, asam_scale(params, self.eta) if self.adaptive else None)
        g_perturbed, _, _ = self.loss_gradient({k: p + eps[k] for k, p in params.items()}, x, y)
        return g_perturbed, loss, parts
