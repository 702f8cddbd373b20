"""MobileNetV2 and a MobileNetV3-Small-style network, defined in the project, random init.

:func:`mobilenet_v2` follows the published architecture (3,504,872 parameters with
1000 classes).  :func:`mobilenet_v3_small_style` follows the MobileNetV3-Small layout
(hardswish, squeeze-and-excitation with a hard sigmoid gate applied by ``x * scale``)
without aiming at an exact parameter match.
"""

from __future__ import annotations

from torch import Tensor, nn

__all__ = [
    "InvertedResidual",
    "MobileNetV2",
    "MobileNetV3SmallStyle",
    "SqueezeExcitation",
    "mobilenet_v2",
    "mobilenet_v3_small_style",
]


def _make_divisible(value: float, divisor: int = 8) -> int:
    """Round ``value`` to a multiple of ``divisor`` without going more than 10% below it."""
    rounded = max(divisor, int(value + divisor / 2) // divisor * divisor)
    if rounded < 0.9 * value:
        rounded += divisor
    return rounded


def _conv_bn_act(
    in_ch: int,
    out_ch: int,
    kernel: int = 1,
    stride: int = 1,
    groups: int = 1,
    act: type[nn.Module] | None = nn.ReLU6,
) -> nn.Sequential:
    layers: list[nn.Module] = [
        nn.Conv2d(in_ch, out_ch, kernel, stride=stride, padding=(kernel - 1) // 2, groups=groups, bias=False),
        nn.BatchNorm2d(out_ch),
    ]
    if act is not None:
        layers.append(act(inplace=True) if act in (nn.ReLU, nn.ReLU6, nn.Hardswish) else act())
    return nn.Sequential(*layers)


def _init_weights(model: nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out")
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0.0, 0.01)
            nn.init.zeros_(m.bias)


class InvertedResidual(nn.Module):
    """MobileNetV2 block: 1x1 expand (ReLU6), 3x3 depthwise (ReLU6), 1x1 linear projection.

    The residual add is used when ``stride == 1`` and the channel count is unchanged.

    Example:
        >>> import torch
        >>> block = InvertedResidual(16, 16, stride=1, expand_ratio=6)
        >>> block.use_residual, block(torch.zeros(1, 16, 8, 8)).shape
        (True, torch.Size([1, 16, 8, 8]))
    """

    def __init__(self, in_ch: int, out_ch: int, stride: int, expand_ratio: float) -> None:
        super().__init__()
        hidden = round(in_ch * expand_ratio)
        self.use_residual = stride == 1 and in_ch == out_ch
        layers: list[nn.Module] = []
        if expand_ratio != 1:
            layers.append(_conv_bn_act(in_ch, hidden, 1))
        layers.append(_conv_bn_act(hidden, hidden, 3, stride=stride, groups=hidden))
        layers.append(nn.Conv2d(hidden, out_ch, 1, bias=False))
        layers.append(nn.BatchNorm2d(out_ch))
        self.conv = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        if self.use_residual:  # fixed at construction, not data dependent
            return x + self.conv(x)
        return self.conv(x)


class MobileNetV2(nn.Module):
    """MobileNetV2 for ImageNet-style ``[N, 3, H, W]`` inputs.

    Example:
        >>> import torch
        >>> MobileNetV2(num_classes=10, width_mult=0.5).eval()(torch.zeros(1, 3, 32, 32)).shape
        torch.Size([1, 10])
    """

    # (expand ratio t, output channels c, repeats n, first stride s)
    SETTINGS: tuple[tuple[int, int, int, int], ...] = (
        (1, 16, 1, 1),
        (6, 24, 2, 2),
        (6, 32, 3, 2),
        (6, 64, 4, 2),
        (6, 96, 3, 1),
        (6, 160, 3, 2),
        (6, 320, 1, 1),
    )

    def __init__(self, num_classes: int = 1000, width_mult: float = 1.0, dropout: float = 0.2) -> None:
        super().__init__()
        in_ch = _make_divisible(32 * width_mult)
        self.last_channel = _make_divisible(1280 * max(1.0, width_mult))
        features: list[nn.Module] = [_conv_bn_act(3, in_ch, 3, stride=2)]
        for t, c, n, s in self.SETTINGS:
            out_ch = _make_divisible(c * width_mult)
            for i in range(n):
                features.append(InvertedResidual(in_ch, out_ch, s if i == 0 else 1, t))
                in_ch = out_ch
        features.append(_conv_bn_act(in_ch, self.last_channel, 1))
        self.features = nn.Sequential(*features)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Dropout(dropout), nn.Linear(self.last_channel, num_classes))
        _init_weights(self)

    def forward(self, x: Tensor) -> Tensor:
        x = self.pool(self.features(x)).flatten(1)
        return self.classifier(x)


def mobilenet_v2(num_classes: int = 1000, width_mult: float = 1.0) -> MobileNetV2:
    """MobileNetV2; 3,504,872 parameters with 1000 classes and ``width_mult=1.0``.

    Example:
        >>> import torch
        >>> mobilenet_v2(num_classes=10).eval()(torch.zeros(1, 3, 32, 32)).shape
        torch.Size([1, 10])
    """
    return MobileNetV2(num_classes=num_classes, width_mult=width_mult)


class SqueezeExcitation(nn.Module):
    """Squeeze-and-excitation: global pool, 1x1 conv, ReLU, 1x1 conv, hard sigmoid, ``x * scale``.

    Example:
        >>> import torch
        >>> SqueezeExcitation(16, 8)(torch.ones(2, 16, 4, 4)).shape
        torch.Size([2, 16, 4, 4])
    """

    def __init__(self, channels: int, squeeze: int) -> None:
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(channels, squeeze, 1)
        self.relu = nn.ReLU(inplace=True)
        self.fc2 = nn.Conv2d(squeeze, channels, 1)
        self.gate = nn.Hardsigmoid()

    def forward(self, x: Tensor) -> Tensor:
        scale = self.gate(self.fc2(self.relu(self.fc1(self.pool(x)))))
        return x * scale


class _V3Block(nn.Module):
    """MobileNetV3 bottleneck: optional 1x1 expand, depthwise k x k, optional SE, 1x1 projection."""

    def __init__(
        self, in_ch: int, kernel: int, hidden: int, out_ch: int, use_se: bool, act: type[nn.Module], stride: int
    ) -> None:
        super().__init__()
        self.use_residual = stride == 1 and in_ch == out_ch
        layers: list[nn.Module] = []
        if hidden != in_ch:
            layers.append(_conv_bn_act(in_ch, hidden, 1, act=act))
        layers.append(_conv_bn_act(hidden, hidden, kernel, stride=stride, groups=hidden, act=act))
        if use_se:
            layers.append(SqueezeExcitation(hidden, _make_divisible(hidden // 4)))
        layers.append(_conv_bn_act(hidden, out_ch, 1, act=None))
        self.block = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        if self.use_residual:  # fixed at construction
            return x + self.block(x)
        return self.block(x)


class MobileNetV3SmallStyle(nn.Module):
    """A MobileNetV3-Small-style classifier (hardswish, SE blocks, depthwise convs with BN).

    Example:
        >>> import torch
        >>> MobileNetV3SmallStyle(num_classes=10).eval()(torch.zeros(1, 3, 32, 32)).shape
        torch.Size([1, 10])
    """

    # (kernel, expanded channels, output channels, use SE, activation, stride)
    SETTINGS: tuple[tuple[int, int, int, bool, type[nn.Module], int], ...] = (
        (3, 16, 16, True, nn.ReLU, 2),
        (3, 72, 24, False, nn.ReLU, 2),
        (3, 88, 24, False, nn.ReLU, 1),
        (5, 96, 40, True, nn.Hardswish, 2),
        (5, 240, 40, True, nn.Hardswish, 1),
        (5, 240, 40, True, nn.Hardswish, 1),
        (5, 120, 48, True, nn.Hardswish, 1),
        (5, 144, 48, True, nn.Hardswish, 1),
        (5, 288, 96, True, nn.Hardswish, 2),
        (5, 576, 96, True, nn.Hardswish, 1),
        (5, 576, 96, True, nn.Hardswish, 1),
    )

    def __init__(self, num_classes: int = 1000, last_channel: int = 1024, dropout: float = 0.2) -> None:
        super().__init__()
        in_ch = 16
        features: list[nn.Module] = [_conv_bn_act(3, in_ch, 3, stride=2, act=nn.Hardswish)]
        for kernel, hidden, out_ch, use_se, act, stride in self.SETTINGS:
            features.append(_V3Block(in_ch, kernel, hidden, out_ch, use_se, act, stride))
            in_ch = out_ch
        features.append(_conv_bn_act(in_ch, 6 * in_ch, 1, act=nn.Hardswish))
        self.features = nn.Sequential(*features)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(
            nn.Linear(6 * in_ch, last_channel),
            nn.Hardswish(inplace=True),
            nn.Dropout(dropout),
            nn.Linear(last_channel, num_classes),
        )
        _init_weights(self)

    def forward(self, x: Tensor) -> Tensor:
        x = self.pool(self.features(x)).flatten(1)
        return self.classifier(x)


def mobilenet_v3_small_style(num_classes: int = 1000) -> MobileNetV3SmallStyle:
    """MobileNetV3-Small-style network (about 2.5M parameters with 1000 classes).

    Example:
        >>> import torch
        >>> mobilenet_v3_small_style(num_classes=10).eval()(torch.zeros(1, 3, 32, 32)).shape
        torch.Size([1, 10])
    """
    return MobileNetV3SmallStyle(num_classes=num_classes)
