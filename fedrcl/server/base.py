"""The server side of a round: what is broadcast to clients and how their average becomes the new model.

A server optimizer sees only model weights, never client data. The round loop calls, in order:

1. ``sent = server.broadcast(global_state)``: the weights every sampled client starts from
   (plain FedAvg sends the global model itself; FedACG sends a look-ahead);
2. the clients train from ``sent``; their weights are averaged (``fedrcl.federated.aggregation``);
3. ``global_state = server.step(global_state, sent, client_mean)``: the new global model.

Only floating-point entries of a state dict are updated; integer buffers (counters) keep the global
value. ``state_dict``/``load_state_dict`` carry server memory (momenta, moments) through checkpoints, so
``--ckpt_path last`` resumes exactly.
"""
from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

State = dict[str, Tensor]


class ServerOptimizer:
    """Base class: broadcast the global model unchanged; no server memory."""

    def broadcast(self, global_state: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
        """Weights the round's clients start from."""
        return global_state

    def step(self, global_state: State, sent: Mapping[str, Tensor], client_mean: Mapping[str, Tensor]) -> State:
        """New global weights from the old ones, what was broadcast, and the clients' weighted mean."""
        raise NotImplementedError

    def state_dict(self) -> dict:
        """Server memory to checkpoint (empty for memoryless servers)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` returned."""


class FedAvg(ServerOptimizer):
    """FedAvg (McMahan et al., 2017): ``w <- w + delta``, i.e. the sample-weighted mean of the clients."""

    def step(self, global_state: State, sent: Mapping[str, Tensor], client_mean: Mapping[str, Tensor]) -> State:
        return {k: client_mean[k] if v.is_floating_point() else v for k, v in global_state.items()}
