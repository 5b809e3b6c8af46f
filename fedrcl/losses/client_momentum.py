"""FedCM's client-level momentum (Xu et al., "FedCM: Federated Learning with Client-level Momentum", 2021,
Algorithm 1), also MoFedSAM's (Qu et al., ICML 2022).

The server sends, with the weights, the last round's global update in gradient units,
``Delta = (x_prev - x) / sum_k eta_k`` (the update over the round's ``K`` local steps at lrs ``eta_k``: the paper's
``-(1 / (eta_l K)) mean_i (y_i - x_prev)`` with a constant lr and FedAvg's server); every local step goes along

    v = alpha * g + (1 - alpha) * Delta
"""
from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor


def global_update_direction(previous: Tensor, current: Tensor, lr_sum: float) -> Tensor:
    """``(previous - current) / lr_sum``: the last global update as a mean gradient of its local steps."""
    if not lr_sum > 0:
        raise ValueError(f"lr_sum must be > 0, got {lr_sum}")
    return (previous - current) / lr_sum


def momentum_direction(grads: Mapping[str, Tensor], delta: Mapping[str, Tensor], alpha: float) -> dict[str, Tensor]:
    """``alpha * g + (1 - alpha) * Delta`` per tensor."""
    return {k: alpha * g + (1 - alpha) * delta[k].to(g.dtype) for k, g in grads.items()}
