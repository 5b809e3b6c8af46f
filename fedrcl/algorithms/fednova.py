"""FedNova client (Wang et al., "Tackling the Objective Inconsistency Problem in Heterogeneous Federated
Optimization", NeurIPS 2020); its server half is ``fedrcl.server.FedNova`` (``trainer.server``).

    loss = CE(f(x), y) + mu/2 ||w - x||^2            (FedProx's local solver; mu = 0: FedAvg's)

Local SGD as FedAvg's (the client lr per local epoch, ``model.momentum``: the paper's local momentum). After
its ``tau_i`` steps the client's update ``x - y_i = eta sum_k a_ik g_ik`` is normalised by its gradients'
coefficient sum ``eta ||a_i||_1`` (``fedrcl.losses.normalized_averaging.update_norm``, from the step lrs,
momentum and mu: the paper's ``a_i`` of SGD, of momentum SGD and of the proximal solver, eq. (5) and its
appendix), and the client uploads ``z_i = x - (x - y_i) / (eta ||a_i||_1)`` in place of its weights, with
``eta ||a_i||_1``; the server scales the mean back by ``tau_eff`` (eq. (7)). Clients that take different
numbers of steps (``data.local_iters_per_epoch: null``) then weigh by their data, not by their step counts.
Where all clients take the same steps, FedNova is FedAvg (FedProx with mu).

``||a_i||`` counts every step's full gradient, the clip to ``grad_clip_norm`` included in ``g``: exact unless a
clip scales the proximal term (mu > 0 and a gradient longer than the clip). Bytes: FedAvg's plus one number up.
Execution: every engine (the norm is computed at the client's end from its plan, no per-step hook).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import torch
from torch import Tensor

from fedrcl.algorithms.fedprox import FedProx
from fedrcl.contract.context import ClientContext
from fedrcl.data.datamodule import total_train_samples
from fedrcl.losses.normalized_averaging import normalized_model, update_norm
from fedrcl.server.fednova import FedNova as FedNovaServer


def _server_half(client: Optional[ClientContext]) -> FedNovaServer:
    """The client's copy of the server half (``server_half``: a run with another server is refused)."""
    server = client.server if client is not None else None
    assert isinstance(server, FedNovaServer), "FedNova runs with its server half"
    return server


class FedNova(FedProx):
    """FedProx's (mu = 0: FedAvg's) local objective, the update normalised (see the module docstring).

    Args:
        mu: the proximal term's weight (mu/2 ||w - x||^2, FedNova's proximal variant); >= 0, 0 for plain FedNova.
    """

    server_half = (FedNovaServer, "configs/methods/fednova.yaml")

    def __init__(self, mu: float = 0.0, **kwargs: Any):
        super().__init__(mu=mu, **kwargs)
        self._norm: Optional[Tensor] = None

    def client_norm(self, client: ClientContext) -> float:
        """``eta ||a_i||_1`` of ``client``'s local steps this round (its lr per local epoch, as ``ClientRun``)."""
        lrs = [float(self.client_lr(client.round_idx, epoch)) for epoch in client.step_epochs()]
        return update_norm(lrs, float(self.momentum), float(self.mu))

    @torch.no_grad()
    def on_client_end(self, client: ClientContext) -> None:
        super().on_client_end(client)
        norm = self.client_norm(client)
        for name, w in self.backbone.state_dict().items():
            if w.is_floating_point():  # every entry the server averages
                w.copy_(normalized_model(client.global_state[name], w, norm))
        self._norm = torch.tensor(norm, dtype=torch.float64, device=self.device)

    def extra_upload(self, client: ClientContext) -> dict[str, Tensor]:
        """``eta ||a_i||_1``, sent with the normalised model (called after ``on_client_end``)."""
        norm, self._norm = self._norm, None
        assert norm is not None, "on_client_end computed the norm"
        return {"norm": norm}

    def receive_upload(self, client: ClientContext, upload: Mapping[str, Tensor]) -> None:
        """The server half takes a client's norm (called by the round, on the server's copy)."""
        _server_half(client).receive(upload["norm"], client.num_samples, total_train_samples(self.trainer))
