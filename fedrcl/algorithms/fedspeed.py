"""FedSpeed client (Sun et al., "FedSpeed: Larger Local Interval, Less Communication Round, and Higher
Generalization Accuracy", ICLR 2023, Algorithm 1): a proximal term towards the round's global weights whose bias
a per-client prox-correction ``g_hat_i`` removes, on a gradient merged with one at an ascent point.

    g1 = grad F_i(w),   g2 = grad F_i(w + rho g1 / ||g1||),
    w <- w - lr * ((1 - alpha) g1 + alpha g2 - g_hat_i + (w - x) / lam)
    after the K steps (at y_i):  g_hat_i <- g_hat_i - (y_i - x) / lam,   send  y_i - lam g_hat_i

(``fedrcl.losses.prox_correction``). The server averages what the clients send (the paper's
``x+ = mean_i (y_i - lam g_hat_i)``: FedAvg's server; another server optimizer steps on that mean). ``g_hat_i``
(0 at a client's first participation) is kept on the client (``PersistentClientState``). The engine clips the
whole direction and adds weight decay, as for a gradient. Bytes: FedAvg's. Two gradients per step.

The authors' FL-Simulator adds the mean of every client's ``-lam g_hat_i`` (not only the round's) at the server;
this is the paper's rule, the round's clients' mean.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from fedrcl.algorithms.client_memory import PersistentClientState
from fedrcl.algorithms.fedavg import Tensors
from fedrcl.algorithms.fedcm import unflatten
from fedrcl.contract.context import ClientContext
from fedrcl.losses.prox_correction import corrected_model, fedspeed_direction, prox_correction_update
from fedrcl.losses.sharpness import sam_perturbation


class FedSpeed(PersistentClientState):
    """Prox-corrected, merged-gradient local steps (see the module docstring).

    Args:
        alpha: the ascent point's gradient share of the merged gradient, in [0, 1]. FL-Simulator runs 1.
        rho: the ascent radius (>= 0). FL-Simulator's default 0.1.
        lam: lambda of the proximal term ``||w - x||^2 / (2 lam)`` and of the correction's update (> 0). 1 / lam
            is FL-Simulator's ``lamb`` (default 0.1: lam 10).
    """

    def __init__(self, alpha: float = 1.0, rho: float = 0.1, lam: float = 10.0, **kwargs: Any):
        super().__init__(**kwargs)
        if not 0 <= alpha <= 1:
            raise ValueError(f"model.init_args.alpha must be in [0, 1], got {alpha}")
        if rho < 0:
            raise ValueError(f"model.init_args.rho must be >= 0, got {rho}")
        if not lam > 0:
            raise ValueError(f"model.init_args.lam must be > 0, got {lam}")
        self.alpha, self.rho, self.lam = alpha, rho, lam

    def on_client_start(self, client: ClientContext) -> None:
        super().on_client_start(client)
        own = self.load_client_state(client.client_id)
        client.tensors["correction"] = torch.cat([(torch.zeros_like(p) if own is None else own[n].to(p)).reshape(-1)
                                                  for n, p in self.backbone.named_parameters()]).detach()

    def client_direction(self, params: Tensors, x: Tensor, y: Tensor) -> tuple[Tensors, Tensor, Tensors]:
        g1, loss, parts = self.loss_gradient(params, x, y)
        eps = sam_perturbation(g1, self.rho)
        g2, _, _ = self.loss_gradient({k: p + eps[k] for k, p in params.items()}, x, y)
        client = self.client
        assert client is not None, "a client's run"
        direction = fedspeed_direction(g1, g2, unflatten(client.tensors["correction"], params), params,
                                       client.global_state, self.alpha, self.lam)
        return direction, loss, parts

    @torch.no_grad()
    def on_client_end(self, client: ClientContext) -> None:
        own = self.load_client_state(client.client_id)
        state = {}
        for n, p in self.backbone.named_parameters():
            start = client.global_state[n]
            state[n] = prox_correction_update(torch.zeros_like(p) if own is None else own[n], p, start, self.lam)
            p.copy_(corrected_model(p, state[n], self.lam))  # what the client sends
        self.save_client_state(client, state)
