"""FedDyn client (Acar et al., "Federated Learning Based on Dynamic Regularization", ICLR 2021); its server
half is ``fedrcl.server.FedDyn`` (``trainer.server``), which also holds alpha.

    loss = CE(f(x), y) - <g_i, theta> + alpha/2 ||theta - theta_server||^2

over the backbone's parameters, with ``theta_server`` the broadcast weights and ``g_i`` the client's dual
variable (0 at its first participation; kept on the client, ``PersistentClientState``), updated after local
training as ``g_i <- g_i - alpha (theta_i - theta_server)`` (``fedrcl.losses.dynamic_regularizer``).
The client uploads its weights only (and tells the server its sample count); FedDyn costs FedAvg's bytes.
Execution: batched clients stack ``g_i`` (``client.tensors``); several processes sum the sample counts at
the server step (``fedrcl.server.client_reports``).
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
from fedrcl.losses.dynamic_regularizer import dual_update, dynamic_regularizer
from fedrcl.models.output import ModelOutput
from fedrcl.server.feddyn import FedDyn as FedDynServer


def _server_half(client: Optional[ClientContext]) -> FedDynServer:
    """The client's copy of the server half (``server_half``: a run with another server is refused)."""
    server = client.server if client is not None else None
    assert isinstance(server, FedDynServer), "FedDyn runs with its server half"
    return server


class FedDyn(PersistentClientState):
    """Cross-entropy plus the dynamic regulariser (see the module docstring).

    Args: those of ``PersistentClientState`` (where the g_i files go) and ``FedAvg``; alpha is the server's
    (``trainer.server.init_args.alpha``), shared by both halves.
    """

    server_half = (FedDynServer, "configs/methods/feddyn.yaml")

    def on_client_start(self, client: ClientContext) -> None:
        super().on_client_start(client)
        own = self.load_client_state(client.client_id)
        client.tensors["dual"] = torch.cat([(torch.zeros_like(p) if own is None else own[n]).reshape(-1)
                                            for n, p in self.backbone.named_parameters()]).detach()

    def client_loss(self, x: Tensor, y: Tensor, out: ModelOutput) -> tuple[Tensor, dict[str, Tensor]]:
        client = self.client
        assert client is not None, "a client's run"
        ce = F.cross_entropy(out.logits, y)
        anchors = [client.global_state[name] for name, _ in self.backbone.named_parameters()]  # the broadcast
        dyn = dynamic_regularizer(list(self.backbone.parameters()), client.tensors["dual"], anchors,
                                  _server_half(client).alpha)
        return ce + dyn, {"ce": ce, "dyn": dyn}

    @torch.no_grad()
    def on_client_end(self, client: ClientContext) -> None:
        own = self.load_client_state(client.client_id)
        state = {n: dual_update(torch.zeros_like(p) if own is None else own[n], p, client.global_state[n],
                                _server_half(client).alpha)
                 for n, p in self.backbone.named_parameters()}
        self.save_client_state(client, state)

    def receive_upload(self, client: ClientContext, upload: Mapping[str, Tensor]) -> None:
        """The server half takes a client's sample count (called by the round, on the server's copy)."""
        _server_half(client).receive(client.num_samples, total_train_samples(self.trainer))
