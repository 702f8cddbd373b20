"""Reference models defined in the project (no downloads needed), all with random init.

Every model's ``forward`` traces with ``torch.fx.symbolic_trace``.
"""

from mqbench.models.detector import TwoHeadDetector, two_head_detector
from mqbench.models.mobilenet import (
    InvertedResidual,
    MobileNetV2,
    MobileNetV3SmallStyle,
    SqueezeExcitation,
    mobilenet_v2,
    mobilenet_v3_small_style,
)
from mqbench.models.resnet import BasicBlock, Bottleneck, ResNet, resnet18, resnet50
from mqbench.models.small import DigitsCNN
from mqbench.models.transformers import BertTiny, MultiHeadSelfAttention, VisionTransformer, bert_tiny, vit_tiny
from mqbench.models.unet import DoubleConv, UNet, unet

__all__ = [
    "BasicBlock",
    "BertTiny",
    "Bottleneck",
    "DigitsCNN",
    "DoubleConv",
    "InvertedResidual",
    "MobileNetV2",
    "MobileNetV3SmallStyle",
    "MultiHeadSelfAttention",
    "ResNet",
    "SqueezeExcitation",
    "TwoHeadDetector",
    "UNet",
    "VisionTransformer",
    "bert_tiny",
    "mobilenet_v2",
    "mobilenet_v3_small_style",
    "resnet18",
    "resnet50",
    "two_head_detector",
    "unet",
    "vit_tiny",
]
