"""What the command-line tests give a "user": a model package's source, written into a test folder."""

from __future__ import annotations

SMALL_CNN_SOURCE = """
from torch import nn


def small_cnn(num_classes=10, width=8):
    return nn.Sequential(
        nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
        nn.Conv2d(width, width, 3, padding=1, stride=2), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, num_classes),
    )
"""
