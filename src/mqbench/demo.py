"""The built-in end-to-end example behind ``mqbench demo`` (no downloads).

Trains :class:`mqbench.models.DigitsCNN` on scikit-learn's digits for a few
seconds, then quantizes its weights and activations with the core fake
quantizers and reports float vs quantized test accuracy:

* W8A8 fixed: int8 per-channel symmetric weights, uint8 activations, min/max calibration;
* W4A4 LSQ: 4-bit learnable quantizers, calibrated, then fine-tuned with quantization
  in the loop (QAT).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mqbench import kernels
from mqbench.data import Split, load_digits_split
from mqbench.fake_quantize import FixedFakeQuantize, LearnableFakeQuantize, QuantizeBase
from mqbench.models import DigitsCNN
from mqbench.observer import EMAMinMaxObserver, LSQObserver, MinMaxObserver
from mqbench.utils.state import enable_calibration, enable_quantization

__all__ = ["DemoRow", "QuantStage", "attach_quantizers", "evaluate", "run_demo", "train"]

QuantizerFactory = Callable[[], QuantizeBase]


@dataclass(frozen=True)
class DemoRow:
    name: str
    weights: str
    activations: str
    accuracy: float
    seconds: float


class QuantStage(nn.Module):
    """A conv or linear layer whose input and weight pass through fake quantizers."""

    def __init__(self, layer: nn.Conv2d | nn.Linear, weight_quantizer: QuantizeBase, input_quantizer: QuantizeBase):
        super().__init__()
        self.layer = layer
        self.weight_fake_quant = weight_quantizer
        self.input_act_fake_quant = input_quantizer

    def forward(self, x: Tensor) -> Tensor:
        x = self.input_act_fake_quant(x)
        weight = self.weight_fake_quant(self.layer.weight)
        if isinstance(self.layer, nn.Conv2d):
            return self.layer._conv_forward(x, weight, self.layer.bias)
        return F.linear(x, weight, self.layer.bias)


def attach_quantizers(model: nn.Module, weight: QuantizerFactory, activation: QuantizerFactory) -> nn.Module:
    """A copy of ``model`` with every Conv2d / Linear wrapped in a :class:`QuantStage`."""
    model = copy.deepcopy(model)
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, (nn.Conv2d, nn.Linear)):
                setattr(parent, child_name, QuantStage(child, weight(), activation()))
    return model


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


def run_demo(
    epochs: int = 30, qat_epochs: int = 10, seed: int = 0, log: Callable[[str], None] = print
) -> list[DemoRow]:
    """Run the demo and return its table rows (also printed through ``log``)."""
    torch.manual_seed(seed)
    if kernels.load() is None:
        log("(fused CPU kernels unavailable: using the slower PyTorch fallback)")
    train_split, test_split = load_digits_split(seed=seed)
    rows: list[DemoRow] = []

    def record(name: str, weights: str, activations: str, model: nn.Module, start: float) -> None:
        rows.append(DemoRow(name, weights, activations, evaluate(model, test_split), time.perf_counter() - start))

    start = time.perf_counter()
    float_model = train(DigitsCNN(), train_split, epochs, lr=3e-3, seed=seed)
    record("float", "fp32", "fp32", float_model, start)

    start = time.perf_counter()
    w8a8 = attach_quantizers(
        float_model,
        weight=FixedFakeQuantize.with_args(
            observer=MinMaxObserver, quant_min=-127, quant_max=127, qscheme=torch.per_channel_symmetric, ch_axis=0
        ),
        activation=FixedFakeQuantize.with_args(observer=EMAMinMaxObserver, quant_min=0, quant_max=255),
    )
    calibrate(w8a8, train_split)
    record("W8A8 fixed (PTQ)", "int8 per-channel", "uint8", w8a8, start)

    start = time.perf_counter()
    w4a4 = attach_quantizers(
        float_model,
        weight=LearnableFakeQuantize.with_args(
            observer=LSQObserver, quant_min=-8, quant_max=7, qscheme=torch.per_channel_symmetric, ch_axis=0
        ),
        activation=LearnableFakeQuantize.with_args(observer=EMAMinMaxObserver, quant_min=0, quant_max=15),
    )
    calibrate(w4a4, train_split)
    record("W4A4 LSQ (PTQ init)", "int4 per-channel", "uint4", w4a4, start)
    start = time.perf_counter()
    train(w4a4, train_split, qat_epochs, lr=1e-3, seed=seed + 1)
    record("W4A4 LSQ (QAT)", "int4 per-channel", "uint4", w4a4, start)

    log(format_table(rows, float_accuracy=rows[0].accuracy))
    return rows


def format_table(rows: list[DemoRow], float_accuracy: float) -> str:
    header = f"{'model':<22}{'weights':<18}{'activations':<13}{'accuracy':>9}{'vs float':>10}{'time':>8}"
    lines = ["DigitsCNN on scikit-learn digits (test split, 450 images)", header, "-" * len(header)]
    for row in rows:
        delta = (row.accuracy - float_accuracy) * 100
        lines.append(
            f"{row.name:<22}{row.weights:<18}{row.activations:<13}{row.accuracy * 100:>8.1f}%"
            f"{delta:>+9.1f}%{row.seconds:>7.1f}s"
        )
    return "\n".join(lines)
