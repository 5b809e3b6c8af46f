"""SqueezeNet (Iandola et al., 2016) with GroupNorm and simple bypasses, a backbone of the FedRCL paper's
supplement Table C.

Layout (the authors' release, which takes it from weiaicunzai/pytorch-cifar100): a 3x3 stem conv to 96
channels + GroupNorm + ReLU + 2x2 max-pool; eight Fire modules (squeeze 1x1 + GroupNorm + ReLU, then
1x1 and 3x3 expands, each + GroupNorm + ReLU, concatenated)

    fire2 96->128, fire3 128->128 (+ input), fire4 128->256, max-pool, fire5 256->256 (+ input),
    fire6 256->384, fire7 384->384 (+ input), fire8 384->512, max-pool, fire9 512->512

(squeeze widths 16, 16, 32, 32, 48, 48, 64, 64); then a 1x1 conv to the classes and a global average pool,
written here as the pool followed by a linear ``fc``, the same function. Convs keep their biases.

Level taps (five; ``feature_dims == [96, 128, 256, 384, 512]``), each globally average-pooled and taken
before a ReLU: the stem's GroupNorm output (before its ReLU and the max-pool), and the concatenated
GroupNorm outputs of the two expands of fire2, fire4, fire6 and fire8 (before their ReLUs and any
max-pool). So level 2 is fire3 (+ bypass) then fire4, level 3 is the max-pool, fire5 (+ bypass) and fire6,
level 4 is fire7 (+ bypass) and fire8; the head is the max-pool, fire9, the pool and ``fc``. The authors'
code instead exposes the outputs of the stem (after the max-pool) and of each of fire2-fire8 and its FedRCL
config uses the first five; the outputs of fire3, fire5 and fire7 are sums of rectified maps with no
ReLU after them, so they have no pre-activation form, and we tap only Fire modules that end in a ReLU.
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedrcl.models.output import LevelBackbone, check_backbone_args

_STEM = 96
# (input channels, output channels, squeeze channels) of fire2 ... fire9
_FIRES = ((96, 128, 16), (128, 128, 16), (128, 256, 32), (256, 256, 32),
          (256, 384, 48), (384, 384, 48), (384, 512, 64), (512, 512, 64))


class Fire(nn.Module):
    """Fire module: 1x1 squeeze + GroupNorm + ReLU, then 1x1 and 3x3 expands (each + GroupNorm + ReLU) concatenated.

    Args:
        in_channels: Channels of the module input.
        out_channels: Channels of the output, half from each expand.
        squeeze_channels: Channels of the squeeze conv.
        norm_groups: Number of groups of every GroupNorm.
    """

    def __init__(self, in_channels: int, out_channels: int, squeeze_channels: int, norm_groups: int) -> None:
        super().__init__()
        half = out_channels // 2
        self.squeeze = nn.Sequential(nn.Conv2d(in_channels, squeeze_channels, 1),
                                     nn.GroupNorm(norm_groups, squeeze_channels))
        self.expand1x1 = nn.Sequential(nn.Conv2d(squeeze_channels, half, 1), nn.GroupNorm(norm_groups, half))
        self.expand3x3 = nn.Sequential(nn.Conv2d(squeeze_channels, half, 3, padding=1), nn.GroupNorm(norm_groups, half))

    def forward_preact(self, x: Tensor) -> Tensor:
        """Both expands' GroupNorm outputs, concatenated, before their ReLUs."""
        s = torch.relu(self.squeeze(x))
        return torch.cat([self.expand1x1(s), self.expand3x3(s)], dim=1)

    def forward(self, x: Tensor) -> Tensor:
        return torch.relu(self.forward_preact(x))


class SqueezeNet(LevelBackbone):
    """SqueezeNet with simple bypasses for small images, with GroupNorm (see the module docstring).

    Weights use PyTorch's default initialisation.

    Args:
        num_classes: Number of output classes.
        in_channels: Channels of the input images (1 for grey scale, 3 for RGB).
        image_size: Side length in pixels of the (square) input images; at least 8 (three 2x2
            max-pools); the layout does not depend on it.
        norm_groups: Number of groups of every GroupNorm (the paper uses 2).
    """

    def __init__(self, num_classes: int, in_channels: int = 3, image_size: int = 32, norm_groups: int = 2) -> None:
        super().__init__()
        check_backbone_args("SqueezeNet", num_classes, in_channels, image_size, min_image_size=8)  # 3 max-pools
        if norm_groups < 1 or any(c % norm_groups for f in _FIRES for c in (f[1] // 2, f[2])) or _STEM % norm_groups:
            raise ValueError(f"norm_groups ({norm_groups}) must divide every channel count of SqueezeNet")
        self.num_classes, self.in_channels, self.image_size = num_classes, in_channels, image_size
        self.norm_groups = norm_groups

        self.stem = nn.Sequential(nn.Conv2d(in_channels, _STEM, 3, padding=1), nn.GroupNorm(norm_groups, _STEM))
        (self.fire2, self.fire3, self.fire4, self.fire5,
         self.fire6, self.fire7, self.fire8, self.fire9) = (Fire(*f, norm_groups) for f in _FIRES)
        self.fc = nn.Linear(_FIRES[-1][1], num_classes)
        self.feature_dims: list[int] = [_STEM, 128, 256, 384, 512]

    def forward_level(self, level: int, h: Tensor) -> Tensor:
        """Level ``level`` alone, before its final ReLU (the full map; see the module docstring).

        ``h`` is the image for level 0, otherwise ``relu`` of level ``level - 1``'s output (max-pools
        between levels are applied here). Stepping ``h = relu(forward_level(l, h))`` through every level
        and then ``forward_head(h)`` is ``forward``.
        """
        if level == 0:
            return self.stem(h)
        if level == 1:
            return self.fire2.forward_preact(F.max_pool2d(h, 2))
        if level == 2:
            return self.fire4.forward_preact(self.fire3(h) + h)
        if level == 3:
            h = F.max_pool2d(h, 2)
            return self.fire6.forward_preact(self.fire5(h) + h)
        if level == 4:
            return self.fire8.forward_preact(self.fire7(h) + h)
        raise IndexError(f"SqueezeNet has levels 0-4, got {level}")

    def forward_head(self, h: Tensor) -> Tensor:
        """Logits from ``relu`` of fire8's output: max-pool, fire9, global average pool, ``fc``."""
        return self.fc(self.fire9(F.max_pool2d(h, 2)).mean(dim=(2, 3)))

