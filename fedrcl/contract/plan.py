"""The round plan: which clients this process trains in a round and how many steps each takes."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property


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
        seed: the federation's seed (with the round and the client it fixes batches and augmentation).
        batched: the clients train together (``fedrcl.federated.batched``): the stream has one stacked batch
            per local step, every client's step at once (clients with fewer steps masked once they finish:
            ``fedrcl.contract.step_mask``), and ``locate`` reports the longest client's slots (position 0's
            where all take the same steps).
        remote: the clients train on other machines (Flower's nodes): the stream has one item,
            ``TrainedElsewhere``, in whose Lightning step the round's clients are trained there and aggregated.
    """

    round_idx: int
    client_ids: tuple[int, ...]
    num_samples: tuple[int, ...]
    steps_per_epoch: tuple[int, ...]
    local_epochs: int
    seed: int = 0
    batched: bool = False
    remote: bool = False

    @classmethod
    def of_clients(cls, round_idx: int, client_ids: Sequence[int], num_samples: Callable[[int], int],
                   steps_per_epoch: Callable[[int], int], local_epochs: int, seed: int) -> RoundPlan:
        """The plan of ``client_ids``, each client's sample count and steps per local epoch looked up by id
        (the data module's, or the lists a Flower server holds)."""
        ids = tuple(client_ids)
        return cls(round_idx=round_idx, client_ids=ids, num_samples=tuple(num_samples(k) for k in ids),
                   steps_per_epoch=tuple(steps_per_epoch(k) for k in ids), local_epochs=local_epochs, seed=seed)

    @cached_property
    def steps(self) -> tuple[int, ...]:
        """Local steps per client this round."""
        return tuple(s * self.local_epochs for s in self.steps_per_epoch)

    @property
    def total_steps(self) -> int:
        """Batches in the round's stream."""
        return len(self._slots)

    def locate(self, batch_idx: int) -> ClientSlot:
        """The client slot of the ``batch_idx``-th batch of the round."""
        if not 0 <= batch_idx < len(self._slots):
            raise IndexError(f"batch {batch_idx} is outside the round's {len(self._slots)} steps")
        return self._slots[batch_idx]

    @cached_property
    def _slots(self) -> tuple[ClientSlot, ...]:
        """Every batch's slot, built once per plan (the round loop asks twice per step)."""
        if self.remote:  # the round is one item of the stream
            return (ClientSlot(position=0, client_id=self.client_ids[0], step=0, local_epoch=0,
                               first_step_of_epoch=True, last_step_of_client=True),)
        longest = max(range(len(self.client_ids)), key=lambda k: self.steps[k])  # the first, if all are equal
        clients = (longest,) if self.batched else range(len(self.client_ids))
        return tuple(
            ClientSlot(position=position, client_id=self.client_ids[position], step=step,
                       local_epoch=step // self.steps_per_epoch[position],
                       first_step_of_epoch=step % self.steps_per_epoch[position] == 0,
                       last_step_of_client=step == self.steps[position] - 1)
            for position in clients for step in range(self.steps[position]))


class TrainedElsewhere:
    """The one item of a round whose clients train on other machines (``RoundPlan.remote``): Lightning's step of
    it trains nothing here (the client algorithm's ``training_step`` returns ``None``); the round loop has the
    clients trained and aggregated around it (``fedrcl.federated.federation.RemoteClients``)."""
