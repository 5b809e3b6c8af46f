"""ShuffleNet V1 (Zhang, Zhou, Lin, Sun, CVPR 2018) with GroupNorm, a backbone of the FedRCL paper's
supplement Table C.

The paper cites Zhang et al. CVPR 2018, i.e. ShuffleNet V1 (V2 is Ma et al., ECCV 2018), and the authors'
release implements V1 with ``groups = 3``. Layout (that release, adapted to small images): a 3x3 stem
conv (stride 1, no max-pool) to 24 channels + GroupNorm + ReLU; three stages of 4, 8 and 4 ShuffleNet
units with ``out`` channels (240, 480, 960 for 3 groups); global average pool and a linear classifier.
A unit is grouped 1x1 conv to ``out / 4`` + GroupNorm + ReLU, channel shuffle, 3x3 depthwise conv
(stride 2 in a stage's first unit) + GroupNorm, grouped 1x1 conv + GroupNorm, then either the identity
added, or (first unit) a 3x3 stride-2 average pool of the input concatenated in front, then ReLU. As in
the release, stage 2's first 1x1 conv is grouped too (the release's "not in stage 2" test never fires)
and convs keep their biases.

Level taps (four; ``feature_dims == [24, out_2, out_3, out_4]``, ``[24, 240, 480, 960]`` for 3 groups),
each globally average-pooled: the stem's GroupNorm output before its ReLU, and each stage's last unit
output (after the addition) before its final ReLU. These are the authors' ``layer0``-``layer3``; their
FedRCL config lists ``branch_level: [0,1,2,3,4]``, whose level 4 is the logits on this network; we never
tap the logits.
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedrcl.models.output import LevelBackbone, check_backbone_args

_STEM = 24
_REPEATS = (4, 8, 4)
# Stage output channels per number of groups (ShuffleNet V1 paper, Table 1).
_WIDTHS = {1: (144, 288, 576), 2: (200, 400, 800), 3: (240, 480, 960), 4: (272, 544, 1088), 8: (384, 768, 1536)}


def channel_shuffle(x: Tensor, groups: int) -> Tensor:
    """Interleave the channels of ``groups`` groups: ``[B, g*n, H, W] -> view [B, g, n] -> [B, n, g] -> flat``."""
    b, c, h, w = x.shape
    return x.view(b, groups, c // groups, h, w).transpose(1, 2).reshape(b, c, h, w)


class ShuffleUnit(nn.Module):
    """One ShuffleNet V1 unit (see the module docstring).

    Args:
        in_channels: Channels of the unit input.
        out_channels: Channels of the unit output; the bottleneck has ``out_channels // 4``.
        stride: 1 (identity shortcut, ``in_channels == out_channels``) or 2 (average-pooled shortcut
            concatenated with a branch of ``out_channels - in_channels`` channels).
        groups: Groups of both 1x1 convs and of the channel shuffle.
        norm_groups: Number of groups of every GroupNorm.
    """

    def __init__(self, in_channels: int, out_channels: int, stride: int, groups: int, norm_groups: int) -> None:
        super().__init__()
        if stride not in (1, 2) or (stride == 1 and in_channels != out_channels):
            raise ValueError(f"ShuffleUnit: stride 1 needs in == out channels, else stride 2; got "
                             f"{in_channels}->{out_channels}, stride {stride}")
        mid = out_channels // 4
        branch = out_channels - in_channels if stride == 2 else out_channels
        self.groups, self.stride = groups, stride
        self.compress = nn.Sequential(nn.Conv2d(in_channels, mid, 1, groups=groups), nn.GroupNorm(norm_groups, mid))
        self.depthwise = nn.Sequential(nn.Conv2d(mid, mid, 3, stride=stride, padding=1, groups=mid),
                                       nn.GroupNorm(norm_groups, mid))
        self.expand = nn.Sequential(nn.Conv2d(mid, branch, 1, groups=groups), nn.GroupNorm(norm_groups, branch))

    def forward_preact(self, x: Tensor) -> Tensor:
        """The unit's output before its final ReLU."""
        out = channel_shuffle(torch.relu(self.compress(x)), self.groups)
        out = self.expand(self.depthwise(out))
        if self.stride == 2:
            return torch.cat([F.avg_pool2d(x, 3, stride=2, padding=1), out], dim=1)
        return out + x

    def forward(self, x: Tensor) -> Tensor:
        return torch.relu(self.forward_preact(x))


class ShuffleNetV1(LevelBackbone):
    """ShuffleNet V1 for small images with GroupNorm (see the module docstring for layout and level taps).

    Weights use PyTorch's default initialisation.

    Args:
        num_classes: Number of output classes.
        in_channels: Channels of the input images (1 for grey scale, 3 for RGB).
        image_size: Side length in pixels of the (square) input images; only validated, the layout
            does not depend on it.
        groups: Groups of the 1x1 convs, one of 1, 2, 3, 4, 8 (sets the stage widths; the release uses 3).
        norm_groups: Number of groups of every GroupNorm (the paper uses 2).
    """

    def __init__(self, num_classes: int, in_channels: int = 3, image_size: int = 32, groups: int = 3,
                 norm_groups: int = 2) -> None:
        super().__init__()
        check_backbone_args("ShuffleNetV1", num_classes, in_channels, image_size)
        if groups not in _WIDTHS:
            raise ValueError(f"groups must be one of {sorted(_WIDTHS)}, got {groups}")
        widths = _WIDTHS[groups]
        prev, channels = _STEM, set()
        for out in widths:
            channels |= {out // 4, out - prev, out}
            prev = out
        if norm_groups < 1 or any(c % norm_groups for c in channels | {_STEM}):
            raise ValueError(f"norm_groups ({norm_groups}) must divide every channel count of ShuffleNetV1")
        self.num_classes, self.in_channels, self.image_size = num_classes, in_channels, image_size
        self.groups, self.norm_groups = groups, norm_groups

        self.stem = nn.Sequential(nn.Conv2d(in_channels, _STEM, 3, padding=1), nn.GroupNorm(norm_groups, _STEM))
        stages: list[list[ShuffleUnit]] = []
        prev = _STEM
        for out, repeats in zip(widths, _REPEATS):
            stages.append([ShuffleUnit(prev if i == 0 else out, out, 2 if i == 0 else 1, groups, norm_groups)
                           for i in range(repeats)])
            prev = out
        self.stages = nn.ModuleList(nn.Sequential(*units) for units in stages)
        # Each stage's leading units and its last unit (whose pre-activation is the stage's level), kept once:
        # slicing an nn.Sequential builds a new module at every call.
        self._level_units = [(tuple(units[:-1]), units[-1]) for units in stages]
        self.fc = nn.Linear(prev, num_classes)
        self.feature_dims: list[int] = [_STEM, *widths]

    def forward_level(self, level: int, h: Tensor) -> Tensor:
        """Level ``level`` alone, before its final ReLU (the full map): the stem, or stage ``level``.

        ``h`` is the image for level 0, otherwise ``relu`` of level ``level - 1``'s output. Stepping
        ``h = relu(forward_level(l, h))`` through every level and then ``forward_head(h)`` is ``forward``.
        """
        if level == 0:
            return self.stem(h)
        units, last = self._level_units[level - 1]
        for unit in units:
            h = unit(h)
        return last.forward_preact(h)

    def forward_head(self, h: Tensor) -> Tensor:
        """Logits from ``relu`` of the last level's output: global average pool, then ``fc``."""
        return self.fc(h.mean(dim=(2, 3)))

