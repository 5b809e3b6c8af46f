"""What the round needs of the objects it drives, as protocols: a method sees batched clients through these."""
from __future__ import annotations

from typing import Protocol

from torch import Tensor


class ClientStack(Protocol):
    """A round's clients training together on a leading client axis (``fedrcl.federated.batched.StackedClients``),
    as the client algorithm's ``training_step`` and gradient clipping see them."""

    def __len__(self) -> int:
        """How many clients train together."""
        ...

    def losses(self, x: Tensor, y: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """Per-client losses ``[K]`` and loss parts (each ``[K]``) of one stacked batch (``x[k]``, ``y[k]``)."""
        ...

    params: dict[str, Tensor]  # the stacked weights ``[K, ...]`` by the backbone's parameter names

    def directions(self, x: Tensor, y: Tensor) -> tuple[dict[str, Tensor], Tensor, dict[str, Tensor]]:
        """Each client's ``client_direction`` on its batch: directions ``[K, ...]``, losses ``[K]``, parts."""
        ...

    def clip_grad_norm_(self, max_norm: float) -> None:
        """Clip each client's gradient to total 2-norm ``max_norm``."""
        ...
