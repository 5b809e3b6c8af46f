"""Adaptive server optimizers: FedAdam, FedYogi, FedAdagrad (Reddi et al., "Adaptive Federated
Optimization", ICLR 2021, Algorithm 2).

With ``delta_t = client_mean_t - sent_t`` (``sent_t`` is the global model ``w_t``), ``m_0 = 0`` and
``v_0 = tau^2`` (the paper's ``v_{-1} >= tau^2``; the FedACG/FedRCL code also starts v at tau^2):

    m_{t+1} = beta1 * m_t + (1 - beta1) * delta_t
    v_{t+1} = v_t + delta_t^2                                                  (FedAdagrad)
    v_{t+1} = v_t - (1 - beta2) * delta_t^2 * sign(v_t - delta_t^2)            (FedYogi)
    v_{t+1} = beta2 * v_t + (1 - beta2) * delta_t^2                            (FedAdam)
    w_{t+1} = w_t + eta * m_{t+1} / (sqrt(v_{t+1}) + tau)

element-wise, without bias correction (as in the paper). The FedRCL paper (supplement) uses FedAdam with
beta1 = 0.9, beta2 = 0.99, tau = 1e-3 and does not give eta. The default eta = 1e-2 is the server
learning rate the FedACG authors' code runs FedAdam with in this very setting (README of
github.com/geehokim/FedACG: ``server=FedAdam ... trainer.global_lr=0.01``, CIFAR-100, 100 clients, 5%
participation, Dirichlet 0.3; the FedRCL release, github.com/skynbe/FedRCL ``servers/base.py``, has the
same ``ServerAdam`` reading its server lr from ``trainer.global_lr``). Reddi et al. fix beta1 = 0.9,
beta2 = 0.99 and tune eta and tau per task; FedYogi and FedAdagrad take the same defaults here (Flower's
``FedYogi`` strategy has the same server defaults: eta 1e-2, beta1 0.9, beta2 0.99, tau 1e-3).
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from fedrcl.server.base import State, StatefulServer, check_positive, check_unit_interval, round_update


class FedOpt(StatefulServer):
    """Shared part of the adaptive servers: first moment m, second moment v, and the update of ``w``.

    Subclasses define how v absorbs the squared update (``update_second_moment``).

    Args:
        eta: server learning rate.
        beta1: decay of the first moment m.
        tau: adaptivity: added to sqrt(v) in the denominator; v starts at tau^2.
    """

    def __init__(self, eta: float = 1e-2, beta1: float = 0.9, tau: float = 1e-3):
        super().__init__()
        check_positive("eta", eta)
        check_unit_interval("beta1", beta1)
        check_positive("tau", tau)
        self.eta, self.beta1, self.tau = eta, beta1, tau

    def update_second_moment(self, v: Tensor, delta_sq: Tensor) -> None:
        """Fold ``delta_sq = delta^2`` into the second moment ``v`` in place."""
        raise NotImplementedError

    def step(self, global_state: State, sent: Mapping[str, Tensor], client_mean: Mapping[str, Tensor]) -> State:
        delta = round_update(sent, client_mean)
        m = self.buffer("m", delta)
        v = self.buffer("v", delta, fill=self.tau ** 2)
        for k, d in delta.items():
            m[k].mul_(self.beta1).add_(d, alpha=1 - self.beta1)
            self.update_second_moment(v[k], d * d)
        return {k: (w + self.eta * m[k] / (v[k].sqrt() + self.tau)).to(w.dtype) if k in delta else w
                for k, w in global_state.items()}


class FedAdagrad(FedOpt):
    """FedAdagrad: ``v <- v + delta^2`` (see the module docstring).

    Args:
        eta: server learning rate.
        beta1: decay of the first moment m (Reddi et al.: 0.9).
        tau: adaptivity: added to sqrt(v) in the denominator; v starts at tau^2 (Reddi et al.: 1e-3).
    """

    def update_second_moment(self, v: Tensor, delta_sq: Tensor) -> None:
        v.add_(delta_sq)


class FedYogi(FedOpt):
    """FedYogi: ``v <- v - (1 - beta2) delta^2 sign(v - delta^2)`` (see the module docstring).

    Args:
        eta: server learning rate.
        beta1: decay of the first moment m (Reddi et al.: 0.9).
        beta2: rate of the second moment v (Reddi et al.: 0.99).
        tau: adaptivity: added to sqrt(v) in the denominator; v starts at tau^2 (Reddi et al.: 1e-3).
    """

    def __init__(self, eta: float = 1e-2, beta1: float = 0.9, beta2: float = 0.99, tau: float = 1e-3):
        super().__init__(eta=eta, beta1=beta1, tau=tau)
        check_unit_interval("beta2", beta2)
        self.beta2 = beta2

    def update_second_moment(self, v: Tensor, delta_sq: Tensor) -> None:
        v.sub_((1 - self.beta2) * delta_sq * torch.sign(v - delta_sq))


class FedAdam(FedOpt):
    """FedAdam: ``v <- beta2 v + (1 - beta2) delta^2`` (see the module docstring).

    Args:
        eta: server learning rate (FedACG authors' code in the FedRCL paper's setting: 1e-2).
        beta1: decay of the first moment m (FedRCL paper: 0.9).
        beta2: decay of the second moment v (FedRCL paper: 0.99).
        tau: adaptivity: added to sqrt(v) in the denominator; v starts at tau^2 (FedRCL paper: 1e-3).
    """

    def __init__(self, eta: float = 1e-2, beta1: float = 0.9, beta2: float = 0.99, tau: float = 1e-3):
        super().__init__(eta=eta, beta1=beta1, tau=tau)
        check_unit_interval("beta2", beta2)
        self.beta2 = beta2

    def update_second_moment(self, v: Tensor, delta_sq: Tensor) -> None:
        v.mul_(self.beta2).add_(delta_sq, alpha=1 - self.beta2)
