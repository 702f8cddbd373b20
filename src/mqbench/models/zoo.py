"""Well-conditioned instances of the project's models, for tests, benchmarks and quick experiments.

Randomly initialised deep networks are chaotic: rounding only the input to 8 bits already moves a
random MobileNetV2's logits to a cosine of ~0.93 with the originals. Real deployments quantize
trained networks, so the classifiers here are first trained for a few dozen steps on scikit-learn's
digits (upsampled to 3x32x32) and their BatchNorm statistics re-estimated on the training images.

Example:
    >>> from mqbench.models.zoo import VISION_MODELS
    >>> sorted(VISION_MODELS)[:3]
    ['detector', 'mobilenet_v2', 'mobilenet_v3']
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mqbench import models
from mqbench.data import load_digits_split

__all__ = ["VISION_MODELS", "ZooModel", "digits_rgb", "outputs_as_tensor", "zoo_labels", "zoo_model"]


def digits_rgb(images: Tensor, size: int = 32) -> Tensor:
    return F.interpolate(images, size=size, mode="bilinear", align_corners=False).expand(-1, 3, -1, -1).contiguous()


def outputs_as_tensor(output: Tensor | dict[str, Tensor]) -> Tensor:
    if isinstance(output, dict):
        return torch.cat([output[key].flatten(1) for key in sorted(output)], dim=1)
    return output.flatten(1)


@dataclass(frozen=True)
class ZooModel:
    name: str
    model: nn.Module  # eval mode, conditioned
    calibration: Tensor
    evaluation: Tensor
    make: Callable[[], nn.Module]  # a fresh, untrained instance of the same architecture


def _reestimate_bn(model: nn.Module, images: Tensor) -> None:
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.reset_running_stats()
            module.momentum = None  # cumulative average over the batches below
    model.train()
    with torch.no_grad():
        for start in range(0, len(images), 128):
            model(images[start : start + 128])
    model.eval()


def _train_classifier(model: nn.Module, images: Tensor, labels: Tensor, steps: int, lr: float) -> None:
    generator = torch.Generator().manual_seed(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        index = torch.randint(0, len(images), (32,), generator=generator)
        optimizer.zero_grad()
        F.cross_entropy(model(images[index]), labels[index]).backward()
        optimizer.step()


VISION_MODELS: dict[str, tuple[Callable[[], nn.Module], int, float]] = {
    # name: (factory, training steps on digits (0: random init, already well conditioned), learning rate)
    "resnet18": (lambda: models.resnet18(num_classes=10), 40, 2e-3),
    "resnet50": (lambda: models.resnet50(num_classes=10), 40, 2e-3),
    "mobilenet_v2": (lambda: models.mobilenet_v2(num_classes=10), 40, 2e-3),
    "mobilenet_v3": (lambda: models.mobilenet_v3_small_style(num_classes=10), 40, 2e-3),
    "unet": (lambda: models.unet(in_channels=3, num_classes=2), 0, 0.0),
    "detector": (lambda: models.two_head_detector(num_classes=3), 0, 0.0),
    "vit": (lambda: models.vit_tiny(image_size=32, num_classes=10), 300, 1e-3),  # ~72% test accuracy
}


def zoo_labels(name: str) -> Tensor | None:
    """The digit labels of ``zoo_model(name).calibration`` for classifiers, None for dense models."""
    if not VISION_MODELS[name][1]:
        return None
    train, _ = load_digits_split()
    return train.labels[:32]


@functools.cache
def zoo_model(name: str) -> ZooModel:
    make, steps, lr = VISION_MODELS[name]
    torch.manual_seed(0)
    train, test = load_digits_split()
    images, labels = digits_rgb(train.images), train.labels
    model = make()
    if steps:
        _train_classifier(model, images, labels, steps, lr)
    _reestimate_bn(model, images[:512])
    return ZooModel(name, model, images[:32], digits_rgb(test.images[:32]), make)
