"""SCAFFOLD's control variates (option II), as pure functions of tensors.

Reference: S. P. Karimireddy, S. Kale, M. Mohri, S. J. Reddi, S. U. Stich, A. T. Suresh, "SCAFFOLD:
Stochastic Controlled Averaging for Federated Learning", ICML 2020 (Algorithm 1).

A client corrects every local gradient by ``c - c_i`` (server and client control variates). Adding the
linear term ``<c - c_i, theta>`` to the loss does exactly that, and being a loss term it maps over batched
clients like any other (``linear_term``). After the local steps the client's new control variate is
(option II)

    c_i+ = c_i - c + (x - y_i) / sum_k eta_k

with ``x`` the weights it started from, ``y_i`` its weights after the K steps and ``eta_k`` the learning rate of
step k (``K eta`` in the paper, whose lr is constant). It uploads ``delta c_i = c_i+ - c_i``
(``control_variate_delta``); the server adds the clients' deltas to ``c``.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor


def linear_term(weights: Iterable[Tensor], vector: Tensor) -> Tensor:
    """``<vector, theta>``: ``theta`` the tensors of ``weights`` flattened in order and concatenated (never
    materialised); its gradient with respect to each weight is that weight's slice of ``vector``.

    ``vector`` is 1-D with as many entries as the weights together (checked).
    """
    total, start = None, 0
    for w in weights:
        n = w.numel()
        if start + n > vector.shape[-1]:
            raise ValueError(f"vector of {vector.shape[-1]} entries is shorter than the weights")
        term = (w * vector[start:start + n].view_as(w)).sum(dtype=torch.promote_types(w.dtype, torch.float32))
        total = term if total is None else total + term
        start += n
    if total is None:
        raise ValueError("linear_term needs at least one weight tensor")
    if start != vector.shape[-1]:
        raise ValueError(f"vector of {vector.shape[-1]} entries for weights of {start} entries")
    return total


def control_variate_delta(start: Tensor, end: Tensor, lr_sum: float, server_control: Tensor) -> Tensor:
    """Option II: ``delta c_i = c_i+ - c_i = (start - end) / lr_sum - c`` for one weight tensor.

    Args:
        start: the weights the client started the round from (``x``).
        end: its weights after its local steps (``y_i``).
        lr_sum: the sum of the learning rates of its local steps (``K eta`` at a constant lr); > 0.
        server_control: the server's control variate ``c`` it received.
    """
    if not lr_sum > 0:
        raise ValueError(f"lr_sum must be > 0, got {lr_sum}")
    return (start - end) / lr_sum - server_control
