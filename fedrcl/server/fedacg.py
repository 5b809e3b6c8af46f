"""FedACG: accelerated client gradient (Kim, Kim and Han, "Communication-Efficient Federated Learning with
Accelerated Client Gradient", CVPR 2024).

The server keeps a momentum M (``M_0 = 0``). In round t it broadcasts a look-ahead of the global model,
each client adds a proximal term towards what it received, and the new global model is the clients' mean:

    sent_t   = w_t + lam * M_t                              (``broadcast``)
    client:  loss + beta/2 * ||theta - sent_t||^2            (``client_regularizer``; trainable parameters)
    delta_t  = client_mean_t - sent_t
    M_{t+1}  = lam * M_t + delta_t
    w_{t+1}  = client_mean_t

so ``w_{t+1} = sent_t + delta_t``. The FedRCL paper (supplement) uses lam = 0.85, beta = 0.001. (The
FedACG authors' code adds ``0.001 * ||theta - sent||^2``, without the 1/2; this follows the paper's
beta/2 form: set beta = 0.002 to match that code.)
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Optional

from torch import Tensor

from fedrcl.server.base import State, StatefulServer, check_unit_interval, round_update


class FedACG(StatefulServer):
    """Look-ahead broadcast, client proximal term, momentum on the round's update (see the module docstring).

    Args:
        lam: lambda: momentum decay and look-ahead factor (FedRCL paper: 0.85).
        beta: weight of the clients' proximal term beta/2 ||theta - sent||^2 (FedRCL paper: 0.001); 0 drops it.
    """

    def __init__(self, lam: float = 0.85, beta: float = 0.001):
        super().__init__()
        check_unit_interval("lam", lam)
        if beta < 0:
            raise ValueError(f"trainer.server.init_args.beta must be >= 0, got {beta}")
        self.lam, self.beta = lam, beta

    def broadcast(self, global_state: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
        if "momentum" not in self.memory:
            return global_state
        momentum = self.buffer("momentum", global_state)
        return {k: (w + self.lam * momentum[k]).to(w.dtype) if k in momentum else w for k, w in global_state.items()}

    def client_regularizer(self, params: Mapping[str, Tensor], sent: Mapping[str, Tensor]) -> Optional[Tensor]:
        if self.beta == 0:
            return None
        total = sum((p - sent[k]).pow(2).sum() for k, p in params.items())
        assert isinstance(total, Tensor)  # a model has parameters, so the sum is a tensor
        return self.beta / 2 * total

    def step(self, global_state: State, sent: Mapping[str, Tensor], client_mean: Mapping[str, Tensor]) -> State:
        delta = round_update(sent, client_mean)
        momentum = self.buffer("momentum", delta)
        for k, d in delta.items():
            momentum[k].mul_(self.lam).add_(d)
        return {k: client_mean[k].to(w.dtype) if k in delta else w for k, w in global_state.items()}
