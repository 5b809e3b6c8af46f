"""FedCL: FedAvg plus self-supervised contrastive learning at every level (FedRCL paper, Table 3).

    loss = CE(f(x_1), y) + weight * (1/L) sum_l InfoNCE(h_l(x_1), h_l(x_2))

with ``x_1``, ``x_2`` two independently augmented views of the batch and ``h_l`` the local model's pooled
features at level ``l`` (before the level's ReLU), temperature 0.05 (``fedrcl.losses.info_nce``). Labels only
enter the CE, which is taken on the first view so that it is FedAvg's; every other image of the batch is a
negative. The two views come from the datamodule (``data.views: 2``, set by ``configs/methods/fedcl.yaml``):
a batch is ``cat([x_1, x_2])`` with the labels repeated.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from fedrcl.algorithms.fedavg import FedAvg
from fedrcl.data.datamodule import datamodule_of
from fedrcl.losses.info_nce import info_nce
from fedrcl.models.output import ModelOutput, feature_dims


class FedCL(FedAvg):
    """Cross-entropy plus two-view InfoNCE averaged over feature levels.

    Args:
        temperature: InfoNCE temperature; must be > 0.
        weight: weight of the mean InfoNCE term; must be >= 0. Sweepable (``fedrcl sweep`` trains several values
            together).
        levels: which feature levels to use (negative from the end); null uses all.
    """

    SWEEPABLE = ("weight",)

    def __init__(self, temperature: float = 0.05, weight: float = 1.0, levels: Optional[list[int]] = None,
                 **kwargs: Any):
        super().__init__(**kwargs)
        if temperature <= 0:
            raise ValueError(f"model.temperature must be > 0, got {temperature}")
        if weight < 0:
            raise ValueError(f"model.weight must be >= 0, got {weight}")
        num_levels = len(feature_dims(self.backbone))
        for level in levels or []:
            if not -num_levels <= level < num_levels:
                raise ValueError(f"model.levels entry {level} is outside the backbone's {num_levels} levels")
        self.temperature, self.weight = temperature, weight
        self.levels = [l % num_levels for l in levels] if levels else list(range(num_levels))

    def setup(self, stage: str) -> None:
        views = getattr(datamodule_of(self.trainer), "views", 1)
        if stage == "fit" and views != 2:
            raise ValueError(f"FedCL needs two views per batch: set data.views: 2 (got {views}); "
                             "configs/methods/fedcl.yaml does")

    def client_loss(self, x: Tensor, y: Tensor, out: ModelOutput) -> tuple[Tensor, dict[str, Tensor]]:
        b = len(y) // 2
        ce = F.cross_entropy(out.logits[:b], y[:b])
        per_level = [info_nce(out.features[l][:b], out.features[l][b:], self.temperature) for l in self.levels]
        nce = torch.stack(per_level).mean()
        parts = {"ce": ce, "infonce": nce}
        parts.update({f"infonce_level{l}": v for l, v in zip(self.levels, per_level)})
        return ce + self.weight * nce, parts
