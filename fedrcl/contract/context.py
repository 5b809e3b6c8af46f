"""Round facts handed to a client algorithm, in one frozen object (it imports neither Lightning nor the round loop)."""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

from torch import Tensor


class ClientServer(Protocol):
    """What a client uses of its copy of the server optimizer (``fedrcl.server.ServerOptimizer`` is one)."""

    def client_regularizer(self, params: Mapping[str, Tensor], sent: Mapping[str, Tensor]) -> Optional[Tensor]:
        """A term added to every client's loss (FedACG's), or ``None``."""

    def load_broadcast(self, client: ClientContext, extra: Mapping[str, Tensor]) -> None:
        """Install, in the client's copy, what the server's ``extra_broadcast`` sent (SCAFFOLD's ``c``)."""


class ClientData(Protocol):
    """A client's own training data, as the round hands it to the client's side of a method (the data module
    serves it: ``FederatedDataModule.client_data``). The server's side never holds it: on Flower the context
    that ``receive_upload`` gets has none."""

    num_classes: int

    @property
    def labels(self) -> Tensor:
        """The client's training labels, in its sample order, on the model's device."""

    def batches(self, batch_size: Optional[int] = None) -> Iterator[tuple[Tensor, Tensor]]:
        """The client's training images in order as the model's input (normalised, not augmented), with their
        labels, in batches of ``batch_size`` (default: the evaluation batch size)."""


@dataclass(frozen=True)
class ClientContext:
    """What a client knows while it trains in a round.

    Attributes:
        round_idx: 0-based round index.
        client_id: the client's index in the partition.
        num_samples: the client's training-set size (its aggregation weight).
        num_steps: local optimisation steps this round (local_epochs x steps per epoch).
        seed: the federation's seed; with ``round_idx`` and ``client_id`` it fixes batches and augmentation.
        global_state: the weights the server broadcast this round (read-only; do not modify).
        server: the client's copy of the server optimizer: its ``client_regularizer`` (FedACG's term) and,
            for methods with a server half, that half (SCAFFOLD's control variate, FedDyn's alpha). In one
            process it is the run's server; on a Flower node, the node's copy. ``None`` outside a round.
        data: the client's own training data (``ClientData``), for its hooks (``on_client_start``,
            ``on_client_end``, ``extra_upload``); ``None`` on the server's side of Flower. A batched
            ``client_loss`` cannot read it: read it in ``on_client_start`` into ``tensors``.
        local_epochs: local epochs this round: local epoch ``e`` is steps ``e * num_steps // local_epochs`` on,
            trained at the algorithm's ``client_lr(round_idx, e)`` (SCAFFOLD sums its lrs from these).
        tensors: the client's own inputs to its steps, by name, each a tensor or a dict of tensors:
            ``on_client_start`` puts them here (FedLC's label counts, SCAFFOLD's ``c - c_i``); ``client_loss``
            and ``client_direction`` read them as ``self.client.tensors[name]``; ``client_direction`` may replace
            one for the client's next step (FedSMOO's duals), and ``on_client_end`` reads them as the last step
            left them. Every engine hands each client its own: stacked clients each get their slice. The one
            mutable field: the dict is the client's for the round.
    """

    round_idx: int
    client_id: int
    num_samples: int
    num_steps: int
    seed: int
    global_state: Mapping[str, Tensor]
    server: Optional[ClientServer] = None
    data: Optional[ClientData] = None
    local_epochs: int = 1
    tensors: dict[str, Any] = field(default_factory=dict, compare=False)

    def step_epochs(self) -> list[int]:
        """The local epoch of each of the client's steps this round, in order."""
        per_epoch = int(self.num_steps) // self.local_epochs
        return [step // per_epoch for step in range(int(self.num_steps))]
