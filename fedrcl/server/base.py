"""The server side of a round: what is broadcast to clients and how their average becomes the new model.

A server optimizer sees only model weights, never client data. The round loop calls, in order:

1. ``sent = server.broadcast(global_state)``: the weights every sampled client starts from
   (plain FedAvg sends the global model itself; FedACG sends a look-ahead);
2. the clients train from ``sent``, each step adding ``server.client_regularizer(params, sent)`` to its
   local loss when that is not ``None`` (FedACG's proximal term); their weights are averaged
   (``fedrcl.federated.aggregation``);
3. ``global_state = server.step(global_state, sent, client_mean)``: the new global model.

Every optimizer here works on the round's update ``delta = client_mean - sent`` (the weighted mean of the
client weights minus the weights they started from). Only floating-point entries of a state dict are
updated; integer buffers (counters) keep the global value. ``state_dict``/``load_state_dict`` carry server
memory (momenta, moments) through checkpoints, so ``--ckpt_path last`` resumes exactly.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import torch
from torch import Tensor

from fedrcl.contract.exchange import ServerExchange

State = dict[str, Tensor]


def round_update(sent: Mapping[str, Tensor], client_mean: Mapping[str, Tensor]) -> State:
    """``delta = client_mean - sent`` for every floating-point entry (integer buffers are left out)."""
    return {k: client_mean[k] - v for k, v in sent.items() if v.is_floating_point()}


def check_unit_interval(name: str, value: float) -> None:
    """Raise a ``ValueError`` naming ``trainer.server.init_args.<name>`` unless 0 <= value < 1."""
    if not 0 <= value < 1:
        raise ValueError(f"trainer.server.init_args.{name} must be in [0, 1), got {value}")


def check_positive(name: str, value: float) -> None:
    """Raise a ``ValueError`` naming ``trainer.server.init_args.<name>`` unless value > 0."""
    if not value > 0:
        raise ValueError(f"trainer.server.init_args.{name} must be > 0, got {value}")


class ServerOptimizer(ServerExchange):
    """Base class: broadcast the global model unchanged; no client term; no server memory; nothing sent
    besides the weights (``fedrcl.contract.exchange``: ``extra_broadcast`` / ``load_broadcast``)."""

    def broadcast(self, global_state: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
        """Weights the round's clients start from (not modified by the caller)."""
        return global_state

    def client_regularizer(self, params: Mapping[str, Tensor], sent: Mapping[str, Tensor]) -> Optional[Tensor]:
        """A term the server adds to every client's local loss at every step; ``None`` adds nothing.

        Args:
            params: the client model's trainable parameters by state-dict name (they carry gradients).
            sent: this round's ``broadcast`` result, the weights the client started from (read-only).

        Returns:
            A scalar tensor that the client algorithm adds to its loss and logs as ``train/loss_server``,
            or ``None``.
        """
        return None

    def step(self, global_state: State, sent: Mapping[str, Tensor], client_mean: Mapping[str, Tensor]) -> State:
        """New global weights from the old ones, what was broadcast, and the clients' weighted mean.

        ``client_mean`` holds only the floating-point entries; every other entry keeps ``global_state``'s value.
        """
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """Server memory to checkpoint (empty for memoryless servers); tensors and plain containers only."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""


class StatefulServer(ServerOptimizer):
    """A server optimizer with per-entry memory (momenta, moments), e.g. ``memory["momentum"][key]``.

    Memory is created at the first ``step`` with the shapes, dtype and device of the round's update, follows
    the weights to their device, and round-trips through ``state_dict``/``load_state_dict`` (before the first
    step both are empty).
    """

    def __init__(self) -> None:
        self.memory: dict[str, State] = {}

    def buffer(self, name: str, like: Mapping[str, Tensor], fill: float = 0.0) -> State:
        """Memory ``name`` on ``like``'s devices, created filled with ``fill`` if it does not exist yet. ``like``
        may name fewer entries than the memory holds (a client reads its trainable parameters' share of memory
        created over every floating-point entry, BatchNorm statistics included); those it names follow it."""
        if name not in self.memory:
            self.memory[name] = {k: torch.full_like(v, fill) for k, v in like.items()}
        memory = self.memory[name]
        for k, v in like.items():
            if k in memory and memory[k].device != v.device:  # e.g. a checkpoint loaded on the CPU, weights on a GPU
                memory[k] = memory[k].to(v.device)
        return memory

    def state_dict(self) -> dict[str, State]:
        return {name: {k: v.detach().clone() for k, v in memory.items()} for name, memory in self.memory.items()}

    def load_state_dict(self, state: dict[str, State]) -> None:
        self.memory = {name: {k: v.detach().clone() for k, v in memory.items()} for name, memory in state.items()}


class FedAvg(ServerOptimizer):
    """FedAvg (McMahan et al., 2017): ``w <- w + delta``, i.e. the sample-weighted mean of the clients."""

    def step(self, global_state: State, sent: Mapping[str, Tensor], client_mean: Mapping[str, Tensor]) -> State:
        return {k: client_mean[k] if v.is_floating_point() else v for k, v in global_state.items()}
