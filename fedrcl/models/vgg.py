"""VGG-9 with GroupNorm, one of the other backbones of the FedRCL paper (supplement Table C).

Layout (the authors' release, after FedMA's VGG-9): six 3x3 convs (padding 1, with bias) of
32, 64, 128, 128, 256, 256 channels, each followed by GroupNorm and ReLU, with a 2x2 max-pool after the
2nd, 4th and 6th; then an adaptive average pool to 4x4 (so 32 px and 64 px inputs both give 4096
values), and three linear layers 4096 -> 512 -> 512 -> num_classes with ReLUs between them.

Level taps (six, one per conv; ``feature_dims == [32, 64, 128, 128, 256, 256]``): level ``l`` is the
GroupNorm output of conv ``l + 1``, taken before its ReLU and before any max-pool, then globally
average-pooled. The max-pool after a conv belongs to the next level (or the head). The hidden linear
layers and the logits are not levels. The authors' code exposes the same six conv outputs (post-ReLU,
post-pool) and its FedRCL config applies the loss to the first five (``branch_level: [0,1,2,3,4]``);
``--model.init_args.levels [0,1,2,3,4]`` reproduces that choice.
"""

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedrcl.models.output import LevelBackbone, check_backbone_args

_CHANNELS = (32, 64, 128, 128, 256, 256)
_POOL_BEFORE = (2, 4)  # levels whose input is max-pooled first (the pools after conv2 and conv4)


class VGG9(LevelBackbone):
    """VGG-9 for small images with GroupNorm (see the module docstring for layout and level taps).

    Conv weights are drawn from ``N(0, 2 / (9 * out_channels))`` with zero biases (the authors'
    release); linear layers and GroupNorm use PyTorch's defaults.

    Args:
        num_classes: Number of output classes.
        in_channels: Channels of the input images (1 for grey scale, 3 for RGB).
        image_size: Side length in pixels of the (square) input images; at least 8 (three 2x2
            max-pools); the layout does not depend on it.
        norm_groups: Number of groups of every GroupNorm (the paper uses 2).
    """

    def __init__(self, num_classes: int, in_channels: int = 3, image_size: int = 32, norm_groups: int = 2) -> None:
        super().__init__()
        check_backbone_args("VGG9", num_classes, in_channels, image_size, min_image_size=8)  # 3 max-pools
        if norm_groups < 1 or any(c % norm_groups for c in _CHANNELS):
            raise ValueError(f"norm_groups ({norm_groups}) must divide every channel count {_CHANNELS}")
        self.num_classes, self.in_channels, self.image_size = num_classes, in_channels, image_size
        self.norm_groups = norm_groups

        blocks = []
        prev = in_channels
        for ch in _CHANNELS:
            blocks.append(nn.Sequential(nn.Conv2d(prev, ch, 3, padding=1), nn.GroupNorm(norm_groups, ch)))
            prev = ch
        self.blocks = nn.ModuleList(blocks)
        self.fc1 = nn.Linear(prev * 4 * 4, 512)
        self.fc2 = nn.Linear(512, 512)
        self.fc = nn.Linear(512, num_classes)
        self.feature_dims: list[int] = list(_CHANNELS)

        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.normal_(m.weight, 0.0, math.sqrt(2.0 / (m.kernel_size[0] * m.kernel_size[1] * m.out_channels)))
                assert m.bias is not None  # every conv here has a bias
                nn.init.zeros_(m.bias)

    def forward_level(self, level: int, h: Tensor) -> Tensor:
        """Level ``level`` alone: conv ``level + 1`` and its GroupNorm, before the ReLU (full map).

        ``h`` is the image for level 0, otherwise ``relu`` of level ``level - 1``'s output (the max-pool
        between them is applied here). Stepping ``h = relu(forward_level(l, h))`` through every level
        and then ``forward_head(h)`` is ``forward``.
        """
        if level in _POOL_BEFORE:
            h = F.max_pool2d(h, 2)
        return self.blocks[level](h)

    def forward_head(self, h: Tensor) -> Tensor:
        """Logits from ``relu`` of the last conv: max-pool, average-pool to 4x4, flatten, three linears."""
        h = F.adaptive_avg_pool2d(F.max_pool2d(h, 2), 4).flatten(1)
        return self.fc(torch.relu(self.fc2(torch.relu(self.fc1(h)))))

