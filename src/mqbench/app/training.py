"""Training, evaluation and calibration of the small models of the demo and the verify command (digits)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mqbench.data import Split
from mqbench.utils.state import enable_calibration, enable_quantization

__all__ = ["academic_config", "calibrate", "evaluate", "train"]


def academic_config(bits: int) -> dict[str, Any]:
    """LSQ quantizers at ``bits`` for the Academic backend (first and last layer stay 8-bit)."""
    return {
        "extra_qconfig_dict": {
            "w_observer": "LSQObserver",
            "a_observer": "EMAMinMaxObserver",
            "w_fakequantize": "LearnableFakeQuantize",
            "a_fakequantize": "LearnableFakeQuantize",
            "w_qscheme": {"bit": bits, "symmetry": True, "per_channel": True, "pot_scale": False},
            "a_qscheme": {"bit": bits, "symmetry": False, "per_channel": False, "pot_scale": False},
        }
    }


def train(model: nn.Module, data: Split, epochs: int, lr: float, seed: int = 0) -> nn.Module:
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for _ in range(epochs):
        for images, labels in data.batches(64, generator):
            optimizer.zero_grad()
            F.cross_entropy(model(images), labels).backward()
            optimizer.step()
    return model.eval()


@torch.no_grad()
def evaluate(model: nn.Module, data: Split) -> float:
    model.eval()
    correct = sum(int((model(images).argmax(1) == labels).sum()) for images, labels in data.batches(256))
    return correct / len(data.labels)


@torch.no_grad()
def calibrate(model: nn.Module, data: Split, batches: int = 8) -> None:
    enable_calibration(model)
    for index, (images, _) in enumerate(data.batches(128)):
        if index == batches:
            break
        model(images)
    enable_quantization(model)
