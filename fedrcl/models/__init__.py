"""Backbones returning logits and per-level features in one forward pass."""
from fedrcl.models.cnn import SmallCNN
from fedrcl.models.mobilenet import MobileNetV2
from fedrcl.models.output import ModelOutput
from fedrcl.models.resnet import ResNet18
from fedrcl.models.shufflenet import ShuffleNetV1
from fedrcl.models.squeezenet import SqueezeNet
from fedrcl.models.vgg import VGG9

__all__ = ["MobileNetV2", "ModelOutput", "ResNet18", "ShuffleNetV1", "SmallCNN", "SqueezeNet", "VGG9"]
