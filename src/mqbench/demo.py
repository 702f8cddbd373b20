"""The built-in end-to-end example behind ``mqbench demo`` (no downloads).

Trains :class:`mqbench.models.DigitsCNN` on scikit-learn's digits for a few seconds, then
prepares it for every registered backend with :func:`~mqbench.prepare_by_platform.prepare_by_platform`,
calibrates it (post-training quantization) and reports the test accuracy of each simulation;
finally a 4-bit model (LSQ weights and activations, Academic backend) is fine-tuned with
quantization in the loop (QAT).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mqbench import kernels
from mqbench.backends import ParamsTable
from mqbench.data import Split, load_digits_split
from mqbench.models import DigitsCNN
from mqbench.prepare_by_platform import prepare_by_platform
from mqbench.utils.state import enable_calibration, enable_quantization

__all__ = ["DemoRow", "academic_config", "calibrate", "evaluate", "run_demo", "train"]


@dataclass(frozen=True)
class DemoRow:
    name: str
    weights: str
    activations: str
    accuracy: float
    seconds: float


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


def run_demo(
    epochs: int = 30, qat_epochs: int = 10, seed: int = 0, log: Callable[[str], None] = print
) -> list[DemoRow]:
    """Run the demo and return its table rows (also printed through ``log``)."""
    torch.manual_seed(seed)
    if kernels.load() is None:
        log("(fused CPU kernels unavailable: using the slower PyTorch fallback)")
    train_split, test_split = load_digits_split(seed=seed)
    rows: list[DemoRow] = []

    start = time.perf_counter()
    float_model = train(DigitsCNN(), train_split, epochs, lr=3e-3, seed=seed)
    rows.append(DemoRow("float", "fp32", "fp32", evaluate(float_model, test_split), time.perf_counter() - start))

    for name, spec in ParamsTable.items():
        start = time.perf_counter()
        config = academic_config(8) if spec.weight is None else None
        prepared = prepare_by_platform(float_model, name, config)
        calibrate(prepared, train_split)
        weights = spec.weight.scheme if spec.weight else None
        activations = spec.activation.scheme if spec.activation else None
        rows.append(
            DemoRow(
                f"{name} (PTQ)",
                _scheme_text(weights, "int8 LSQ"),
                _scheme_text(activations, "uint8 LSQ"),
                evaluate(prepared, test_split),
                time.perf_counter() - start,
            )
        )

    start = time.perf_counter()
    qat_model = prepare_by_platform(float_model.train(), "academic", academic_config(4))
    calibrate(qat_model, train_split)
    train(qat_model, train_split, qat_epochs, lr=1e-3, seed=seed + 1)
    rows.append(
        DemoRow(
            "academic W4A4 (QAT)", "int4 LSQ", "uint4 LSQ", evaluate(qat_model, test_split), time.perf_counter() - start
        )
    )
    log(format_table(rows, float_accuracy=rows[0].accuracy))
    return rows


def _scheme_text(scheme: Any, default: str) -> str:
    if scheme is None:
        return default
    sign = "u" if scheme.quant_min >= 0 else ""
    granularity = " per-channel" if scheme.per_channel else ""
    pot = " pot" if scheme.pot_scale else ""
    return f"{sign}int{scheme.bits}{granularity}{pot}"


def format_table(rows: list[DemoRow], float_accuracy: float) -> str:
    header = f"{'model':<24}{'weights':<22}{'activations':<14}{'accuracy':>9}{'vs float':>10}{'time':>8}"
    lines = ["DigitsCNN on scikit-learn digits (test split, 450 images)", header, "-" * len(header)]
    for row in rows:
        delta = (row.accuracy - float_accuracy) * 100
        lines.append(
            f"{row.name:<24}{row.weights:<22}{row.activations:<14}{row.accuracy * 100:>8.1f}%"
            f"{delta:>+9.1f}%{row.seconds:>7.1f}s"
        )
    return "\n".join(lines)
