"""FedSMOO client (Sun et al., "Dynamic Regularized Sharpness Aware Minimization in Federated Learning:
Approaching Global Consistency and Smooth Landscape", ICML 2023, Algorithm 1): FedDyn's dynamic regulariser on
the weights, and a SAM step whose perturbation a second dual pulls towards a global one; its server half is
``fedrcl.server.FedSMOO`` (``trainer.server``), which holds alpha (the paper's ``1 / beta``) and rho.

At each local step from ``w`` (``x`` the round's global weights, ``s`` the global perturbation received with
them; ``fedrcl.losses.perturbation_correction``):

    g = grad F_i(w),   s_hat = rho (g - mu_i - s) / ||g - mu_i - s||,   mu_i <- mu_i + s_hat - s
    w <- w - lr * (grad F_i(w + s_hat) - lam_i + alpha (w - x))

and after the K steps, ending at ``y_i``: ``lam_i <- lam_i - alpha (y_i - x)`` (FedDyn's dual update); the client
sends ``y_i`` and ``mu_i - s_hat_{i,K}``, from which the server makes the next ``s`` (``s = rho v / ||v||``), and
the new model is FedDyn's shifted mean of the ``y_i``.

State, kept on the client between its rounds (one safetensors file per client, ``PersistentClientState``; 0 at
its first participation): ``lam_i`` (the weight dual, FedDyn's ``g_i``) and ``mu_i`` (the perturbation dual,
changed at every local step). Within a round: ``s_hat`` of the last step. ``F_i`` is the method's local loss
(cross-entropy; the server's client term included), both gradients on the same batch; the engine clips the whole
direction, adds weight decay and steps by the client lr, as for a gradient. Two gradients per step. Bytes: twice
FedAvg's each way (``s`` down, ``mu_i - s_hat_{i,K}`` up). FL-Simulator clips the direction without the proximal
``alpha w`` (its SGD's weight decay) and sends ``mu_i`` alone; this is the paper's rule.

Execution: ``mu_i`` changes at every step inside ``client_direction``; the duals, the received ``s`` and the last
``s_hat`` are in the client's ``client.tensors``, so batched clients and seeds together hand each client's slice
its own and keep what its step replaced; several processes and Flower train it as one process does.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import torch
from torch import Tensor

from fedrcl.algorithms.client_memory import PersistentClientState
from fedrcl.algorithms.fedavg import Tensors
from fedrcl.contract.context import ClientContext
from fedrcl.data.datamodule import total_train_samples
from fedrcl.losses.dynamic_regularizer import dual_update
from fedrcl.losses.perturbation_correction import corrected_perturbation, fedsmoo_direction, \
    perturbation_dual_update
from fedrcl.server.fedsmoo import FedSMOO as FedSMOOServer

WEIGHT_DUAL, PERTURBATION_DUAL = "lam.", "mu."  # the two duals' keys in a client's state file


def _server_half(client: Optional[ClientContext]) -> FedSMOOServer:
    """The client's copy of the server half (``server_half``: a run with another server is refused)."""
    server = client.server if client is not None else None
    assert isinstance(server, FedSMOOServer), "FedSMOO runs with its server half"
    return server


class FedSMOO(PersistentClientState):
    """The dynamic regulariser with the dynamically corrected SAM step (see the module docstring).

    Args: those of ``PersistentClientState`` (where the lam_i and mu_i files go) and ``FedAvg``; alpha and rho
    are the server's (``trainer.server.init_args``), shared by both halves.
    """

    server_half = (FedSMOOServer, "configs/methods/fedsmoo.yaml")

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self._upload: dict[str, Tensor] = {}

    def on_client_start(self, client: ClientContext) -> None:
        """The client's tensors: read by its steps (``weight_dual``, lam_i; ``global_perturbation``, s), replaced
        at every step (``perturbation_dual``, mu_i; ``last_perturbation``, the last s_hat), each by parameter name."""
        super().on_client_start(client)
        params = dict(self.backbone.named_parameters())
        own = self.load_client_state(client.client_id)
        zeros = {n: torch.zeros_like(p).detach() for n, p in params.items()}
        s = _server_half(client).perturbation({n: client.global_state[n] for n in params})
        client.tensors.update(
            weight_dual=dict(zeros) if own is None else {n: own[WEIGHT_DUAL + n].to(p) for n, p in params.items()},
            perturbation_dual=dict(zeros) if own is None else
            {n: own[PERTURBATION_DUAL + n].to(p) for n, p in params.items()},
            global_perturbation={n: s[n].to(p) for n, p in params.items()},
            last_perturbation=dict(zeros))

    def client_direction(self, params: Tensors, x: Tensor, y: Tensor) -> tuple[Tensors, Tensor, Tensors]:
        client = self.client
        assert client is not None, "a client's run"
        own = client.tensors
        g, loss, parts = self.loss_gradient(params, x, y)
        s = own["global_perturbation"]
        s_hat = corrected_perturbation(g, own["perturbation_dual"], s, _server_half(client).rho)
        own["perturbation_dual"] = {k: perturbation_dual_update(mu, s_hat[k], s[k])
                                    for k, mu in own["perturbation_dual"].items()}
        own["last_perturbation"] = s_hat
        g_perturbed, _, _ = self.loss_gradient({k: p + s_hat[k] for k, p in params.items()}, x, y)
        direction = fedsmoo_direction(g_perturbed, own["weight_dual"], params, client.global_state,
                                      _server_half(client).alpha)
        return direction, loss, parts

    @torch.no_grad()
    def on_client_end(self, client: ClientContext) -> None:
        alpha, own = _server_half(client).alpha, client.tensors
        state = {}
        for n, p in self.backbone.named_parameters():
            state[WEIGHT_DUAL + n] = dual_update(own["weight_dual"][n], p, client.global_state[n], alpha)
            state[PERTURBATION_DUAL + n] = own["perturbation_dual"][n]
        self.save_client_state(client, state)
        self._upload = {n: mu - own["last_perturbation"][n] for n, mu in own["perturbation_dual"].items()}

    def extra_upload(self, client: ClientContext) -> dict[str, Tensor]:
        """``mu_i - s_hat_{i,K}``, sent with the weights (called after ``on_client_end``)."""
        upload, self._upload = self._upload, {}
        return upload

    def receive_upload(self, client: ClientContext, upload: Mapping[str, Tensor]) -> None:
        """The server half takes a client's sample count and ``mu_i - s_hat_{i,K}`` (on the server's copy)."""
        _server_half(client).receive(client.num_samples, total_train_samples(self.trainer), upload)
