"""FedGAMMA client (Dai et al., "FedGAMMA: Federated Learning With Global Sharpness-Aware Minimization", IEEE
TNNLS 2023): SAM's local step with SCAFFOLD's control variates; its server half is SCAFFOLD's
(``fedrcl.server.SCAFFOLD``, ``trainer.server``).

    g = grad F_i(w),   eps = rho g / ||g||,   w <- w - lr * (grad F_i(w + eps) - c_i + c)

The perturbation comes from the local loss's own gradient, the correction ``c - c_i`` is added to the perturbed
point's (as SCAFFOLD adds it to every gradient); ``c_i`` and ``c`` are updated as SCAFFOLD's option II
(``fedrcl.algorithms.scaffold``: ``c_i+ = c_i - c + (x - y_i) / sum_k eta_k``, ``c += sum_i n_i / n_all delta c_i``).
Bytes: SCAFFOLD's (weights and ``c`` down, weights and ``delta c_i`` up). Two gradients per step.
"""
from __future__ import annotations

from typing import Any

from torch import Tensor

from fedrcl.algorithms.fedavg import Tensors
from fedrcl.algorithms.fedcm import unflatten
from fedrcl.algorithms.scaffold import SCAFFOLD
from fedrcl.losses.sharpness import sam_perturbation
from fedrcl.server.scaffold import SCAFFOLD as ScaffoldServer


class FedGAMMA(SCAFFOLD):
    """SCAFFOLD's corrected step at SAM's perturbed point (see the module docstring).

    Args:
        rho: SAM's radius (>= 0; 0 is SCAFFOLD). Dai et al.: 0.01 to 0.1 by dataset; FL-Simulator's default 0.1.
    """

    server_half = (ScaffoldServer, "configs/methods/fedgamma.yaml")

    def __init__(self, rho: float = 0.1, **kwargs: Any):
        super().__init__(**kwargs)
        if rho < 0:
            raise ValueError(f"model.init_args.rho must be >= 0, got {rho}")
        self.rho = rho

    def client_direction(self, params: Tensors, x: Tensor, y: Tensor) -> tuple[Tensors, Tensor, Tensors]:
        g, loss, parts = self.loss_gradient(params, x, y)  # CE's gradient plus the correction c - c_i
        assert self.client is not None, "a client's run"
        correction = unflatten(self.client.tensors["correction"], params)
        eps = sam_perturbation({k: t - correction[k] for k, t in g.items()}, self.rho)
        g_perturbed, _, _ = self.loss_gradient({k: p + eps[k] for k, p in params.items()}, x, y)
        return g_perturbed, loss, parts
