"""FedMLB client (Kim, Kim, Han, "Multi-Level Branched Regularization for Federated Learning", ICML 2022).

    loss = CE(f(x), y) + lambda1 * (1/L) sum_k CE(z_k, y) + lambda2 * (1/L) sum_k KL(p_k || p)

Hybrid pathway ``k`` runs the local model up to feature level ``k`` and the round's frozen global model from
level ``k + 1`` to the logits ``z_k``, for every level ``k`` of the backbone (for ResNet-18: after the stem
and after each of the four stages, the last one feeding only the global classifier, as in the authors'
code); ``p_k`` and ``p`` are the softmaxes of ``z_k`` and the main pathway's logits at temperature T
(``fedrcl.losses.branch_distillation``). Gradients reach the local blocks through the frozen global blocks.
The backbone must be a ``fedrcl.models.output.LevelBackbone`` (every backbone in ``fedrcl.models`` is),
which can run level by level (``forward_level``, ``level_activation``, ``forward_head``). Defaults
lambda1 = lambda2 = 1 (FedRCL paper, supplement), T = 1.
"""
from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import Tensor

from fedrcl.algorithms.global_teacher import GlobalTeacherClient
from fedrcl.losses.branch_distillation import hybrid_branch_losses
from fedrcl.models.output import LevelBackbone, ModelOutput


def forward_with_maps(backbone: LevelBackbone, x: Tensor) -> tuple[ModelOutput, list[Tensor]]:
    """``backbone(x)`` plus each level's full activated map (the input of the next level)."""
    h, features, maps = x, [], []
    for level in range(len(backbone.feature_dims)):
        pre = backbone.forward_level(level, h)
        features.append(pre.mean(dim=(2, 3)) if pre.dim() == 4 else pre)
        h = backbone.level_activation(level, pre)
        maps.append(h)
    return ModelOutput(logits=backbone.forward_head(h), features=features), maps


def forward_from(backbone: LevelBackbone, level: int, h: Tensor) -> Tensor:
    """Logits of ``backbone`` run from level ``level + 1`` on ``h``, the activated map of level ``level``."""
    for later in range(level + 1, len(backbone.feature_dims)):
        h = backbone.level_activation(later, backbone.forward_level(later, h))
    return backbone.forward_head(h)


class FedMLB(GlobalTeacherClient):
    """Cross-entropy plus CE and KD on every local-to-global hybrid pathway.

    Args:
        hybrid_ce_weight: lambda1, weight of the hybrid pathways' mean cross-entropy; must be >= 0.
        hybrid_kd_weight: lambda2, weight of the mean KL from the hybrid pathways to the main one; >= 0.
        temperature: softmax temperature T of the KL term; must be > 0.
    """

    backbone: LevelBackbone  # checked in __init__

    def __init__(self, hybrid_ce_weight: float = 1.0, hybrid_kd_weight: float = 1.0, temperature: float = 1.0,
                 **kwargs: Any):
        super().__init__(**kwargs)
        for key, value in (("hybrid_ce_weight", hybrid_ce_weight), ("hybrid_kd_weight", hybrid_kd_weight)):
            if value < 0:
                raise ValueError(f"model.{key} must be >= 0, got {value}")
        if temperature <= 0:
            raise ValueError(f"model.temperature must be > 0, got {temperature}")
        if not isinstance(self.backbone, LevelBackbone):
            raise TypeError(f"FedMLB needs a LevelBackbone (fedrcl.models), got {type(self.backbone).__name__}")
        self.hybrid_ce_weight, self.hybrid_kd_weight, self.temperature = hybrid_ce_weight, hybrid_kd_weight, temperature
        self._maps: list[Tensor] = []


    def client_forward(self, x: Tensor) -> ModelOutput:
        out, self._maps = forward_with_maps(self.backbone, x)
        return out

    def client_loss(self, x: Tensor, y: Tensor, out: ModelOutput) -> tuple[Tensor, dict[str, Tensor]]:
        ce = F.cross_entropy(out.logits, y)
        # Not FrozenGlobalModel.__call__ (no_grad): the gradient must pass through the frozen global blocks.
        teacher = self.teacher.module
        assert isinstance(teacher, LevelBackbone)  # the backbone's copy, loaded at the client's start
        branches = [forward_from(teacher, k, h) for k, h in enumerate(self._maps)]
        self._maps = []
        hybrid_ce, hybrid_kl = hybrid_branch_losses(out.logits, branches, y, self.temperature)
        branch_ce, branch_kd = hybrid_ce.mean(), hybrid_kl.mean()
        loss = ce + self.hybrid_ce_weight * branch_ce + self.hybrid_kd_weight * branch_kd
        return loss, {"ce": ce, "hybrid_ce": branch_ce, "hybrid_kd": branch_kd}
