"""A client algorithm that keeps a state dict per client across rounds (MOON's previous local model,
SCAFFOLD's control variate c_i, FedDyn's dual variable g_i), in a
``fedrcl.algorithms.client_state.ClientStateStore``.

One safetensors file per client under
``<log dir>/client_state`` (or ``state_dir``), at most ``max_states_in_memory`` in a CPU cache; the
checkpoint holds the store's manifest, so a resumed run reads the interrupted run's files; with several
processes each writes the clients it trains and, after every round, adopts the files the others wrote
(a client may train on another process next time).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor

from fedrcl.algorithms.client_state import ClientStateStore
from fedrcl.algorithms.fedavg import FedAvg
from fedrcl.contract.context import ClientContext
from fedrcl.contract.processes import gather_objects


class PersistentClientState(FedAvg):
    """FedAvg plus ``load_client_state`` / ``save_client_state`` (see the module docstring).

    Args:
        state_dir: folder of the per-client state files; null: ``client_state`` in the run's log dir.
        max_states_in_memory: client states kept in the CPU cache (the rest is read from disk).
    """

    def __init__(self, state_dir: Optional[str] = None, max_states_in_memory: int = 8, **kwargs: Any):
        super().__init__(**kwargs)
        if max_states_in_memory < 0:
            raise ValueError(f"model.max_states_in_memory must be >= 0, got {max_states_in_memory}")
        self.state_dir, self.max_states_in_memory = state_dir, max_states_in_memory
        self.store: Optional[ClientStateStore] = None
        self._written: dict[int, str] = {}  # this round's files of this process's clients

    def setup(self, stage: str) -> None:
        if self.store is None:
            root = self.trainer.log_dir or self.trainer.default_root_dir
            directory = self.state_dir or Path(root) / "client_state"
            checkpoints = [c.dirpath for c in self.trainer.checkpoint_callbacks
                           if isinstance(c, ModelCheckpoint) and c.dirpath]
            self.store = ClientStateStore(directory, max_in_memory=self.max_states_in_memory,
                                          checkpoint_dirs=checkpoints)

    def load_client_state(self, client_id: int) -> Optional[dict[str, Tensor]]:
        """The client's state on this module's device, or ``None`` before its first participation."""
        assert self.store is not None, "setup creates the store"
        return self.store.get(client_id, self.device)

    def save_client_state(self, client: ClientContext, state: dict[str, Tensor]) -> None:
        """Keep ``state`` as the client's state after this round (written to disk at once)."""
        assert self.store is not None, "setup creates the store"
        path = self.store.put(client.client_id, state, round_idx=client.round_idx)
        self._written[client.client_id] = str(path)

    def on_train_epoch_end(self) -> None:
        super().on_train_epoch_end()
        if self.trainer.world_size > 1:  # before the checkpoint: every process's manifest covers every client
            assert self.store is not None, "setup creates the store"
            for rank, files in enumerate(gather_objects(self.trainer, self._written)):
                if rank != self.trainer.global_rank:
                    self.store.adopt(files)
        self._written = {}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        if self.store is not None:
            checkpoint["client_state"] = self.store.state_dict()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        if "client_state" in checkpoint and self.store is not None:
            self.store.load_state_dict(checkpoint["client_state"])
