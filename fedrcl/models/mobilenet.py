"""MobileNet-V2 (Sandler et al., CVPR 2018) with GroupNorm, a backbone of the FedRCL paper's supplement Table C.

Layout (the authors' release, which takes it from weiaicunzai/pytorch-cifar100): a 1x1 stem conv with
padding 1 (so a 32 px input becomes 34 px) to 32 channels + GroupNorm + ReLU6; inverted-residual
"linear bottleneck" stages (expansion t, output channels c, repeats n, first stride s)

    (1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 1), (6, 320, 1, 1)

each block being 1x1 expand + GroupNorm + ReLU6, 3x3 depthwise (stride s) + GroupNorm + ReLU6, 1x1
project + GroupNorm with no activation, plus the identity when stride is 1 and channels match; then a
1x1 conv to 1280 + GroupNorm + ReLU6, global average pool and a linear classifier (the release's 1x1
conv on the pooled map, which is the same map). Convs keep their biases, as in the release.

Level taps (seven; ``feature_dims == [32, 16, 24, 32, 64, 96, 160]``), each globally average-pooled:
level 0 is the stem's GroupNorm output before its ReLU6; levels 1-6 are the outputs of the first six
stages. A linear bottleneck ends without an activation, so those taps are the stage outputs themselves
(signed, never rectified) and :meth:`MobileNetV2.level_activation` is the identity there, ReLU6 after
the stem. The 320-channel stage, the 1280-channel conv and the logits form the head. These are the
authors' ``layer0``-``layer6``; their FedRCL config uses the first five (``branch_level: [0,1,2,3,4]``),
which ``--model.init_args.levels [0,1,2,3,4]`` reproduces.
"""

import torch.nn.functional as F
from torch import Tensor, nn

from fedrcl.models.output import LevelBackbone, check_backbone_args

# (expansion t, output channels c, repeats n, first stride s); the last row belongs to the head.
_STAGES = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 1), (6, 320, 1, 1))
_STEM, _LAST = 32, 1280


class LinearBottleneck(nn.Module):
    """Inverted residual block: expand (1x1), depthwise (3x3), project (1x1, linear), identity shortcut.

    Args:
        in_channels: Channels of the block input.
        out_channels: Channels of the block output.
        stride: Stride of the depthwise conv; the shortcut is used only when it is 1 and channels match.
        expansion: Hidden channels are ``expansion * in_channels``.
        norm_groups: Number of groups of every GroupNorm.
    """

    def __init__(self, in_channels: int, out_channels: int, stride: int, expansion: int, norm_groups: int) -> None:
        super().__init__()
        hidden = in_channels * expansion
        self.expand = nn.Sequential(nn.Conv2d(in_channels, hidden, 1), nn.GroupNorm(norm_groups, hidden))
        self.depthwise = nn.Sequential(nn.Conv2d(hidden, hidden, 3, stride=stride, padding=1, groups=hidden),
                                       nn.GroupNorm(norm_groups, hidden))
        self.project = nn.Sequential(nn.Conv2d(hidden, out_channels, 1), nn.GroupNorm(norm_groups, out_channels))
        self.residual = stride == 1 and in_channels == out_channels

    def forward(self, x: Tensor) -> Tensor:
        out = self.project(F.relu6(self.depthwise(F.relu6(self.expand(x)))))
        return out + x if self.residual else out


class MobileNetV2(LevelBackbone):
    """MobileNet-V2 for small images with GroupNorm (see the module docstring for layout and level taps).

    Weights use PyTorch's default initialisation.

    Args:
        num_classes: Number of output classes.
        in_channels: Channels of the input images (1 for grey scale, 3 for RGB).
        image_size: Side length in pixels of the (square) input images; only validated, the layout
            does not depend on it.
        norm_groups: Number of groups of every GroupNorm (the paper uses 2).
    """

    def __init__(self, num_classes: int, in_channels: int = 3, image_size: int = 32, norm_groups: int = 2) -> None:
        super().__init__()
        check_backbone_args("MobileNetV2", num_classes, in_channels, image_size)
        widths, prev = {_STEM, _LAST}, _STEM
        for expansion, ch, repeats, _ in _STAGES:
            widths |= {prev * expansion, ch * expansion if repeats > 1 else ch, ch}
            prev = ch
        if norm_groups < 1 or any(w % norm_groups for w in widths):
            raise ValueError(f"norm_groups ({norm_groups}) must divide every channel count of MobileNetV2")
        self.num_classes, self.in_channels, self.image_size = num_classes, in_channels, image_size
        self.norm_groups = norm_groups

        self.stem = nn.Sequential(nn.Conv2d(in_channels, _STEM, 1, padding=1), nn.GroupNorm(norm_groups, _STEM))
        stages = []
        prev = _STEM
        for expansion, ch, repeats, stride in _STAGES:
            blocks = [LinearBottleneck(prev if i == 0 else ch, ch, stride if i == 0 else 1, expansion, norm_groups)
                      for i in range(repeats)]
            stages.append(nn.Sequential(*blocks))
            prev = ch
        self.stages = nn.ModuleList(stages[:-1])
        self.last_stage = stages[-1]
        self.last_conv = nn.Sequential(nn.Conv2d(prev, _LAST, 1), nn.GroupNorm(norm_groups, _LAST))
        self.fc = nn.Linear(_LAST, num_classes)
        self.feature_dims: list[int] = [_STEM] + [c for _, c, _, _ in _STAGES[:-1]]

    def forward_level(self, level: int, h: Tensor) -> Tensor:
        """Level ``level`` alone (the full map): the stem before its ReLU6, or stage ``level``'s output.

        ``h`` is the image for level 0, otherwise ``level_activation(level - 1, .)`` of the previous
        level's output. Stepping ``h = level_activation(l, forward_level(l, h))`` through every level and
        then ``forward_head(h)`` is ``forward``.
        """
        if level == 0:
            return self.stem(h)
        return self.stages[level - 1](h)

    def level_activation(self, level: int, pre: Tensor) -> Tensor:
        """What level ``level`` hands on: ReLU6 after the stem; nothing after a linear-bottleneck stage."""
        return F.relu6(pre) if level == 0 else pre

    def forward_head(self, h: Tensor) -> Tensor:
        """Logits from the last level's output: 320-channel stage, 1280-channel conv + ReLU6, pool, ``fc``."""
        h = F.relu6(self.last_conv(self.last_stage(h)))
        return self.fc(h.mean(dim=(2, 3)))

