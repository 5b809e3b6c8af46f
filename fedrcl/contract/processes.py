"""What a method and the round need of the processes a run spans: sums and gathers over them, no-ops on one.

A round's clients may be spread over processes (``fedrcl.federated.strategy.FederatedStrategy``); what a method
keeps across them (FedDyn's sample counts, a client-state manifest) and the round's sums meet here.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Optional

import lightning as L
import torch
import torch.distributed as dist
from torch import Tensor


def all_reduce_sum(tensor: Tensor) -> Tensor:
    """``tensor`` summed over all processes, in place, in one all-reduce (Lightning's ``reduce`` adds a
    barrier before it)."""
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def process_sum(trainer: L.Trainer) -> Optional[Callable[[Tensor], Tensor]]:
    """``all_reduce_sum`` with several processes, ``None`` (nothing to reduce) with one."""
    return all_reduce_sum if trainer.world_size > 1 else None


def sum_over_processes(trainer: L.Trainer, values: Mapping[str, Tensor], count: float
                       ) -> tuple[dict[str, Tensor], float]:
    """Named scalars and a count, each summed over all processes, in one all-reduce (float64, keys sorted
    so that every process packs them in the same order). Unchanged on one process."""
    if trainer.world_size == 1:
        return dict(values), count
    keys = sorted(values)
    device = trainer.strategy.root_device
    packed = torch.stack([*(values[k].detach().to(device, torch.float64) for k in keys),
                          torch.tensor(float(count), dtype=torch.float64, device=device)])
    all_reduce_sum(packed)
    return {k: packed[i] for i, k in enumerate(keys)}, packed[-1].item()


def gather_objects(trainer: L.Trainer, obj: Any) -> list[Any]:
    """Every process's ``obj`` (picklable), in rank order; ``[obj]`` on one process."""
    if trainer.world_size == 1:
        return [obj]
    gathered: list[Any] = [None] * trainer.world_size
    dist.all_gather_object(gathered, obj)
    return gathered
