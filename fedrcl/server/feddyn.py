"""FedDyn's server half (Acar et al., "Federated Learning Based on Dynamic Regularization", ICLR 2021,
Algorithm 1), used with the client algorithm ``fedrcl.algorithms.FedDyn``.

The server keeps ``h`` (0 at the start) and updates it with every client's drift, the clients not sampled
counting 0:

    h       <- h - alpha * sum_{i in S} (n_i / n_all) (theta_i - theta)      (``h_update``)
    theta   <- sum_{i in S} w_i theta_i - h / alpha                           (w_i = n_i / sum_{j in S} n_j)

The paper weighs clients equally: ``h -= alpha/m sum_{i in S} (theta_i - theta)`` over all m clients and an
unweighted mean. Here a client weighs by its sample count ``n_i`` (``n_all``: all m clients' samples), as
in fedrcl's aggregation; with equal client sizes both rules are the same. Since
``sum_{i in S} (n_i / n_all)(theta_i - theta) = f (mean_S - theta)`` with ``f`` the round's share of all
samples, the server needs from the clients only their sample counts (``receive``). ``h`` covers every
floating-point entry (parameters; a backbone with float buffers would also shift them).
"""
from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

from fedrcl.server.base import State, StatefulServer, check_positive, round_update
from fedrcl.server.client_reports import ClientReports


def h_update(h: Tensor, mean_drift: Tensor, alpha: float, fraction: float) -> Tensor:
    """``h - alpha * fraction * (mean_S theta_i - theta)``: ``fraction`` the sampled clients' share of samples."""
    return h - alpha * fraction * mean_drift


def server_model(client_mean: Tensor, h: Tensor, alpha: float) -> Tensor:
    """``mean_S theta_i - h / alpha``."""
    return client_mean - h / alpha


class FedDyn(StatefulServer):
    """``h`` and the shifted mean (see the module docstring).

    Args:
        alpha: FedDyn's alpha, shared by the clients' regulariser (``fedrcl.algorithms.FedDyn`` reads it
            here) and ``h``; > 0. Paper: 0.1, 0.01 or 0.001 by dataset; FL-bench's default 0.01.
    """

    def __init__(self, alpha: float = 0.01):
        super().__init__()
        check_positive("alpha", alpha)
        self.alpha = alpha
        self.reports = ClientReports()

    def receive(self, num_samples: int, total_samples: int) -> None:
        """A client's report: its and all clients' sample counts (its weights go through aggregation)."""
        self.reports.add(num_samples, total_samples)

    def step(self, global_state: State, sent: Mapping[str, Tensor], client_mean: Mapping[str, Tensor]) -> State:
        drift = round_update(sent, client_mean)
        fraction, _ = self.reports.total(next(iter(drift.values())).device)
        h = self.buffer("h", drift)
        for k, d in drift.items():
            h[k] = h_update(h[k], d, self.alpha, fraction)
        return {k: server_model(client_mean[k], h[k], self.alpha).to(w.dtype) if k in drift else w
                for k, w in global_state.items()}
