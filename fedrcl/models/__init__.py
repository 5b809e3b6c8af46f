"""Backbones returning logits and per-level features in one forward pass."""
from fedrcl.models.cnn import SmallCNN
from fedrcl.models.output import ModelOutput
from fedrcl.models.resnet import ResNet18

__all__ = ["ModelOutput", "ResNet18", "SmallCNN"]
