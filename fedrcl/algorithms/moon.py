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

from pathlib import Path
from typing import Any, Optional

import torch.nn.functional as F
from torch import Tensor

from fedrcl.algorithms.global_teacher import GlobalTeacherClient
from fedrcl.federated.client_state import ClientStateStore
from fedrcl.federated.context import ClientContext
from fedrcl.federated.strategy import gather_objects
from fedrcl.federated.teacher import FrozenGlobalModel
from fedrcl.losses.model_contrastive import model_contrastive_loss
from fedrcl.models.output import ModelOutput


class MOON(GlobalTeacherClient):
    """Cross-entropy plus the model-contrastive loss (global model: positive, previous local model: negative).

    Args:
        mu: weight of the model-contrastive term; must be >= 0.
        temperature: temperature of the model-contrastive term; must be > 0.
        state_dir: folder of the per-client state files; null: ``client_state`` in the run's log dir.
        max_states_in_memory: client states kept in the CPU cache (the rest is read from disk).
    """

    unbatchable_reason = "MOON keeps a previous local model per client"

    def __init__(self, mu: float = 1.0, temperature: float = 0.5, state_dir: Optional[str] = None,
                 max_states_in_memory: int = 8, **kwargs: Any):
        super().__init__(**kwargs)
        if mu < 0:
            raise ValueError(f"model.mu must be >= 0, got {mu}")
        if temperature <= 0:
            raise ValueError(f"model.temperature must be > 0, got {temperature}")
        if max_states_in_memory < 0:
            raise ValueError(f"model.max_states_in_memory must be >= 0, got {max_states_in_memory}")
        self.mu, self.temperature = mu, temperature
        self.state_dir, self.max_states_in_memory = state_dir, max_states_in_memory
        self.previous = FrozenGlobalModel()  # the client's previous local model
        self.has_previous = False
        self.store: Optional[ClientStateStore] = None
        self._written: dict[int, str] = {}  # this round's files of this process's clients

    def setup(self, stage: str) -> None:
        if self.store is None:
            root = self.trainer.log_dir or self.trainer.default_root_dir
            directory = self.state_dir or Path(root) / "client_state"
            checkpoints = [c.dirpath for c in self.trainer.checkpoint_callbacks if c.dirpath]
            self.store = ClientStateStore(directory, max_in_memory=self.max_states_in_memory,
                                          checkpoint_dirs=checkpoints)

    def on_client_start(self, client: ClientContext) -> None:
        super().on_client_start(client)
        previous = self.store.get(client.client_id)
        self.has_previous = previous is not None
        if self.has_previous:
            self.previous.load_(self.backbone, previous)

    def on_client_end(self, client: ClientContext) -> None:
        path = self.store.put(client.client_id, self.backbone.state_dict(), round_idx=client.round_idx)
        self._written[client.client_id] = str(path)

    def on_train_epoch_end(self) -> None:
        super().on_train_epoch_end()
        if self.trainer.world_size > 1:  # before the checkpoint: every process's manifest covers every client
            for rank, files in enumerate(gather_objects(self.trainer, self._written)):
                if rank != self.trainer.global_rank:
                    self.store.adopt(files)
        self._written = {}

    def client_loss(self, x: Tensor, y: Tensor, out: ModelOutput) -> tuple[Tensor, dict[str, Tensor]]:
        ce = F.cross_entropy(out.logits, y)
        z_prev = self.previous(x).features[-1] if self.has_previous else None
        con = model_contrastive_loss(out.features[-1], self.teacher(x).features[-1], z_prev, self.temperature)
        return ce + self.mu * con, {"ce": ce, "con": con}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        if self.store is not None:
            checkpoint["client_state"] = self.store.state_dict()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        if "client_state" in checkpoint and self.store is not None:
            self.store.load_state_dict(checkpoint["client_state"])
