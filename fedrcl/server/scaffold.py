"""SCAFFOLD's server half (Karimireddy et al., "SCAFFOLD: Stochastic Controlled Averaging for Federated
Learning", ICML 2020, Algorithm 1), used with the client algorithm ``fedrcl.algorithms.SCAFFOLD``.

The server keeps a control variate ``c`` (one tensor per trainable parameter, 0 at the start) and sends it
with the weights (``extra_broadcast``: counted in the byte ledger). Each client uploads its weights and
``delta c_i`` (``fedrcl.losses.control_variate``); then

    x <- x + eta_g * sum_{i in S} w_i (y_i - x)          (w_i = n_i / sum_{j in S} n_j: the round's mean)
    c <- c + sum_{i in S} (n_i / n_all) delta c_i          (``control_update``)

The paper weighs clients equally: ``c += |S|/N * mean_S delta c_i``. Here, as in fedrcl's aggregation, a
client weighs by its sample count ``n_i`` (``n_all``: all N clients' samples), which keeps ``c`` the same
weighted mean of the ``c_i`` that the weights' mean is; with equal client sizes both rules are the same.
eta_g = 1 (the paper's and FL-bench's default) makes ``x`` the clients' mean, as FedAvg.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from fedrcl.server.base import State, StatefulServer, check_positive
from fedrcl.server.client_reports import ClientReports


def control_update(control: Tensor, weighted_delta_sum: Tensor) -> Tensor:
    """``c + sum_{i in S} (n_i / n_all) delta c_i``, given that sum."""
    return control + weighted_delta_sum.to(control.dtype)


class SCAFFOLD(StatefulServer):
    """Server control variate and global step size (see the module docstring).

    Args:
        global_lr: eta_g, the server step size on the clients' mean update (paper, FL-bench: 1); > 0.
    """

    def __init__(self, global_lr: float = 1.0):
        super().__init__()
        check_positive("global_lr", global_lr)
        self.global_lr = global_lr
        self.reports = ClientReports()

    def control(self, like: Mapping[str, Tensor]) -> State:
        """The server control variate ``c`` (created 0 with ``like``'s shapes, the trainable parameters)."""
        return self.buffer("control", like)

    def receive(self, delta: Mapping[str, Tensor], num_samples: int, total_samples: int) -> None:
        """A client's upload besides its weights: its ``delta c_i``, its and all clients' sample counts."""
        self.control(delta)  # c = 0 with the parameters' dtype if no client in this process read it yet
        self.reports.add(num_samples, total_samples, delta)

    def broadcast(self, global_state: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
        """The global model; ``c`` is created (0) over its floating-point entries before the first round, so
        that every round sends it."""
        self.control({k: v for k, v in global_state.items() if v.is_floating_point()})
        return global_state

    def extra_broadcast(self, client: Any) -> Mapping[str, Tensor]:
        return self.memory.get("control", {})

    def load_broadcast(self, client: Any, extra: Mapping[str, Tensor]) -> None:
        """On a client's own machine (``fedrcl.flower``): take ``c`` from what ``extra_broadcast`` sent."""
        if extra:
            self.memory["control"] = dict(extra)
        else:
            self.memory.pop("control", None)

    def step(self, global_state: State, sent: Mapping[str, Tensor], client_mean: Mapping[str, Tensor]) -> State:
        device = next(iter(client_mean.values())).device
        _, sums = self.reports.total(device)
        control = self.control(sums)
        for k, s in sums.items():
            control[k] = control_update(control[k], s)
        if self.global_lr == 1:  # the mean itself, bitwise as FedAvg
            return {k: client_mean[k] if k in client_mean else w for k, w in global_state.items()}
        return {k: (w + self.global_lr * (client_mean[k] - sent[k])).to(w.dtype) if k in client_mean else w
                for k, w in global_state.items()}
