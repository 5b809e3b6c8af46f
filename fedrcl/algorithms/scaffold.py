"""SCAFFOLD client (Karimireddy et al., "SCAFFOLD: Stochastic Controlled Averaging for Federated Learning",
ICML 2020), option II control variates; its server half is ``fedrcl.server.SCAFFOLD`` (``trainer.server``).

    loss = CE(f(x), y) + <c - c_i, theta>        (every local gradient corrected by c - c_i)

``c`` is the server's control variate (received with the weights), ``c_i`` the client's own (0 at its first
participation; kept on the client, ``PersistentClientState``). After the K local steps, with ``x`` the
received and ``y_i`` the final weights (``fedrcl.losses.control_variate``):

    c_i+ = c_i - c + (x - y_i) / sum_k eta_k,   upload delta c_i = c_i+ - c_i (as well as y_i)

The learning rate: ``eta_k`` is the lr the optimizer used at step k (the round's lr_decay and each local
epoch's local_lr_decay included; summed at the client's start from its context's steps and local epochs, so no
per-step hook is needed and the clients train batched and together), and ``sum_k eta_k`` replaces the paper's ``K eta`` (its lr is constant;
FL-bench and PFLlib divide by K times the configured lr, PFLlib also when its scheduler has decayed the lr,
which overstates the step once the lr decays). With plain SGD
(momentum 0), ``(x - y_i) / sum_k eta_k`` is then exactly the lr-weighted mean of the K steps' directions,
so ``c_i+`` is the mean local gradient that option II estimates. Those directions are what SGD applied:
the gradient of CE plus the correction, clipped to ``grad_clip_norm`` when it is longer, plus weight decay
(``weight_decay * theta``, part of the local objective, so part of ``c_i``); a clipped step makes ``c_i+``
the mean *clipped* gradient. Momentum would mix steps; fedrcl's paper settings use none.

Bytes: the upload is the weights plus ``delta c_i`` (``extra_upload``), the download the weights plus ``c``
(the server's ``extra_broadcast``): twice FedAvg's traffic each way, counted in ``comm/``.
Execution: batched clients stack ``c - c_i`` (``client.tensors``); ``sum_k eta_k`` is each client's own, from its
context at its end; several processes sum the clients' ``delta c_i`` at the server step
(``fedrcl.server.client_reports``).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from fedrcl.algorithms.client_memory import PersistentClientState
from fedrcl.contract.context import ClientContext
from fedrcl.data.datamodule import total_train_samples
from fedrcl.losses.control_variate import control_variate_delta, linear_term
from fedrcl.models.output import ModelOutput
from fedrcl.server.scaffold import SCAFFOLD as ScaffoldServer


def _server_half(client: Optional[ClientContext]) -> ScaffoldServer:
    """The client's copy of the server half (``server_half``: a run with another server is refused)."""
    server = client.server if client is not None else None
    assert isinstance(server, ScaffoldServer), "SCAFFOLD runs with its server half"
    return server


class SCAFFOLD(PersistentClientState):
    """Cross-entropy with the control-variate correction (see the module docstring).

    Args: those of ``PersistentClientState`` (where the c_i files go) and ``FedAvg``; SCAFFOLD's global
    step size is the server's (``trainer.server.init_args.global_lr``).
    """

    server_half = (ScaffoldServer, "configs/methods/scaffold.yaml")

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self._upload: dict[str, Tensor] = {}

    def on_client_start(self, client: ClientContext) -> None:
        super().on_client_start(client)
        names = [name for name, _ in self.backbone.named_parameters()]
        control = _server_half(client).control({n: client.global_state[n] for n in names})
        own = self.load_client_state(client.client_id)
        client.tensors["correction"] = torch.cat([(control[n] if own is None else control[n] - own[n]).reshape(-1)
                                                  for n in names])

    def lr_sum(self, client: ClientContext) -> float:
        """``sum_k eta_k``: the lr of each of the client's steps this round, summed in step order, as SGD applied
        them (its own steps: clients may take different counts)."""
        return sum(float(self.client_lr(client.round_idx, epoch)) for epoch in client.step_epochs())

    def client_loss(self, x: Tensor, y: Tensor, out: ModelOutput) -> tuple[Tensor, dict[str, Tensor]]:
        assert self.client is not None, "a client's run"
        ce = F.cross_entropy(out.logits, y)
        return ce + linear_term(self.backbone.parameters(), self.client.tensors["correction"]), {"ce": ce}

    @torch.no_grad()
    def on_client_end(self, client: ClientContext) -> None:
        params = dict(self.backbone.named_parameters())
        control = _server_half(client).control(params)
        lr_sum = self.lr_sum(client)
        delta = {n: control_variate_delta(client.global_state[n], p, lr_sum, control[n])
                 for n, p in params.items()}
        own = self.load_client_state(client.client_id)
        self.save_client_state(client, delta if own is None else {n: own[n] + d for n, d in delta.items()})
        self._upload = delta

    def receive_upload(self, client: ClientContext, upload: Mapping[str, Tensor]) -> None:
        """The server half takes a client's ``delta c_i`` (called by the round, on the server's copy)."""
        _server_half(client).receive(upload, client.num_samples, total_train_samples(self.trainer))

    def extra_upload(self, client: ClientContext) -> dict[str, Tensor]:
        """``delta c_i``, sent with the weights (called after ``on_client_end``)."""
        upload, self._upload = self._upload, {}
        return upload
