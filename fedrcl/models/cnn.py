"""The classic two-conv CNN used for CIFAR in the FedAvg paper."""

import torch
from torch import Tensor, nn

from fedrcl.models.output import LevelBackbone, ModelOutput, check_backbone_args


class SmallCNN(LevelBackbone):
    """FedAvg's CIFAR CNN.

    ``conv5x5(32) -> ReLU -> maxpool2 -> conv5x5(64) -> ReLU -> maxpool2 -> flatten ->
    fc(384) -> ReLU -> fc(192) -> ReLU -> fc(num_classes)``.

    Four feature levels are exposed, each before its ReLU: the global average pool of each conv
    output, and each hidden fc output. ``feature_dims == [32, 64, 384, 192]``.
    Weights use PyTorch's default initialisation.

    Args:
        num_classes: Number of output classes.
        in_channels: Channels of the input images (1 for grey scale, 3 for RGB).
        image_size: Side length in pixels of the (square) input images; sets the flatten size.
        conv_padding: Zero padding of both 5x5 convs. 0 is the classic setting for 32 px images;
            tiny images (e.g. 8x8 digits) need 2 to keep a non-empty feature map.

    Raises:
        ValueError: If the spatial size drops below 1 anywhere for the given ``image_size`` and
            ``conv_padding``.
    """

    def __init__(
        self,
        num_classes: int,
        in_channels: int = 3,
        image_size: int = 32,
        conv_padding: int = 0,
    ) -> None:
        super().__init__()
        check_backbone_args("SmallCNN", num_classes, in_channels, image_size)
        if conv_padding < 0:
            raise ValueError(f"conv_padding must be >= 0, got {conv_padding}")
        size = image_size
        for _ in range(2):
            size = (size + 2 * conv_padding - 4) // 2  # 5x5 conv (stride 1), then 2x2 max-pool (floor)
            if size < 1:
                raise ValueError(
                    f"SmallCNN: image_size={image_size} with conv_padding={conv_padding} shrinks the "
                    f"feature map below 1 pixel; use a larger image_size or conv_padding"
                )
        self.num_classes = num_classes
        self.in_channels = in_channels
        self.image_size = image_size
        self.conv_padding = conv_padding
        self.flat_size = 64 * size * size

        self.conv1 = nn.Conv2d(in_channels, 32, 5, padding=conv_padding)
        self.conv2 = nn.Conv2d(32, 64, 5, padding=conv_padding)
        self.pool = nn.MaxPool2d(2)
        self.fc1 = nn.Linear(self.flat_size, 384)
        self.fc2 = nn.Linear(384, 192)
        self.fc = nn.Linear(192, num_classes)
        self.feature_dims: list[int] = [32, 64, 384, 192]

    def forward_level(self, level: int, h: Tensor) -> Tensor:
        """Feature level ``level`` alone, before its ReLU (conv levels: the full map, not pooled).

        ``h`` is the level's input: the image for level 0, otherwise ``relu`` of level ``level - 1``'s
        output (the max-pool and flatten between levels belong to the later level). Stepping
        ``h = relu(forward_level(l, h))`` through every level and then ``forward_head(h)`` is ``forward``.
        """
        if level == 0:
            return self.conv1(h)
        if level == 1:
            return self.conv2(self.pool(h))
        if level == 2:
            return self.fc1(self.pool(h).flatten(1))
        return self.fc2(h)

    def forward_head(self, h: Tensor) -> Tensor:
        """Logits from ``relu`` of the last level's output."""
        return self.fc(h)

    def forward(self, x: Tensor) -> ModelOutput:
        features: list[Tensor] = []
        pre = self.conv1(x)
        features.append(pre.mean(dim=(2, 3)))
        out = self.pool(torch.relu(pre))
        pre = self.conv2(out)
        features.append(pre.mean(dim=(2, 3)))
        out = self.pool(torch.relu(pre)).flatten(1)
        pre = self.fc1(out)
        features.append(pre)
        pre = self.fc2(torch.relu(pre))
        features.append(pre)
        logits = self.fc(torch.relu(pre))
        return ModelOutput(logits=logits, features=features)
