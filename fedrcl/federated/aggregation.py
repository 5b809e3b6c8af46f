"""Aggregation: the sample-weighted mean of client weights, summed on the device as clients finish."""
from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import Tensor


class WeightedSum:
    """Running ``sum_k n_k w_k`` and ``sum_k n_k`` over the round's clients.

    Only floating-point entries are summed (integer buffers are never averaged). ``mean(reduce)`` takes an
    all-reduce-sum function so that clients split across processes combine with one reduction per tensor.

    The sums are float64: a float32 weight times a sample count is exact in float64, and so is the sum of
    a round's terms unless their magnitudes differ by more than about 2^18, so the mean does not depend on
    the order in which clients are added or on how they are split over processes (a multi-process run
    gives a one-process run's weights bitwise, tested). Memory: one float64 model copy whatever the number
    of clients.
    """

    def __init__(self, like: Mapping[str, Tensor]):
        self.total = {k: torch.zeros_like(v, dtype=torch.float64)
                      for k, v in like.items() if v.is_floating_point()}
        self.dtypes = {k: like[k].dtype for k in self.total}
        self.weight = 0.0

    def add(self, state: Mapping[str, Tensor], weight: float) -> None:
        """Fold one client's weights in with aggregation weight ``weight`` (its sample count)."""
        for k, acc in self.total.items():
            acc.add_(state[k], alpha=weight)
        self.weight += weight

    def mean(self, reduce: Callable[[Tensor], Tensor] | None = None) -> dict[str, Tensor]:
        """The weighted mean in the entries' own dtypes; ``reduce`` sums a tensor across processes (identity
        on one process)."""
        weight = torch.tensor(self.weight, dtype=torch.float64)
        total = self.total
        if reduce is not None:
            weight = reduce(weight.to(next(iter(total.values())).device)).cpu()
            total = {k: reduce(v) for k, v in total.items()}
        if weight.item() <= 0:
            raise RuntimeError("no client contributed to the round (total aggregation weight is 0)")
        return {k: (v / weight.item()).to(self.dtypes[k]) for k, v in total.items()}

