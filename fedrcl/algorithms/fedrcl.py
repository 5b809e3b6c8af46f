"""FedRCL client (Seo et al., "Relaxed Contrastive Learning for Federated Learning", CVPR 2024).

    loss = CE + (1/L) sum_l [ SCL_l + beta * penalty_l ]

over feature levels l of the local model (``fedrcl.losses.relaxed_contrastive_terms``): a supervised
contrastive term on the mini-batch plus a divergence penalty on same-class pairs more similar than
``threshold``. Defaults are the paper's (tau 0.05, lambda 0.7, beta 1, all levels) with the released
code's hard mining (1 least-similar positive, 2 most-similar negatives).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from fedrcl.algorithms.fedavg import FedAvg
from fedrcl.losses.relaxed_contrastive import relaxed_contrastive_terms
from fedrcl.models.output import ModelOutput, feature_dims


class FedRCL(FedAvg):
    """Cross-entropy plus the relaxed contrastive loss averaged over feature levels.

    Args:
        temperature: tau of the contrastive terms.
        threshold: lambda: same-class pairs at least this similar are pushed apart.
        beta: weight of the divergence penalty (0 gives FedSCL). Sweepable (``fedrcl sweep`` trains several values
            together).
        pos_topk: positives per anchor (least similar first; the anchor itself is a candidate); null with
            neg_topk null gives the paper's all-pairs equation.
        neg_topk: negatives per anchor (most similar first).
        levels: which feature levels to use (indices into the backbone's levels, negative from the end,
            e.g. [-1] for the last level only); null uses all.
    """

    SWEEPABLE = ("beta",)

    def __init__(
        self,
        temperature: float = 0.05,
        threshold: float = 0.7,
        beta: float = 1.0,
        pos_topk: Optional[int] = 1,
        neg_topk: Optional[int] = 2,
        levels: Optional[list[int]] = None,
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        if (pos_topk is None) != (neg_topk is None):
            raise ValueError("model.pos_topk and model.neg_topk must both be set or both be null")
        self.temperature, self.threshold, self.beta = temperature, threshold, beta
        self.pos_topk, self.neg_topk = pos_topk, neg_topk
        num_levels = len(feature_dims(self.backbone))
        for level in levels or []:
            if not -num_levels <= level < num_levels:
                raise ValueError(f"model.levels entry {level} is outside the backbone's {num_levels} levels")
        self.levels = [l % num_levels for l in levels] if levels else list(range(num_levels))

    def client_loss(self, x: Tensor, y: Tensor, out: ModelOutput) -> tuple[Tensor, dict[str, Tensor]]:
        ce = F.cross_entropy(out.logits, y)
        scls, penalties = zip(*(relaxed_contrastive_terms(
            out.features[l], y, temperature=self.temperature, threshold=self.threshold,
            pos_topk=self.pos_topk, neg_topk=self.neg_topk) for l in self.levels))
        scl, penalty = torch.stack(scls).mean(), torch.stack(penalties).mean()
        loss = ce + scl + self.beta * penalty
        parts = {"ce": ce, "scl": scl, "penalty": penalty}
        for l, s, p in zip(self.levels, scls, penalties):
            parts[f"scl_level{l}"], parts[f"penalty_level{l}"] = s, p
        return loss, parts


class FedSCL(FedRCL):
    """FedRCL without the divergence penalty (beta = 0): plain supervised contrastive learning per level.

    Args:
        beta: weight of the divergence penalty (0 for SCL).
    """

    def __init__(self, beta: float = 0.0, **kwargs: Any):
        super().__init__(beta=beta, **kwargs)
