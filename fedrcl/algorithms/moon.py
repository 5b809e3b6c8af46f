"""MOON client (Li, He, Song, "Model-Contrastive Federated Learning", CVPR 2021).

    loss = CE(f(x), y) + mu * l_con(z, z_glob, z_prev)

with ``z`` the local model's representation, ``z_glob`` the round's global model's and ``z_prev`` the client's
own previous local model's (``fedrcl.losses.model_contrastive``), temperature 0.5 and mu = 1 (FedRCL paper,
supplement). The representation is the backbone's last feature level (pooled, before its ReLU); MOON's
paper adds a projection head on top, which this project's baselines leave out so that every method trains
the same network.

Per-client state: after local training the client's weights go to a ``ClientStateStore`` (one safetensors
file per client under ``<log dir>/client_state``, at most ``max_states_in_memory`` in a CPU cache); at the
client's next participation they are loaded into a second frozen copy. A client's first participation has
no previous model: the term is 0 (the MOON code's first-round convention, applied to every first
participation; with partial participation the MOON code would instead use the client's never-trained
initialisation). The checkpoint holds the store's manifest (paths of the files), so a resumed run reads the
interrupted run's files. With several processes, each writes the clients it trains and, after every
round, learns the files the others wrote (``ClientStateStore.adopt``), since a client may train on another
process next time.
"""
from __future__ import annotations

from typing import Any, Optional

import torch.nn.functional as F
from torch import Tensor

from fedrcl.algorithms.client_memory import PersistentClientState
from fedrcl.algorithms.global_teacher import GlobalTeacherClient
from fedrcl.algorithms.teacher import FrozenGlobalModel
from fedrcl.contract.context import ClientContext
from fedrcl.losses.model_contrastive import model_contrastive_loss
from fedrcl.models.output import ModelOutput


class MOON(GlobalTeacherClient, PersistentClientState):
    """Cross-entropy plus the model-contrastive loss (global model: positive, previous local model: negative).

    Args:
        mu: weight of the model-contrastive term; must be >= 0. Sweepable (declared; MOON's clients cannot train
            batched, so a sweep trains its settings one after another).
        temperature: temperature of the model-contrastive term; must be > 0.
        state_dir: folder of the per-client state files; null: ``client_state`` in the run's log dir.
        max_states_in_memory: client states kept in the CPU cache (the rest is read from disk).
    """

    unbatchable_reason = "MOON keeps a previous local model per client"
    SWEEPABLE = ("mu",)

    def __init__(self, mu: float = 1.0, temperature: float = 0.5, state_dir: Optional[str] = None,
                 max_states_in_memory: int = 8, **kwargs: Any):
        super().__init__(state_dir=state_dir, max_states_in_memory=max_states_in_memory, **kwargs)
        if mu < 0:
            raise ValueError(f"model.mu must be >= 0, got {mu}")
        if temperature <= 0:
            raise ValueError(f"model.temperature must be > 0, got {temperature}")
        self.mu, self.temperature = mu, temperature
        self.previous = FrozenGlobalModel()  # the client's previous local model
        self.has_previous = False

    def on_client_start(self, client: ClientContext) -> None:
        super().on_client_start(client)
        previous = self.load_client_state(client.client_id)
        self.has_previous = previous is not None
        if previous is not None:
            self.previous.load_(self.backbone, previous)

    def on_client_end(self, client: ClientContext) -> None:
        self.save_client_state(client, self.backbone.state_dict())

    def client_loss(self, x: Tensor, y: Tensor, out: ModelOutput) -> tuple[Tensor, dict[str, Tensor]]:
        ce = F.cross_entropy(out.logits, y)
        z_prev = self.previous(x).features[-1] if self.has_previous else None
        con = model_contrastive_loss(out.features[-1], self.teacher(x).features[-1], z_prev, self.temperature)
        return ce + self.mu * con, {"ce": ce, "con": con}
