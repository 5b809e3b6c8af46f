"""What clients report to their server half besides their weights (SCAFFOLD, FedDyn), summed over processes.

A client algorithm whose server needs more than the clients' mean weights hands it, at each client's end,
that client's sample count and tensors (``ClientReports.add``); the server folds them into its ``step``.
Sums are float64 with integer sample-count weights, so (as in ``fedrcl.federated.aggregation``) they do not
depend on the order in which clients finish or on how they are split over processes. With several
processes, ``total`` sums each process's part in one all-reduce per tensor; every process calls it at the
same point of the round (the server step), after the round's aggregation. The round hands each client's
upload to the server's copy of the client algorithm (``receive_upload``, ``fedrcl.contract.exchange``),
which reports it to its server half (``client.server``), in one process and on Flower alike.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor


def _sum_over_processes(tensor: Tensor) -> Tensor:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


class ClientReports:
    """The round's ``sum_i n_i`` and ``sum_i n_i t_i`` over the clients that reported, with ``n_all``."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.sums: dict[str, Tensor] = {}
        self.weight = 0.0
        self.total_samples: Optional[int] = None

    def add(self, num_samples: int, total_samples: int, tensors: Mapping[str, Tensor] = {}) -> None:
        """One client's report: its sample count, the federation's (all clients'), and its tensors."""
        if self.total_samples is not None and total_samples != self.total_samples:
            raise ValueError(f"clients report {self.total_samples} and {total_samples} samples in all")
        self.total_samples = total_samples
        for name, t in tensors.items():
            acc = self.sums.get(name)
            if acc is None:
                acc = self.sums[name] = torch.zeros_like(t, dtype=torch.float64)
            acc.add_(t.detach(), alpha=float(num_samples))
        self.weight += float(num_samples)

    def total(self, device: torch.device) -> tuple[float, dict[str, Tensor]]:
        """``(sum_i n_i / n_all, {name: sum_i n_i t_i / n_all})`` over every process's clients, then clear."""
        if self.total_samples is None:
            raise RuntimeError("no client reported to the server this round: the client algorithm does not "
                               "match trainer.server")
        weight = _sum_over_processes(torch.tensor(self.weight, dtype=torch.float64, device=device)).item()
        sums = {k: _sum_over_processes(v) / self.total_samples for k, v in self.sums.items()}
        fraction = weight / self.total_samples
        self.clear()
        return fraction, sums
