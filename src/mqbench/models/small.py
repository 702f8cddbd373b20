"""A small CNN for 8x8 digit images (scikit-learn's bundled digits data set)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["DigitsCNN"]


class DigitsCNN(nn.Module):
    """Conv-ReLU x3 and a linear classifier for ``[N, 1, 8, 8]`` inputs, 10 classes.

    Example:
        >>> import torch
        >>> from mqbench.models import DigitsCNN
        >>> DigitsCNN()(torch.zeros(2, 1, 8, 8)).shape
        torch.Size([2, 10])
    """

    def __init__(self, width: int = 16, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, 3, padding=1)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(width, 2 * width, 3, stride=2, padding=1)
        self.relu2 = nn.ReLU()
        self.conv3 = nn.Conv2d(2 * width, 2 * width, 3, padding=1)
        self.relu3 = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool2d(2)
        self.fc = nn.Linear(8 * width, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.relu1(self.conv1(x))
        x = self.relu2(self.conv2(x))
        x = self.relu3(self.conv3(x))
        return self.fc(torch.flatten(self.pool(x), 1))
