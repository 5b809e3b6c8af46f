"""The round plan: which clients this process trains in a round and how many steps each takes."""
from __future__ import annotations

import bisect
from dataclasses import dataclass


@dataclass(frozen=True)
class ClientSlot:
    """Where a batch falls in the round: the client, its step within the client and local epoch."""

    position: int
    client_id: int
    step: int
    local_epoch: int
    first_step_of_epoch: bool
    last_step_of_client: bool


@dataclass(frozen=True)
class RoundPlan:
    """The clients one process trains in one round, in order, with their step counts.

    A round is a single stream of batches: client after client, each for ``steps_per_epoch * local_epochs``
    steps. ``locate(batch_idx)`` maps a batch of that stream back to its client; the round loop uses it to
    swap weights at client boundaries.

    Attributes:
        round_idx: 0-based round index.
        client_ids: the clients this process trains, in order.
        num_samples: each client's training-set size (aggregation weight).
        steps_per_epoch: each client's steps per local epoch.
        local_epochs: local epochs per client.
        batched: the clients train together (``fedrcl.federated.batched``): the stream has one stacked batch
            per local step, every client's step at once, and ``locate`` reports position 0 for all of them.
    """

    round_idx: int
    client_ids: tuple[int, ...]
    num_samples: tuple[int, ...]
    steps_per_epoch: tuple[int, ...]
    local_epochs: int
    batched: bool = False

    @property
    def steps(self) -> tuple[int, ...]:
        """Local steps per client this round."""
        return tuple(s * self.local_epochs for s in self.steps_per_epoch)

    @property
    def total_steps(self) -> int:
        """Batches in the round's stream."""
        return self.steps[0] if self.batched else sum(self.steps)

    def locate(self, batch_idx: int) -> ClientSlot:
        """The client slot of the ``batch_idx``-th batch of the round."""
        starts, acc = [], 0
        for s in self.steps[:1] if self.batched else self.steps:
            starts.append(acc)
            acc += s
        if not 0 <= batch_idx < acc:
            raise IndexError(f"batch {batch_idx} is outside the round's {acc} steps")
        position = bisect.bisect_right(starts, batch_idx) - 1
        step = batch_idx - starts[position]
        per_epoch = self.steps_per_epoch[position]
        return ClientSlot(
            position=position,
            client_id=self.client_ids[position],
            step=step,
            local_epoch=step // per_epoch,
            first_step_of_epoch=step % per_epoch == 0,
            last_step_of_client=step == self.steps[position] - 1,
        )
