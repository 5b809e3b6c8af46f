"""Round facts handed to a client algorithm, in one frozen object."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from torch import Tensor


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
    """

    round_idx: int
    client_id: int
    num_samples: int
    num_steps: int
    seed: int
    global_state: Mapping[str, Tensor]
