"""ResNet-18 for small images with GroupNorm, the backbone used in the FedRCL paper."""

import torch
from torch import Tensor, nn

from fedrcl.models.output import LevelBackbone, ModelOutput, check_backbone_args


def _gap(x: Tensor) -> Tensor:
    """Global average pool ``[B, C, H, W] -> [B, C]``."""
    return x.mean(dim=(2, 3))


class BasicBlock(nn.Module):
    """Two 3x3 convs with GroupNorm and a residual shortcut (1x1 conv + GroupNorm when shapes change).

    Args:
        in_channels: Channels of the block input.
        out_channels: Channels of the block output.
        stride: Stride of the first conv (and of the downsample conv).
        norm_groups: Number of groups of every GroupNorm.
    """

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1, norm_groups: int = 2) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.GroupNorm(norm_groups, out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.GroupNorm(norm_groups, out_channels)
        self.downsample: nn.Module
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.GroupNorm(norm_groups, out_channels),
            )
        else:
            self.downsample = nn.Identity()

    def forward_preact(self, x: Tensor) -> Tensor:
        """Return ``bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x)``, i.e. the output before the final ReLU."""
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return out + self.downsample(x)

    def forward(self, x: Tensor) -> Tensor:
        return torch.relu(self.forward_preact(x))


class ResNet18(LevelBackbone):
    """ResNet-18 for small images (CIFAR / Tiny-ImageNet scale) with GroupNorm instead of BatchNorm.

    Layout: 3x3 stride-1 stem conv (no bias) + GroupNorm + ReLU, no max-pool, then four stages of
    two :class:`BasicBlock` each with ``width, 2*width, 4*width, 8*width`` channels and strides
    ``1, 2, 2, 2``, global average pool and a linear classifier (with bias). Every normalisation
    layer, including those on the downsample shortcuts, is a GroupNorm with ``norm_groups`` groups.
    The same layout is used for 32 px and 64 px inputs (pooling is adaptive).

    Five feature levels are exposed: the stem (conv1 + GroupNorm, before its ReLU) and each of the
    four stages (the last block's ``bn2(conv2(.)) + shortcut``, before its ReLU), each
    global-average-pooled. ``feature_dims == [width, width, 2*width, 4*width, 8*width]``.

    Weights use PyTorch's default initialisation (Kaiming-uniform convs/linear); GroupNorm affine
    weights start at 1 and biases at 0.

    Args:
        num_classes: Number of output classes.
        in_channels: Channels of the input images (1 for grey scale, 3 for RGB).
        image_size: Side length in pixels of the (square) input images; only validated, the
            layout does not depend on it.
        width: Channels of the stem and first stage; stages use ``width * (1, 2, 4, 8)``. 64 is
            the paper's network, 8 a small CPU-scale stand-in.
        norm_groups: Number of groups of every GroupNorm (the paper uses 2).
    """

    def __init__(
        self,
        num_classes: int,
        in_channels: int = 3,
        image_size: int = 32,
        width: int = 64,
        norm_groups: int = 2,
    ) -> None:
        super().__init__()
        check_backbone_args("ResNet18", num_classes, in_channels, image_size)
        if width < 1 or norm_groups < 1 or width % norm_groups != 0:
            raise ValueError(f"width ({width}) must be a positive multiple of norm_groups ({norm_groups})")
        self.num_classes = num_classes
        self.in_channels = in_channels
        self.image_size = image_size
        self.width = width
        self.norm_groups = norm_groups

        self.conv1 = nn.Conv2d(in_channels, width, 3, stride=1, padding=1, bias=False)
        self.bn1 = nn.GroupNorm(norm_groups, width)
        channels = [width, 2 * width, 4 * width, 8 * width]
        strides = [1, 2, 2, 2]
        stages: list[list[BasicBlock]] = []
        prev = width
        for ch, stride in zip(channels, strides):
            stages.append([BasicBlock(prev, ch, stride=stride, norm_groups=norm_groups),
                           BasicBlock(ch, ch, stride=1, norm_groups=norm_groups)])
            prev = ch
        self.layer1, self.layer2, self.layer3, self.layer4 = (nn.Sequential(*blocks) for blocks in stages)
        # Each stage's leading blocks and its last block (whose pre-activation is the stage's level), kept once:
        # slicing an nn.Sequential builds a new module at every call (10 us, per stage and step).
        self._level_blocks = [(tuple(blocks[:-1]), blocks[-1]) for blocks in stages]
        self.fc = nn.Linear(prev, num_classes)
        self.feature_dims: list[int] = [width, *channels]

        for m in self.modules():
            if isinstance(m, nn.GroupNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward_features(self, x: Tensor) -> tuple[Tensor, list[Tensor]]:
        """Run the backbone.

        Args:
            x: Images ``[B, in_channels, H, W]``.

        Returns:
            The pooled (post-ReLU) final representation ``[B, 8*width]`` and the list of per-level
            pre-ReLU pooled features.
        """
        features: list[Tensor] = []
        pre = self.bn1(self.conv1(x))
        features.append(_gap(pre))
        out = torch.relu(pre)
        for blocks, last in self._level_blocks:
            for block in blocks:
                out = block(out)
            pre = last.forward_preact(out)
            features.append(_gap(pre))
            out = torch.relu(pre)
        return _gap(out), features

    def forward_level(self, level: int, h: Tensor) -> Tensor:
        """Feature level ``level`` alone, before its ReLU (the full map, not pooled).

        ``h`` is the level's input: the image for level 0, otherwise ``relu`` of level ``level - 1``'s
        output. Stepping ``h = relu(forward_level(l, h))`` through every level and then ``forward_head(h)``
        is ``forward``; starting at a later level with another model's ``h`` grafts two networks (FedMLB).
        """
        if level == 0:
            return self.bn1(self.conv1(h))
        blocks, last = self._level_blocks[level - 1]
        for block in blocks:
            h = block(h)
        return last.forward_preact(h)

    def forward_head(self, h: Tensor) -> Tensor:
        """Logits from ``relu`` of the last level's output: global average pool, then ``fc``."""
        return self.fc(_gap(h))

    def forward(self, x: Tensor) -> ModelOutput:
        pooled, features = self.forward_features(x)
        return ModelOutput(logits=self.fc(pooled), features=features)
