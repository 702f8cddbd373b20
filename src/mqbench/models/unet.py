"""A small UNet for dense prediction, defined in the project, random init.

Three encoder levels (conv-bn-relu x2, then 2x2 max pooling), a bottleneck, and a
decoder that upsamples with stride-2 ``nn.ConvTranspose2d``, concatenates the skip
connection along channels (``torch.cat``) and applies conv-bn-relu x2.  The deepest
upsampling step is ConvTranspose2d -> BatchNorm2d -> ReLU, so the deconv-bn-relu
fusion pattern occurs; the other two are plain (biased) transposed convolutions.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["DoubleConv", "UNet", "unet"]


class DoubleConv(nn.Sequential):
    """(3x3 conv, BatchNorm2d, ReLU) twice, keeping the spatial size.

    Example:
        >>> import torch
        >>> DoubleConv(3, 8)(torch.zeros(1, 3, 16, 16)).shape
        torch.Size([1, 8, 16, 16])
    """

    def __init__(self, in_ch: int, out_ch: int) -> None:
        super().__init__(
            nn.Conv2d(in_ch, out_ch, 3, padding=1, bias=False),
            nn.BatchNorm2d(out_ch),
            nn.ReLU(inplace=True),
            nn.Conv2d(out_ch, out_ch, 3, padding=1, bias=False),
            nn.BatchNorm2d(out_ch),
            nn.ReLU(inplace=True),
        )


class UNet(nn.Module):
    """UNet with three down/up levels; input height and width must be multiples of 8.

    Returns per-pixel logits ``[N, num_classes, H, W]``.

    Example:
        >>> import torch
        >>> UNet(in_channels=3, num_classes=2, base=4)(torch.zeros(1, 3, 16, 16)).shape
        torch.Size([1, 2, 16, 16])
    """

    def __init__(self, in_channels: int = 3, num_classes: int = 2, base: int = 16) -> None:
        super().__init__()
        c1, c2, c3, c4 = base, 2 * base, 4 * base, 8 * base
        self.enc1 = DoubleConv(in_channels, c1)
        self.enc2 = DoubleConv(c1, c2)
        self.enc3 = DoubleConv(c2, c3)
        self.pool = nn.MaxPool2d(2)
        self.bottleneck = DoubleConv(c3, c4)
        # Deepest upsampling: deconv -> bn -> relu (the fusable pattern).
        self.up3 = nn.ConvTranspose2d(c4, c3, 2, stride=2, bias=False)
        self.up3_bn = nn.BatchNorm2d(c3)
        self.up3_relu = nn.ReLU(inplace=True)
        self.dec3 = DoubleConv(2 * c3, c3)
        self.up2 = nn.ConvTranspose2d(c3, c2, 2, stride=2)
        self.dec2 = DoubleConv(2 * c2, c2)
        self.up1 = nn.ConvTranspose2d(c2, c1, 2, stride=2)
        self.dec1 = DoubleConv(2 * c1, c1)
        self.head = nn.Conv2d(c1, num_classes, 1)

    def forward(self, x: Tensor) -> Tensor:
        s1 = self.enc1(x)
        s2 = self.enc2(self.pool(s1))
        s3 = self.enc3(self.pool(s2))
        b = self.bottleneck(self.pool(s3))
        d3 = self.up3_relu(self.up3_bn(self.up3(b)))
        d3 = self.dec3(torch.cat([d3, s3], dim=1))
        d2 = self.dec2(torch.cat([self.up2(d3), s2], dim=1))
        d1 = self.dec1(torch.cat([self.up1(d2), s1], dim=1))
        return self.head(d1)


def unet(in_channels: int = 3, num_classes: int = 2, base: int = 16) -> UNet:
    """Build a :class:`UNet` (about 0.47M parameters with the defaults).

    Example:
        >>> import torch
        >>> unet()(torch.zeros(1, 3, 64, 64)).shape
        torch.Size([1, 2, 64, 64])
    """
    return UNet(in_channels=in_channels, num_classes=num_classes, base=base)
