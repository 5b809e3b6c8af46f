"""FedAvgM: server momentum (Hsu, Qi and Brown, "Measuring the Effects of Non-Identical Data Distribution
for Federated Visual Classification", arXiv:1909.06335, 2019).

With ``delta_t = client_mean_t - sent_t`` (``sent_t`` is the global model ``w_t``; FedAvgM broadcasts it
unchanged) and ``M_0 = 0``:

    M_{t+1} = beta * M_t + delta_t
    w_{t+1} = w_t + eta * M_{t+1}

``beta = 0`` and ``eta = 1`` give FedAvg. The FedRCL paper (Table 5, supplement) uses beta = 0.4, eta = 1.
"""
from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

from fedrcl.server.base import State, StatefulServer, check_positive, check_unit_interval, round_update


class FedAvgM(StatefulServer):
    """Server momentum on the round's update (see the module docstring).

    Args:
        beta: momentum decay of the server momentum M (FedRCL paper: 0.4).
        eta: server learning rate applied to M (FedRCL paper: 1).
    """

    def __init__(self, beta: float = 0.4, eta: float = 1.0):
        super().__init__()
        check_unit_interval("beta", beta)
        check_positive("eta", eta)
        self.beta, self.eta = beta, eta

    def step(self, global_state: State, sent: Mapping[str, Tensor], client_mean: Mapping[str, Tensor]) -> State:
        delta = round_update(sent, client_mean)
        momentum = self.buffer("momentum", delta)
        for k, d in delta.items():
            momentum[k].mul_(self.beta).add_(d)
        return {k: (w + self.eta * momentum[k]).to(w.dtype) if k in delta else w for k, w in global_state.items()}
