"""What the round needs of the objects it drives, as protocols: a method sees batched clients through these."""
from __future__ import annotations

from typing import Protocol

from torch import Tensor


class ClientStack(Protocol):
    """A round's clients training together on a leading client axis (``fedrcl.federated.stacked.StackedClients``),
    as the client algorithm's ``training_step`` sees them."""

    def step(self, x: Tensor, y: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """Take the next stacked step of every client that steps (the stacked engine: the method's loss or
        ``client_direction``, per-client clip, SGD) on one stacked batch: ``x[k]``, ``y[k]`` when every client steps
        with one batch size, else the stepping clients' batches concatenated (``fedrcl.contract.step_mask``).
        Returns the stepping clients' losses and loss parts."""
        ...

    def lightning_loss(self) -> Tensor:
        """What Lightning's step backpropagates and steps on once the engine has stepped: it moves nothing."""
        ...
