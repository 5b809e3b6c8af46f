"""FitNet on FedAvg (Romero et al., "FitNets: Hints for Thin Deep Nets", ICLR 2015, as the FedAvg + FitNet
baseline of FedMLB and FedRCL).

    loss = CE(f(x), y) + lambda * (1/L) sum_l MSE(h_l(x), g_l(x))

with ``h_l`` the local model's and ``g_l`` the round's global model's features at each of the backbone's
L levels (``fedrcl.losses.feature_distillation``): globally average-pooled, before the level's ReLU (the
``ModelOutput`` contract), rather than FitNet's full feature maps. The global model is one frozen copy kept
outside the module's state (``FrozenGlobalModel``), overwritten at each client's start. Default
lambda = 0.001 (FedRCL paper, supplement).
"""
from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import Tensor

from fedrcl.algorithms.global_teacher import GlobalTeacherClient
from fedrcl.losses.feature_distillation import hint_losses
from fedrcl.models.output import ModelOutput


class FitNet(GlobalTeacherClient):
    """Cross-entropy plus feature hints from the round's global model at every level.

    Args:
        hint_weight: lambda, the weight of the mean hint loss over levels; must be >= 0.
    """

    def __init__(self, hint_weight: float = 0.001, **kwargs: Any):
        super().__init__(**kwargs)
        if hint_weight < 0:
            raise ValueError(f"model.hint_weight must be >= 0, got {hint_weight}")
        self.hint_weight = hint_weight


    def client_loss(self, x: Tensor, y: Tensor, out: ModelOutput) -> tuple[Tensor, dict[str, Tensor]]:
        ce = F.cross_entropy(out.logits, y)
        hints = hint_losses(out.features, self.teacher(x).features)
        hint = hints.mean()
        parts = {"ce": ce, "hint": hint}
        parts.update({f"hint_level{l}": h for l, h in enumerate(hints)})
        return ce + self.hint_weight * hint, parts
