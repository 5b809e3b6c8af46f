"""The output contract shared by every backbone in :mod:`fedrcl.models`."""

from typing import NamedTuple

import torch
from torch import Tensor, nn


class ModelOutput(NamedTuple):
    """What a backbone's ``forward`` returns: logits plus per-level features from the same pass.

    Attributes:
        logits: Class scores, shape ``[B, num_classes]``.
        features: One tensor of shape ``[B, C_l]`` per level, in order from input to output.
            Each is the global average pool of that level's activation taken *before* the
            level's final ReLU. ``C_l`` matches the backbone's ``feature_dims[l]``.
    """

    logits: Tensor
    features: list[Tensor]


def check_backbone_args(name: str, num_classes: int, in_channels: int, image_size: int,
                        min_image_size: int = 1) -> None:
    """Reject shapes a backbone cannot be built for, naming the argument and the allowed range."""
    if num_classes < 1:
        raise ValueError(f"{name}: num_classes must be >= 1, got {num_classes}")
    if in_channels < 1:
        raise ValueError(f"{name}: in_channels must be >= 1, got {in_channels}")
    if image_size < min_image_size:
        raise ValueError(f"{name}: image_size must be >= {min_image_size}, got {image_size}")


def feature_dims(backbone: nn.Module) -> list[int]:
    """``backbone.feature_dims``: the width of each entry of its ``ModelOutput.features`` (torch types a
    module's own attributes only as ``Tensor | Module``)."""
    dims: list[int] = getattr(backbone, "feature_dims")
    return dims


class LevelBackbone(nn.Module):
    """A backbone written level by level, so that one ``forward`` serves it and FedMLB can graft levels.

    Subclasses define ``feature_dims``, ``forward_level(level, h)`` (level ``level``'s map before its final
    activation) and ``forward_head(h)`` (logits from the last level's activated map); they override
    ``level_activation`` where a level hands on something other than the ReLU of its map.
    """

    feature_dims: list[int]

    def forward_level(self, level: int, h: Tensor) -> Tensor:
        raise NotImplementedError

    def forward_head(self, h: Tensor) -> Tensor:
        raise NotImplementedError

    def level_activation(self, level: int, pre: Tensor) -> Tensor:
        """What level ``level`` hands to the next one."""
        return torch.relu(pre)

    def forward(self, x: Tensor) -> ModelOutput:
        features: list[Tensor] = []
        h = x
        for level in range(len(self.feature_dims)):
            pre = self.forward_level(level, h)
            features.append(pre.mean(dim=(2, 3)))
            h = self.level_activation(level, pre)
        return ModelOutput(logits=self.forward_head(h), features=features)
