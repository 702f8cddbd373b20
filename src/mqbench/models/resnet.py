"""ResNet v1.5 (ResNet-18 / ResNet-50) defined in the project, random init.

The blocks deliberately mix a module ReLU (``nn.ReLU(inplace=True)`` after the
first conv-bn pairs) with a functional ``F.relu`` after the residual add, so the
quantization passes see both forms.  Parameter counts match the usual ImageNet
definitions (11,689,512 and 25,557,032 with 1000 classes).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["BasicBlock", "Bottleneck", "ResNet", "resnet18", "resnet50"]


def _conv3x3(in_ch: int, out_ch: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_ch, out_ch, 3, stride=stride, padding=1, bias=False)


def _conv1x1(in_ch: int, out_ch: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False)


def _downsample(in_ch: int, out_ch: int, stride: int) -> nn.Sequential | None:
    if stride == 1 and in_ch == out_ch:
        return None
    return nn.Sequential(_conv1x1(in_ch, out_ch, stride), nn.BatchNorm2d(out_ch))


class BasicBlock(nn.Module):
    """Two 3x3 conv-bn layers with an identity (or 1x1 conv-bn) shortcut.

    Example:
        >>> import torch
        >>> BasicBlock(8, 16, stride=2)(torch.zeros(1, 8, 8, 8)).shape
        torch.Size([1, 16, 4, 4])
    """

    expansion: int = 1

    def __init__(self, in_ch: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        out_ch = planes * self.expansion
        self.conv1 = _conv3x3(in_ch, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = _conv3x3(planes, out_ch)
        self.bn2 = nn.BatchNorm2d(out_ch)
        self.downsample = _downsample(in_ch, out_ch, stride)

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + identity)


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (carrying the stride, as in v1.5), 1x1 expand (x4), plus shortcut.

    Example:
        >>> import torch
        >>> Bottleneck(16, 8, stride=2)(torch.zeros(1, 16, 8, 8)).shape
        torch.Size([1, 32, 4, 4])
    """

    expansion: int = 4

    def __init__(self, in_ch: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        out_ch = planes * self.expansion
        self.conv1 = _conv1x1(in_ch, planes)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv2 = _conv3x3(planes, planes, stride)
        self.bn2 = nn.BatchNorm2d(planes)
        self.relu2 = nn.ReLU(inplace=True)
        self.conv3 = _conv1x1(planes, out_ch)
        self.bn3 = nn.BatchNorm2d(out_ch)
        self.downsample = _downsample(in_ch, out_ch, stride)

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu1(self.bn1(self.conv1(x)))
        out = self.relu2(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return F.relu(out + identity)


class ResNet(nn.Module):
    """ResNet: 7x7 stem, max pool, four stages of residual blocks, global average pool, fc.

    Args:
        block: :class:`BasicBlock` or :class:`Bottleneck`.
        layers: number of blocks in each of the four stages.
        num_classes: size of the classifier output.

    Example:
        >>> import torch
        >>> model = ResNet(BasicBlock, [1, 1, 1, 1], num_classes=5).eval()
        >>> model(torch.zeros(1, 3, 32, 32)).shape
        torch.Size([1, 5])
    """

    def __init__(
        self,
        block: type[BasicBlock] | type[Bottleneck],
        layers: list[int],
        num_classes: int = 1000,
    ) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        in_ch = 64
        stages: list[nn.Sequential] = []
        for i, n_blocks in enumerate(layers):
            planes = 64 * 2**i
            blocks: list[nn.Module] = []
            for j in range(n_blocks):
                stride = 2 if (i > 0 and j == 0) else 1
                blocks.append(block(in_ch, planes, stride))
                in_ch = planes * block.expansion
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_ch, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x: Tensor) -> Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet18(num_classes: int = 1000) -> ResNet:
    """ResNet-18 (BasicBlock, [2, 2, 2, 2]); 11,689,512 parameters with 1000 classes.

    Example:
        >>> import torch
        >>> resnet18(num_classes=10).eval()(torch.zeros(1, 3, 32, 32)).shape
        torch.Size([1, 10])
    """
    return ResNet(BasicBlock, [2, 2, 2, 2], num_classes)


def resnet50(num_classes: int = 1000) -> ResNet:
    """ResNet-50 v1.5 (Bottleneck, [3, 4, 6, 3]); 25,557,032 parameters with 1000 classes.

    Example:
        >>> import torch
        >>> resnet50(num_classes=10).eval()(torch.zeros(1, 3, 32, 32)).shape
        torch.Size([1, 10])
    """
    return ResNet(Bottleneck, [3, 4, 6, 3], num_classes)
