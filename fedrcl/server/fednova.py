"""FedNova's server half (Wang et al., "Tackling the Objective Inconsistency Problem in Heterogeneous Federated
Optimization", NeurIPS 2020, eq. (7)), used with the client algorithm ``fedrcl.algorithms.FedNova``.

Each client uploads its normalised model ``z_i = x - (x - y_i) / (eta ||a_i||_1)`` in place of its weights, and the
number ``eta ||a_i||_1`` (``fedrcl.losses.normalized_averaging``). With ``p_i = n_i / sum_{j in S} n_j``:

    tau_eff = sum_{i in S} p_i eta ||a_i||_1
    x_eff   = x - tau_eff * (x - sum_{i in S} p_i z_i)      (= x - tau_eff sum_i p_i (x - y_i) / ||a_i||_1)

``x_eff`` is what FedAvg's mean would be had every client taken ``tau_eff`` normalised steps; it goes to the
``base`` server optimizer as the clients' mean (FedAvg: ``x+ = x_eff``, the paper's rule; FedAvgM: the paper's
server momentum; FedAdam, FedAdagrad, FedYogi likewise on the update ``x_eff - x``). A base with a client half of
its own (SCAFFOLD, FedDyn, FedNova) or a term in the clients' loss (FedACG: ``||a_i||`` would not count it) is
refused.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

from torch import Tensor

from fedrcl.losses.normalized_averaging import effective_mean
from fedrcl.server.base import FedAvg, ServerOptimizer, State, StatefulServer
from fedrcl.server.client_reports import ClientReports
from fedrcl.server.feddyn import FedDyn
from fedrcl.server.scaffold import SCAFFOLD


class FedNova(StatefulServer):
    """``tau_eff`` and the effective mean, stepped by ``base`` (see the module docstring); its memory (what the
    checkpoint holds) is the base's.

    Args:
        base: the server optimizer that steps on the effective mean (default FedAvg: the paper's rule; FedAvgM
            for the paper's server momentum).
    """

    def __init__(self, base: Optional[ServerOptimizer] = None):
        super().__init__()
        base = FedAvg() if base is None else base
        if isinstance(base, (SCAFFOLD, FedDyn, FedNova)):
            raise ValueError(f"trainer.server.init_args.base must be a server optimizer without a client half "
                             f"(FedAvg, FedAvgM, FedAdam, FedAdagrad, FedYogi), got {type(base).__name__}")
        if type(base).client_regularizer is not ServerOptimizer.client_regularizer:
            raise ValueError(f"trainer.server.init_args.base {type(base).__name__} adds a term to the clients' loss, "
                             "which FedNova's ||a_i|| does not count: use FedNova's model.init_args.mu for a "
                             "proximal term")
        self.base = base
        self.reports = ClientReports()

    def receive(self, norm: Tensor, num_samples: int, total_samples: int) -> None:
        """A client's report besides its normalised model: its ``eta ||a_i||_1``, its and all clients' samples."""
        self.reports.add(num_samples, total_samples, {"norm": norm})

    def tau_eff(self, device: Any) -> Tensor:
        """The round's ``sum_{i in S} p_i eta ||a_i||_1`` over every process's clients (then cleared)."""
        fraction, sums = self.reports.total(device)
        return sums["norm"] / fraction

    def broadcast(self, global_state: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
        return self.base.broadcast(global_state)

    def extra_broadcast(self, client: Any) -> Mapping[str, Tensor]:
        return self.base.extra_broadcast(client)

    def load_broadcast(self, client: Any, extra: Mapping[str, Tensor]) -> None:
        self.base.load_broadcast(client, extra)

    def step(self, global_state: State, sent: Mapping[str, Tensor], client_mean: Mapping[str, Tensor]) -> State:
        tau_eff = self.tau_eff(next(iter(client_mean.values())).device)
        mean = {k: effective_mean(sent[k], z, tau_eff).to(z.dtype) for k, z in client_mean.items()}
        return self.base.step(global_state, sent, mean)

    def state_dict(self) -> dict[str, Any]:
        return self.base.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.base.load_state_dict(state)
