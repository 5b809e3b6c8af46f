"""A step mask: clients with different step counts trained on one stacked axis.

With ``data.local_iters_per_epoch: null`` each client takes ``ceil(n_k / B)`` steps per local epoch, the last one
on a smaller batch, so a round's clients differ in step count and batch sizes. Stacked (batched clients, seeds
together), client ``k`` takes its own steps ``0 .. steps_k - 1`` at stacked steps ``0 .. steps_k - 1`` and is
finished after them; the round has ``max_k steps_k`` stacked steps. At each stacked step the clients that step
are grouped by batch size (``step_groups``) and each group's loss is mapped over its own slices of the stacked
weights, on its members' real batches: nothing is padded into a loss (FedJAX pads and masks client blocks; a
contrastive loss over padded samples would change). The gradient reaches only the slices that stepped; a finished
client's weights and momenta are kept exactly as they were (``keep``), so that weight decay and momentum do not
move it. Everything here is fixed by the round's plan before it starts (sizes, groups, index tensors on the
device): no host sync per step.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor


def client_batch_sizes(num_samples: int, batch_size: int, local_epochs: int,
                       iters_per_epoch: Optional[int]) -> tuple[int, ...]:
    """The batch size of each of a client's steps in a round (``FederatedDataModule.client_batches``' rule):
    ``iters_per_epoch`` full batches per epoch, or with ``None`` one pass over its ``num_samples`` per epoch,
    the last batch holding what is left."""
    if iters_per_epoch is not None:
        return (batch_size,) * (iters_per_epoch * local_epochs)
    full, rest = divmod(num_samples, batch_size)
    return ((batch_size,) * full + ((rest,) if rest else ())) * local_epochs


def uniform(sizes: Sequence[Sequence[int]]) -> bool:
    """Whether every client takes the same steps with the same batch sizes (no mask: the plain stacked step)."""
    return all(tuple(s) == tuple(sizes[0]) for s in sizes)


@dataclass(frozen=True)
class StepGroup:
    """Clients that take a stacked step with the same batch size: their positions on the client axis."""

    positions: tuple[int, ...]
    batch_size: int


def step_groups(sizes: Sequence[Sequence[int]]) -> tuple[tuple[StepGroup, ...], ...]:
    """Per stacked step, the clients that step, grouped by batch size (``sizes[k]``: client ``k``'s batch size per
    step); groups by decreasing batch size, positions ascending. A batched step's input is the groups' batches
    concatenated in this order (``split_groups``)."""
    groups = []
    for t in range(max(len(s) for s in sizes)):
        by_size: dict[int, list[int]] = {}
        for k, s in enumerate(sizes):
            if t < len(s):
                by_size.setdefault(s[t], []).append(k)
        groups.append(tuple(StepGroup(tuple(by_size[b]), b) for b in sorted(by_size, reverse=True)))
    return tuple(groups)


def client_epochs(steps_per_epoch: Sequence[int], local_epochs: int) -> tuple[dict[int, int], ...]:
    """Per stacked step, the local epoch of each client that steps (position -> epoch)."""
    steps = [s * local_epochs for s in steps_per_epoch]
    return tuple({k: t // steps_per_epoch[k] for k in range(len(steps)) if t < steps[k]} for t in range(max(steps)))


def keep(new: Tensor, old: Tensor, stepping: Tensor) -> Tensor:
    """``new`` in the slices of the clients that stepped (``stepping``: ``[K]`` booleans), ``old`` elsewhere,
    exactly: a finished client's weights or momenta stay as they were."""
    return torch.where(stepping.view(-1, *([1] * (new.dim() - 1))), new, old)


