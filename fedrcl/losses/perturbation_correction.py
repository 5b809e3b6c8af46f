"""FedSMOO's corrected SAM perturbation, its duals and its local direction, as pure functions of tensors
(Sun et al., "Dynamic Regularized Sharpness Aware Minimization in Federated Learning: Approaching Global
Consistency and Smooth Landscape", ICML 2023, Algorithm 1).

At a local step from ``w`` (``g = grad F_i(w)``; ``mu_i`` the client's perturbation dual, ``s`` the global
perturbation the server sent, ``lam_i`` the client's weight dual, ``x`` the round's global weights):

    s_hat = rho (g - mu_i - s) / ||g - mu_i - s||                       (``corrected_perturbation``)
    mu_i  <- mu_i + s_hat - s                                           (``perturbation_dual_update``)
    w     <- w - lr (grad F_i(w + s_hat) - lam_i + alpha (w - x))       (``fedsmoo_direction``; alpha = 1/beta)

After the round the weight dual is FedDyn's (``fedrcl.losses.dynamic_regularizer.dual_update``), and the server
makes the next ``s`` from the clients' ``mu_i - s_hat_{i,K}``: ``s = rho v / ||v||`` with ``v`` their mean
(``global_perturbation``).
"""
from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

from fedrcl.losses.sharpness import sam_perturbation


def corrected_perturbation(grads: Mapping[str, Tensor], dual: Mapping[str, Tensor],
                           global_perturbation: Mapping[str, Tensor], rho: float) -> dict[str, Tensor]:
    """``rho (g - mu - s) / ||g - mu - s||`` per tensor (one norm over all of them; 0 where ``g = mu + s``)."""
    return sam_perturbation({k: g - dual[k] - global_perturbation[k] for k, g in grads.items()}, rho)


def perturbation_dual_update(dual: Tensor, perturbation: Tensor, global_perturbation: Tensor) -> Tensor:
    """``mu + s_hat - s`` for one tensor: the client's perturbation dual after a local step."""
    return dual + perturbation - global_perturbation


def fedsmoo_direction(perturbed_grads: Mapping[str, Tensor], dual: Mapping[str, Tensor],
                      weights: Mapping[str, Tensor], anchor: Mapping[str, Tensor], alpha: float) -> dict[str, Tensor]:
    """``grad F(w + s_hat) - lam + alpha (w - x)`` per tensor (``dual``: ``lam``; ``anchor``: ``x``)."""
    return {k: perturbed_grads[k] - dual[k] + alpha * (w - anchor[k].to(w.dtype)) for k, w in weights.items()}


def global_perturbation(mean: Mapping[str, Tensor], rho: float) -> dict[str, Tensor]:
    """``rho v / ||v||`` per tensor (one norm over all of them; 0 where ``v = 0``): the server's ``s`` from the
    mean ``v`` of the round's ``mu_i - s_hat_{i,K}`` (any positive multiple of it gives the same ``s``)."""
    return sam_perturbation(mean, rho)
