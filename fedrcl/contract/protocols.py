"""What the round needs of the objects it drives, as protocols: a method sees batched clients through these."""
from __future__ import annotations

from typing import Protocol

from torch import Tensor


class ClientStack(Protocol):
    """A round's clients training together on a leading client axis (``fedrcl.federated.batched.StackedClients``),
    as the client algorithm's ``training_step`` and gradient clipping see them."""

    def __len__(self) -> int:
        """How many clients take the current step (all of the round's, unless some have finished their steps:
        ``fedrcl.contract.step_mask``)."""
        ...

    def losses(self, x: Tensor, y: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """Per-client losses and loss parts (each ``[len(self)]``) of one stacked batch: ``x[k]``, ``y[k]`` when every
        client steps with one batch size, else the stepping clients' batches concatenated (the step mask)."""
        ...

    params: dict[str, Tensor]  # the stacked weights ``[K, ...]`` by the backbone's parameter names

    def directions(self, x: Tensor, y: Tensor) -> tuple[dict[str, Tensor], Tensor, dict[str, Tensor]]:
        """Each client's ``client_direction`` on its batch: directions ``[K, ...]`` (zero for a client that does not
        step), losses and parts of the clients that step."""
        ...

    def clip_grad_norm_(self, max_norm: float) -> None:
        """Clip each client's gradient to total 2-norm ``max_norm``."""
        ...
