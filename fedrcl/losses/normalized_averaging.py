"""FedNova's normalised averaging (Wang et al., "Tackling the Objective Inconsistency Problem in Heterogeneous
Federated Optimization", NeurIPS 2020, Section 4 and Appendix: eq. (5)-(7), the ``a_i`` of local momentum and of
the proximal local solver).

A client's local update is a linear combination of its gradients: ``x - y_i = eta * sum_k a_ik g_ik``. FedNova
divides it by ``||a_i||_1`` and the server scales the clients' mean normalised update back by
``tau_eff = sum_i p_i ||a_i||_1``:

    x+ = x - tau_eff * sum_i p_i (x - y_i) / ||a_i||_1

With the learning rate inside the norm (``update_norm`` returns ``eta ||a_i||_1``, and ``eta tau_eff`` is the
round's mean of those), the rule holds for any per-step learning rates and has no reference lr.
"""
from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor


def update_norm(lrs: Sequence[float], momentum: float = 0.0, mu: float = 0.0) -> float:
    """``eta ||a_i||_1``: the sum of the coefficients of a client's gradients in its update ``x - y_i``.

    Local step ``k`` at lr ``lrs[k]``: ``b <- momentum * b + g_k + mu (y - x)`` (``b = 0`` at the start),
    ``y <- y - lrs[k] * b`` (``torch.optim.SGD`` with momentum and no dampening on FedProx's objective). Every
    gradient enters ``b`` with coefficient 1, so the coefficients' sum follows the same recurrence with
    ``g = 1``: ``B <- momentum * B + 1 - mu * D``, ``D <- D + lrs[k] * B``. At a constant lr ``eta`` over ``tau``
    steps this is the paper's ``eta tau`` (SGD), ``eta [tau - rho (1 - rho^tau) / (1 - rho)] / (1 - rho)``
    (momentum ``rho``) and ``[1 - (1 - eta mu)^tau] / mu`` (proximal).
    """
    if not lrs:
        raise ValueError("update_norm needs at least one local step")
    big_b = big_d = 0.0
    for lr in lrs:
        big_b = momentum * big_b + 1.0 - mu * big_d
        big_d += lr * big_b
    return big_d


def normalized_model(start: Tensor, end: Tensor, norm: float) -> Tensor:
    """``x - (x - y_i) / norm``: the model a FedNova client uploads (its update divided by ``eta ||a_i||_1``)."""
    if not norm > 0:
        raise ValueError(f"the update's norm must be > 0, got {norm}")
    return start - (start - end) / norm


def effective_mean(sent: Tensor, normalized_mean: Tensor, tau_eff: Tensor | float) -> Tensor:
    """``x - tau_eff * (x - mean_i z_i)``: FedNova's new model from the mean of the normalised models ``z_i``
    (``sum_i p_i z_i = x - sum_i p_i (x - y_i) / ||a_i||``), ``tau_eff = sum_i p_i eta ||a_i||_1``."""
    return sent + tau_eff * (normalized_mean - sent)
