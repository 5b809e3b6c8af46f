"""FedDyn's dynamic regulariser and its client dual update, as pure functions of tensors.

Reference: D. A. E. Acar, Y. Zhao, R. Matas Navarro, M. Mattina, P. N. Whatmough, V. Saligrama,
"Federated Learning Based on Dynamic Regularization", ICLR 2021 (Algorithm 1).

Client i's loss in round t is ``L_i(theta) + dyn(theta)`` with

    dyn(theta) = - <g_i, theta> + alpha/2 ||theta - theta_server||^2

where ``g_i`` (the paper's grad L_i(theta_i^{t-1})) is the client's dual variable, 0 at its first
participation, and ``theta_server`` the weights the server broadcast. After local training

    g_i <- g_i - alpha (theta_i - theta_server)                     (``dual_update``)

(at an exact local optimum the new ``g_i`` is the gradient of ``L_i`` there, hence the paper's name).
"""
from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from fedrcl.losses.control_variate import linear_term
from fedrcl.losses.proximal import squared_distance


def dynamic_regularizer(weights: Sequence[Tensor], dual: Tensor, anchors: Sequence[Tensor],
                        alpha: float) -> Tensor:
    """``- <dual, theta> + alpha/2 ||theta - anchors||^2`` (scalar); gradients flow into ``weights`` only.

    Args:
        weights: the client's parameter tensors (``theta``).
        dual: the client's dual variable ``g_i``, 1-D, the weights flattened in order.
        anchors: the broadcast weights, paired with ``weights`` (same order and shapes).
        alpha: FedDyn's alpha, >= 0.
    """
    return -linear_term(weights, dual.detach()) + alpha / 2 * squared_distance(weights, anchors)


def dual_update(dual: Tensor, local: Tensor, server: Tensor, alpha: float) -> Tensor:
    """``g_i - alpha (theta_i - theta_server)`` for one weight tensor."""
    return dual - alpha * (local - server)