def masked_batch(batches: Sequence[Optional[tuple[Tensor, Tensor]]], groups: Sequence[StepGroup]
                 ) -> tuple[Tensor, Tensor]:
    """A masked step's input: the batches of the clients that step (``batches[k]``: client ``k``'s, ``None`` once
    it has finished) concatenated in the groups' order."""
    order = [batches[k] for g in groups for k in g.positions]
    assert all(b is not None for b in order), "a client that steps has a batch"
    return torch.cat([b[0] for b in order if b is not None]), torch.cat([b[1] for b in order if b is not None])


def split_groups(x: Tensor, y: Tensor, groups: Sequence[StepGroup]) -> list[tuple[Tensor, Tensor]]:
    """A masked step's concatenated batch cut into its groups' ``[G, rows, ...]`` batches. Each client has the
    same number of rows in ``x`` and ``y`` (``views`` x its batch size: ``data.views``)."""
    samples = sum(len(g.positions) * g.batch_size for g in groups)
    views = y.shape[0] // samples
    lengths = [len(g.positions) * g.batch_size * views for g in groups]
    return [(xg.reshape(len(g.positions), -1, *xg.shape[1:]), yg.reshape(len(g.positions), -1, *yg.shape[1:]))
            for g, xg, yg in zip(groups, torch.split(x, lengths), torch.split(y, lengths))]


def client_rows(x: Tensor, y: Tensor, groups: Sequence[StepGroup], position: int) -> tuple[Tensor, Tensor]:
    """Client ``position``'s own batch of a masked step's concatenated batch."""
    for group, (xg, yg) in zip(groups, split_groups(x, y, groups)):
        if position in group.positions:
            i = group.positions.index(position)
            return xg[i], yg[i]
    raise ValueError(f"client {position} takes no step here")


def scattered(like: dict[str, Tensor], indices: Sequence[Tensor], directions: Sequence[dict[str, Tensor]]
              ) -> dict[str, Tensor]:
    """A masked step's directions on the whole client axis: each group's (``directions[g]``, by the names of
    ``like``) in its clients' slices (``indices[g]``), zero for the clients that do not step."""
    out = {name: torch.zeros_like(t) for name, t in like.items()}
    for index, group in zip(indices, directions):
        for name, d in group.items():
            out[name].index_copy_(0, index, d.to(out[name].dtype))
    return out


def joined(outputs: Sequence[tuple[Tensor, dict[str, Tensor]]]) -> tuple[Tensor, dict[str, Tensor]]:
    """A masked step's groups' losses and loss parts, concatenated group after group."""
    losses = torch.cat([loss for loss, _ in outputs])
    return losses, {k: torch.cat([parts[k] for _, parts in outputs]) for k in outputs[0][1]}


class RoundMask:
    """One round's step mask on the device (see the module docstring): per stacked step its groups with their
    positions as index tensors, which clients step (``[K]`` booleans) and which do not (an index tensor)."""

    def __init__(self, sizes: Sequence[Sequence[int]], device: torch.device):
        self.num_clients = len(sizes)
        self.steps = tuple(len(s) for s in sizes)
        self.groups = step_groups(sizes)
        cache: dict[tuple[int, ...], Tensor] = {}

        def index(positions: tuple[int, ...]) -> Tensor:
            if positions not in cache:
                cache[positions] = torch.tensor(positions, dtype=torch.long, device=device)
            return cache[positions]

        self.index = [[index(g.positions) for g in groups] for groups in self.groups]
        stepping = [tuple(sorted(k for g in groups for k in g.positions)) for groups in self.groups]
        self.stepping = [torch.tensor([k in s for k in range(self.num_clients)], device=device) for s in stepping]
        self.idle = [index(tuple(k for k in range(self.num_clients) if k not in s)) for s in stepping]
        self.count = [len(s) for s in stepping]

    def __len__(self) -> int:
        """Stacked steps in the round."""
        return len(self.groups)

    def full(self, t: int) -> bool:
        """Whether at step ``t`` every client steps with one batch size (the plain stacked step)."""
        return len(self.groups[t]) == 1 and self.count[t] == self.num_clients
