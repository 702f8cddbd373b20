"""Well-conditioned instances of the project's models, for tests, benchmarks and quick experiments.

Randomly initialised deep networks are chaotic: rounding only the input to 8 bits already moves a
random MobileNetV2's logits to a cosine of ~0.93 with the originals. Real deployments quantize
trained networks, so the classifiers here are first trained on scikit-learn's digits (upsampled to
3x32x32) and their BatchNorm statistics re-estimated on the training images.

Well conditioned means: 8-bit quantization noise stays small against the part of every activation
that varies from image to image, whichever CPU trained the model (float summation order differs
between hosts, which is no smaller a change than another seed). The recipes below get that from
how they train (see ``_cnn``), and from a calibration set of 128 images (512 for MobileNetV3, whose
depthwise inputs some backends quantize per channel), which covers the range of held-out images where
32 images left whole classes of activations to be clipped.

Training takes seconds to a minute per model, so the trained weights are cached on disk, under
``$MQBENCH_CACHE/zoo`` (default ``~/.cache/mqbench/zoo``), one file per model named by a hash of
everything that determines them: the model's name and recipe, the source code of this module and of
the modules defining the model's layers, the training data and the torch version. A change of any of
them trains anew; a file that does not load is trained anew and replaced. ``MQBENCH_ZOO_CACHE=0``
turns the cache off.

Example:
    >>> from mqbench.models.zoo import VISION_MODELS
    >>> sorted(VISION_MODELS)[:3]
    ['detector', 'mobilenet_v2', 'mobilenet_v3']
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import math
import os
import pickle
import sys
import tempfile
import warnings
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mqbench import models
from mqbench.data import load_digits_split

__all__ = [
    "VISION_MODELS",
    "ZooModel",
    "ZooRecipe",
    "build_zoo_model",
    "digits_rgb",
    "outputs_as_tensor",
    "zoo_cache_dir",
    "zoo_labels",
    "zoo_model",
]


def digits_rgb(images: Tensor, size: int = 32) -> Tensor:
    return F.interpolate(images, size=size, mode="bilinear", align_corners=False).expand(-1, 3, -1, -1).contiguous()


def outputs_as_tensor(output: Tensor | dict[str, Tensor]) -> Tensor:
    if isinstance(output, dict):
        return torch.cat([output[key].flatten(1) for key in sorted(output)], dim=1)
    return output.flatten(1)


@dataclass(frozen=True)
class ZooRecipe:
    """How one zoo model is made: its architecture and how it is trained on the digits.

    ``steps=0`` keeps the random initialisation (dense models, already well conditioned); BatchNorm
    statistics are re-estimated on the training images either way.
    """

    make: Callable[[], nn.Module]  # a fresh, untrained instance of the architecture
    steps: int = 0  # optimizer steps on batches of ``batch_size`` training images
    lr: float = 0.0  # peak learning rate
    batch_size: int = 32
    seed: int = 0  # initialisation and batch order
    optimizer: str = "adamw"  # a key of _OPTIMIZERS
    warmup: float = 0.0  # fraction of the steps with a linearly rising learning rate
    cosine: bool = False  # cosine decay to zero after the warm-up (else constant)
    label_smoothing: float = 0.0
    calibration_images: int = 128  # the first training images (about 13 of each digit) make the calibration set


@dataclass(frozen=True)
class ZooModel:
    name: str
    model: nn.Module  # eval mode, conditioned
    calibration: Tensor
    evaluation: Tensor
    make: Callable[[], nn.Module]  # a fresh, untrained instance of the same architecture


# Classifiers: a warm-up, cosine decay and label smoothing; label smoothing bounds the logit targets,
# so no class grows features without limit (ResNet-50's "1"s reached 5x the other digits' range, on
# some hosts beyond every calibration image's). MobileNets train with SGD (Nesterov momentum): its
# steps lie in the span of the gradients, so the 3x3 stem never moves in directions the smooth,
# upsampled digits do not excite, where Adam's per-coordinate steps do move it and kill channels, both
# of which BN folding turns into 8-bit noise (a stem channel at 14 dB, a dead channel's weights scaled
# by 1/sqrt(eps)). ResNets' 7x7 stems stay above 37 dB with AdamW, which trains them in 40 steps.
#
# MobileNetV3 calibrates on 512 images: OpenVINO's placement quantizes its depthwise inputs per channel, and with
# 128 images the held-out ones exceed some channel's calibrated range (up to 2.2x it, 4% of that channel's values):
# plain calibration's centered cosine with float fell to 0.958-0.975 on 3 of 4 training seeds (0.991 on the
# fourth); with 512, 0.992-0.997 on all four (measured on an AVX-512 host; per-tensor TensorRT: 0.991-0.995 either
# way).
def _classifier(
    make: Callable[[], nn.Module], steps: int, optimizer: str, lr: float, calibration_images: int = 128
) -> ZooRecipe:
    return ZooRecipe(
        make,
        steps,
        lr,
        optimizer=optimizer,
        warmup=0.1,
        cosine=True,
        label_smoothing=0.1,
        calibration_images=calibration_images,
    )


VISION_MODELS: dict[str, ZooRecipe] = {
    "resnet18": _classifier(lambda: models.resnet18(num_classes=10), 40, "adamw", 2e-3),
    "resnet50": _classifier(lambda: models.resnet50(num_classes=10), 40, "adamw", 2e-3),
    "mobilenet_v2": _classifier(lambda: models.mobilenet_v2(num_classes=10), 80, "sgd", 0.05),
    "mobilenet_v3": _classifier(lambda: models.mobilenet_v3_small_style(num_classes=10), 60, "sgd", 0.05, 512),
    "unet": ZooRecipe(lambda: models.unet(in_channels=3, num_classes=2)),
    "detector": ZooRecipe(lambda: models.two_head_detector(num_classes=3)),
    "vit": _classifier(lambda: models.vit_tiny(image_size=32, num_classes=10), 300, "adamw", 1e-3),
}


def zoo_labels(name: str) -> Tensor | None:
    """The digit labels of ``zoo_model(name).calibration`` for classifiers, None for dense models."""
    if not VISION_MODELS[name].steps:
        return None
    train, _ = load_digits_split()
    return train.labels[: VISION_MODELS[name].calibration_images]


_CONSTANT_VARIANCE = 1e-4  # relative to BN's eps: below it a channel's normalized output moves by < 1% of gamma


def _reestimate_bn(model: nn.Module, images: Tensor) -> None:
    """Running statistics as the plain average over ``images`` (the last training batches' noise removed).

    A channel constant on every image (a dead ReLU upstream) has a running variance of ~0, and BN
    folding would multiply the weights feeding it by gamma / sqrt(eps) (~300x): one such channel takes
    a per-tensor weight grid's whole range. Its output is beta whatever the input, so gamma is set to 0,
    which keeps that output and folds to zero weights.
    """
    norms = [module for module in model.modules() if isinstance(module, nn.modules.batchnorm._BatchNorm)]
    momenta = [norm.momentum for norm in norms]
    for norm in norms:
        norm.reset_running_stats()
        norm.momentum = None  # cumulative average over the batches below
    model.train()
    with torch.no_grad():
        for start in range(0, len(images), 128):
            model(images[start : start + 128])
    model.eval()
    for norm, momentum in zip(norms, momenta, strict=True):
        norm.momentum = momentum
        if norm.affine and norm.running_var is not None:
            with torch.no_grad():
                norm.weight.masked_fill_(norm.running_var < _CONSTANT_VARIANCE * norm.eps, 0.0)


_OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "adamw": torch.optim.AdamW,
    "sgd": functools.partial(torch.optim.SGD, momentum=0.9, nesterov=True),
}


def _train_classifier(model: nn.Module, images: Tensor, labels: Tensor, recipe: ZooRecipe) -> None:
    generator = torch.Generator().manual_seed(recipe.seed)
    optimizer = _OPTIMIZERS[recipe.optimizer](model.parameters(), lr=recipe.lr)
    warmup = round(recipe.warmup * recipe.steps)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if not recipe.cosine:
            return 1.0
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, recipe.steps - warmup)))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    model.train()
    for _ in range(recipe.steps):
        index = torch.randint(0, len(images), (recipe.batch_size,), generator=generator)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(images[index]), labels[index], label_smoothing=recipe.label_smoothing)
        loss.backward()
        optimizer.step()
        schedule.step()


def zoo_cache_dir() -> Path | None:
    """Where trained zoo weights are kept: ``$MQBENCH_CACHE/zoo`` or ``~/.cache/mqbench/zoo``; None when off."""
    if os.environ.get("MQBENCH_ZOO_CACHE", "1") == "0":
        return None
    root = os.environ.get("MQBENCH_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "mqbench") / "zoo"


def _cache_key(name: str, recipe: ZooRecipe, model: nn.Module, images: Tensor, labels: Tensor) -> str | None:
    """A hash of everything the trained weights depend on (the CPU's float rounding aside).

    None when the source of a module defining the model cannot be read (an interactive session):
    such a model is not cached.
    """
    defining = {type(module).__module__ for module in model.modules()} | {__name__, recipe.make.__module__}
    try:
        sources = {
            module: inspect.getsource(sys.modules[module])
            for module in sorted(defining)
            if module != "torch" and not module.startswith("torch.")
        }
    except (OSError, TypeError, KeyError):
        return None
    recipe_fields = {field.name: getattr(recipe, field.name) for field in fields(recipe) if field.name != "make"}
    settings = {"name": name, **recipe_fields, "torch": torch.__version__, "sources": sources}
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    digest.update(images.numpy().tobytes())
    digest.update(labels.numpy().tobytes())
    return digest.hexdigest()[:20]


def _load(path: Path, model: nn.Module) -> bool:
    """Load the cached weights into ``model``; False when there is no usable file."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        model.load_state_dict(state)
    except FileNotFoundError:
        return False
    except (OSError, RuntimeError, EOFError, ValueError, KeyError, pickle.UnpicklingError, zipfile.BadZipFile) as error:
        warnings.warn(f"zoo cache file {path} does not load ({error}); training anew", stacklevel=3)
        return False
    return True


def _store(path: Path, model: nn.Module) -> None:
    """Write atomically (a temporary file renamed over the target): readers see no file or a whole one."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}-", suffix=".tmp")
        try:
            with os.fdopen(handle, "wb") as file:
                torch.save(model.state_dict(), file)
                file.flush()
                os.fsync(file.fileno())
            os.replace(temporary, path)
        except BaseException:
            os.unlink(temporary)
            raise
    except OSError as error:
        warnings.warn(f"zoo cache {path.parent} is not writable ({error}); weights not cached", stacklevel=3)


def build_zoo_model(name: str, recipe: ZooRecipe | None = None) -> ZooModel:
    """Build the zoo model ``name`` (by ``recipe``, default its own), loading its weights from the cache.

    ``zoo_model`` is this, once per process for the built-in recipes.
    """
    recipe = VISION_MODELS[name] if recipe is None else recipe
    torch.manual_seed(recipe.seed)
    train, test = load_digits_split()
    images, labels = digits_rgb(train.images), train.labels
    model = recipe.make()
    directory = zoo_cache_dir()
    key = None if directory is None else _cache_key(name, recipe, model, images, labels)
    path = None if directory is None or key is None else directory / f"{name}-{key}.pt"
    if path is None or not _load(path, model):
        if recipe.steps:
            _train_classifier(model, images, labels, recipe)
        _reestimate_bn(model, images[:512])
        if path is not None:
            _store(path, model)
    calibration = images[: recipe.calibration_images]
    return ZooModel(name, model.eval(), calibration, digits_rgb(test.images[:32]), recipe.make)


@functools.cache
def zoo_model(name: str) -> ZooModel:
    """The conditioned zoo model ``name`` (one instance per process: treat it as read-only)."""
    return build_zoo_model(name)
