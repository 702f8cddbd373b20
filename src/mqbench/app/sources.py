"""The model and the data a run configuration names.

Models (``model.type``):

* a zoo name (``resnet18``, ``mobilenet_v2``, ``vit``, ...): the architecture of
  :mod:`mqbench.models.zoo`, trained on the bundled digits (cached), or with ``model.path`` the
  given checkpoint loaded into it;
* ``package.module:factory``: ``factory(**model.kwargs)`` from an importable module (the working
  directory is importable, as is ``PYTHONPATH``);
* a torchvision or timm model name, when that package is installed.

A Hugging Face model (a ``transformers`` model from a factory, e.g. ``from_pretrained`` on a local
folder) is traced with transformers' ``HFTracer`` when ``model.tracer`` is ``huggingface``; the
data then feeds its ``model.input_names`` argument (default ``input_ids``), the others keep their
defaults (an ``attention_mask`` of ones: sequences of one length), and its prediction is the
output's ``logits``.

Models that bring their own data and metric (``model.task``, :mod:`mqbench.app.config`):

* ``tiny_gpt`` (language_model): :func:`mqbench.models.decoder.trained_decoder`'s byte-level decoder (trained on
  the first call, cached; ``model.kwargs`` changes fields of its recipe, ``DecoderRecipe``: e.g. ``{depth: 2,
  steps: 250}``), with ``model.path`` a checkpoint of its architecture loaded into it. Its data: windows
  of the standard library's source, 128 bytes of the training part for calibration (``cali_batchsize x
  batch_size`` of them, seed ``process.seed + 1``), 129 bytes of the held-out part for the perplexity
  (``data.max_eval`` of them, default 64, seed 1000; the model reads the first 128).

* ``causal_lm`` (language_model): a Hugging Face causal language model on your text
  (:mod:`mqbench.app.causal_lm`).

``model.path`` (other models) is a checkpoint read with ``torch.load(weights_only=True)``: a state dict, or a dict
holding one under ``state_dict`` or ``model`` (training scripts' layouts); a ``module.`` prefix
(saved from DistributedDataParallel) is removed.

Data (``data.path``):

* nothing: the bundled digits (scikit-learn), as 3-channel ``input_size`` images;
* a folder with ``train/`` and ``val/``, one subfolder of images per class in each (ImageNet's
  layout), read with pillow: RGB, resized to ``test_resize`` then centre-cropped to ``input_size``,
  normalised by ``mean`` / ``std``;
* a ``.npz`` file with ``x_train`` and ``x_val`` (float arrays, ``[N, C, H, W]``, already
  normalised; for a Hugging Face model integer token ids ``[N, L]``, kept as int64) and, for
  accuracy, integer ``y_train`` / ``y_val``;
* or, with ``data.factory: package.module:function``, what ``function(**data.kwargs)`` returns: the
  training and validation datasets as ``{"train": ..., "val": ...}`` or a pair, each a map-style
  dataset (``len`` and indexing, as ``torch.utils.data.Dataset``) of ``(input, label)`` pairs or of
  inputs alone. Their samples are read into memory once.

Example:
    >>> from mqbench.app.sources import split_import_path
    >>> split_import_path("my_models.nets:small_cnn")
    ('my_models.nets', 'small_cnn')
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import sys
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from mqbench.app.config import ConfigError
from mqbench.data import load_digits_split
from mqbench.models.decoder import DecoderRecipe, token_windows, trained_decoder
from mqbench.models.zoo import VISION_MODELS, digits_rgb, zoo_model
from mqbench.utils.logger import logger

__all__ = [
    "IMAGE_SUFFIXES",
    "Data",
    "decoder_recipe",
    "fit_channels",
    "load_checkpoint",
    "load_data",
    "load_language_model",
    "load_model",
    "split_import_path",
]

LANGUAGE_MODEL_WINDOWS = 64  # held-out windows a language model is measured on without data.max_eval

_HALF_TYPES = (torch.float16, torch.bfloat16)
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")


@dataclass(frozen=True)
class Data:
    """Training images (calibration draws from them) and validation images with their labels, as tensors."""

    train: Tensor
    train_labels: Tensor | None
    val: Tensor
    val_labels: Tensor | None
    classes: tuple[str, ...]
    source: str

    def calibration_batches(self, batches: int, batch_size: int) -> list[Tensor]:
        """The first ``batches`` batches of the training images (MQBench's ``cali_batchsize``)."""
        count = min(len(self.train), batches * batch_size)
        return [self.train[i : min(i + batch_size, count)] for i in range(0, count, batch_size)]


def split_import_path(text: str, key: str = "model.type") -> tuple[str, str]:
    """``"package.module:factory"`` as (module, attribute); a ConfigError (naming ``key``) for anything else."""
    module, sep, attribute = text.partition(":")
    if not sep or not module or not attribute or not all(part.isidentifier() for part in module.split(".")):
        raise ConfigError(f"{key} {text!r} is not an import path of the form package.module:factory")
    return module, attribute


def load_checkpoint(model: nn.Module, path: str | Path) -> nn.Module:
    """Load a checkpoint (weights only) into ``model``; a clear error when it is not one or does not fit."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"model.path {str(file)!r}: no such checkpoint file")
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as error:  # pickle errors, foreign formats
        raise ConfigError(
            f"model.path {str(file)!r} is not a checkpoint torch.load(weights_only=True) can read "
            f"({type(error).__name__}: {error}); save the state dict with torch.save(model.state_dict(), path)"
        ) from error
    if isinstance(state, dict):
        for key in ("state_dict", "model"):
            if isinstance(state.get(key), dict):
                state = state[key]
                break
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise ConfigError(f"model.path {str(file)!r} holds no state dict (a mapping of names to tensors)")
    state = {k.removeprefix("module."): v for k, v in state.items()}
    try:
        model.load_state_dict(state)
    except RuntimeError as error:
        raise ConfigError(f"model.path {str(file)!r} does not fit model.type's architecture: {error}") from error
    return model


def _factory(text: str, key: str = "model.type") -> Any:
    module_name, attribute = split_import_path(text, key)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # the working directory is importable, as with `python -m`
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ConfigError(f"{key} {text!r}: cannot import {module_name!r} ({error})") from error
    factory = getattr(module, attribute, None)
    if not callable(factory):
        raise ConfigError(f"{key} {text!r}: {module_name!r} has no callable {attribute!r}")
    return factory


def _named_model(name: str, kwargs: dict[str, Any]) -> nn.Module | None:
    """A torchvision or timm model by name, when either is installed and knows it."""
    try:
        import torchvision  # type: ignore[import-not-found]

        if name in torchvision.models.list_models():
            return torchvision.models.get_model(name, **kwargs)
    except Exception:  # not installed, or a CUDA build that does not import here
        pass
    try:
        import timm  # type: ignore[import-not-found]

        if timm.is_model(name):
            return timm.create_model(name, **kwargs)
    except Exception:
        pass
    return None


def load_model(section: dict[str, Any]) -> tuple[nn.Module, str]:
    """The float model of a configuration's ``model`` section (eval mode) and a description of it."""
    name, kwargs, path = section["type"], dict(section.get("kwargs") or {}), section.get("path")
    if name in VISION_MODELS:
        if kwargs:
            raise ConfigError(
                f"model.kwargs: the zoo model {name!r} is built by its own recipe and takes none; "
                "for your own architecture give model.type as package.module:factory"
            )
        if path is None:
            return zoo_model(name).model, f"zoo {name} (trained on the bundled digits)"
        model = VISION_MODELS[name].make()
        return load_checkpoint(model, path).eval(), f"zoo architecture {name} with {path}"
    if ":" in name:
        model = _factory(name)(**kwargs)
        if not isinstance(model, nn.Module):
            raise ConfigError(f"model.type {name!r} returned {type(model).__name__}, not a torch.nn.Module")
    else:
        found = _named_model(name, kwargs)
        if found is None:
            raise ConfigError(
                f"model.type {name!r} is not a zoo model ({', '.join(sorted(VISION_MODELS))}), an import path "
                "package.module:factory, or a torchvision/timm model installed here"
            )
        model = found
    if path is not None:
        load_checkpoint(model, path)
    return _float32(model).eval(), f"{name}" + (f" with {path}" if path else "")


def load_language_model(config: dict[str, Any]) -> tuple[nn.Module, str, Data]:
    """``model.type: tiny_gpt``: the trained decoder (eval mode), a description, and its data (see the module
    docstring): calibration windows ``[cali_batchsize x batch_size, 128]`` as ``train``, held-out windows
    ``[max_eval, 129]`` as ``val``, no labels (``model.type: causal_lm``:
    :func:`mqbench.app.causal_lm.load_causal_lm`)."""
    section = config["model"]
    recipe = decoder_recipe(section["kwargs"] or {})
    model, train_bytes, held_bytes = trained_decoder(recipe)
    changed = ", ".join(f"{key} {value}" for key, value in (section["kwargs"] or {}).items())
    described = "tiny_gpt (byte-level decoder trained on the standard library" + (f"; {changed})" if changed else ")")
    if section["path"] is not None:
        load_checkpoint(model, section["path"])
        described = f"tiny_gpt with {section['path']}"
    context = int(model.context)
    calibration = config["quantize"]["cali_batchsize"] * config["data"]["batch_size"]
    evaluation = config["data"]["max_eval"] or LANGUAGE_MODEL_WINDOWS
    train = token_windows(train_bytes, context, calibration, config["process"]["seed"] + 1)
    val = token_windows(held_bytes, context + 1, evaluation, 1000)
    return model.eval(), described, Data(train, None, val, None, (), "standard library source (bytes)")


def decoder_recipe(kwargs: dict[str, Any]) -> DecoderRecipe:
    """``model.kwargs`` of ``tiny_gpt``: fields of :class:`~mqbench.models.decoder.DecoderRecipe` changed from its
    defaults (a smaller or shorter-trained decoder, trained once and cached under its own key); a key it does not
    have or a value of the wrong kind is a ConfigError."""
    kinds = {field.name: float if field.type in (float, "float") else int for field in fields(DecoderRecipe)}
    unknown = sorted(set(kwargs) - set(kinds))
    if unknown:
        raise ConfigError(
            f"model.kwargs: tiny_gpt's recipe has no {', '.join(map(repr, unknown))}; its keys are "
            f"{', '.join(kinds)} (mqbench.models.decoder.DecoderRecipe)"
        )
    values: dict[str, Any] = {}
    for key, value in kwargs.items():
        number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not number or value < 0 or (key != "seed" and value == 0) or (kinds[key] is int and value != int(value)):
            wanted = "a positive number" if kinds[key] is float else "a positive integer"
            wanted = "a non-negative integer" if key == "seed" else wanted
            raise ConfigError(f"model.kwargs.{key}: tiny_gpt's recipe takes {wanted} here, got {value!r}")
        values[key] = kinds[key](value)
    recipe = replace(DecoderRecipe(), **values)
    if recipe.dim % recipe.heads:
        raise ConfigError(f"model.kwargs: dim {recipe.dim} is not a multiple of heads {recipe.heads}")
    return recipe


def _float32(model: nn.Module) -> nn.Module:
    """A float16 / bfloat16 model as float32, the type mqbench calibrates, evaluates and deploys in (with a note)."""
    halves = sorted({str(t.dtype).removeprefix("torch.") for t in model.parameters() if t.dtype in _HALF_TYPES})
    if halves:
        logger.warning(
            "model: its parameters are %s; the run evaluates, quantizes and deploys it in float32 (the float "
            "accuracy is the float32 model's)",
            " and ".join(halves),
        )
        model.float()
    return model


def _folder_split(root: Path, section: dict[str, Any], classes: list[str] | None) -> tuple[Tensor, Tensor, list[str]]:
    try:
        from PIL import Image
    except ImportError as error:
        raise ImportError("reading image folders needs pillow: pip install pillow") from error
    if not root.is_dir():
        raise ConfigError(
            f"data.path: {root} has no {root.name}/ folder (expected train/ and val/, one folder per class)"
        )
    found = sorted(p.name for p in root.iterdir() if p.is_dir())
    if classes is None:
        classes = found
    if not classes:
        raise ConfigError(f"data.path: {root} has no class folders (one subfolder of images per class)")
    unknown = sorted(set(found) - set(classes))
    if unknown:
        raise ConfigError(f"data.path: {root} has class folders that train/ lacks: {', '.join(unknown)}")
    size, resize = section["input_size"], section["test_resize"]
    mean = torch.tensor(section["mean"], dtype=torch.float32).view(-1, 1, 1)
    std = torch.tensor(section["std"], dtype=torch.float32).view(-1, 1, 1)
    images, labels = [], []
    for index, name in enumerate(classes):
        folder = root / name
        files = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES) if folder.is_dir() else []
        for file in files:
            try:
                with Image.open(file) as image:
                    picture = image.convert("RGB")
            except OSError as error:
                raise ConfigError(f"data.path: {file} is not an image pillow can read ({error})") from error
            width, height = picture.size
            scale = resize / min(width, height)
            picture = picture.resize((max(size, round(width * scale)), max(size, round(height * scale))))
            left, top = (picture.size[0] - size) // 2, (picture.size[1] - size) // 2
            picture = picture.crop((left, top, left + size, top + size))
            pixels = torch.frombuffer(bytearray(picture.tobytes()), dtype=torch.uint8).view(size, size, 3)
            images.append((pixels.permute(2, 0, 1).float() / 255.0 - mean) / std)
            labels.append(index)
    if not images:
        raise ConfigError(f"data.path: {root} holds no images ({', '.join(IMAGE_SUFFIXES)})")
    return torch.stack(images), torch.tensor(labels, dtype=torch.int64), classes


def _npz(file: Path, token_ids: bool) -> Data:
    import numpy as np

    try:
        arrays = np.load(file)
    except Exception as error:
        raise ConfigError(f"data.path: {file} is not a .npz file numpy can read ({error})") from error
    missing = [key for key in ("x_train", "x_val") if key not in arrays.files]
    if missing:
        raise ConfigError(f"data.path: {file} lacks {', '.join(missing)} (has {', '.join(arrays.files) or 'nothing'})")

    def labels(key: str) -> Tensor | None:
        return torch.from_numpy(arrays[key].astype("int64")) if key in arrays.files else None

    def inputs(key: str) -> Tensor:
        array = arrays[key]
        if token_ids:
            if array.dtype.kind not in "iu":
                raise ConfigError(f"data.path: {file}: {key} must hold integer token ids, got {array.dtype}")
            return torch.from_numpy(array.astype("int64"))
        return torch.from_numpy(array.astype("float32"))

    train, val = inputs("x_train"), inputs("x_val")
    return Data(train, labels("y_train"), val, labels("y_val"), (), str(file))


def _samples(dataset: Any, split: str, text: str, token_ids: bool) -> tuple[Tensor, Tensor | None]:
    """A map-style dataset's inputs stacked (and labels, when its items are pairs)."""
    where = f"data.factory {text!r}: its {split} dataset"
    try:
        items = [dataset[index] for index in range(len(dataset))]
    except Exception as error:
        raise ConfigError(f"{where} cannot be read by index over len() ({type(error).__name__}: {error})") from error
    if not items:
        raise ConfigError(f"{where} is empty")
    pairs = all(isinstance(item, tuple | list) and len(item) == 2 for item in items)
    inputs = [item[0] if pairs else item for item in items]
    try:
        stacked = torch.stack([torch.as_tensor(x) for x in inputs])
    except Exception as error:
        raise ConfigError(f"{where} holds inputs that do not stack into one tensor ({error})") from error
    if token_ids:
        if stacked.is_floating_point():
            raise ConfigError(f"{where} must hold integer token ids for a Hugging Face model, got {stacked.dtype}")
        stacked = stacked.to(torch.int64)
    else:
        stacked = stacked.to(torch.float32)
    labels = torch.as_tensor([int(item[1]) for item in items], dtype=torch.int64) if pairs else None
    return stacked, labels


def _from_factory(section: dict[str, Any], token_ids: bool) -> Data:
    text = section["factory"]
    made = _factory(text, "data.factory")(**dict(section.get("kwargs") or {}))
    if isinstance(made, dict) and {"train", "val"} <= set(made):
        train, val = made["train"], made["val"]
    elif isinstance(made, tuple | list) and len(made) == 2:
        train, val = made
    else:
        raise ConfigError(
            f"data.factory {text!r} returned {type(made).__name__}; it returns the training and validation datasets "
            'as {"train": ..., "val": ...} or a pair'
        )
    train_inputs, train_labels = _samples(train, "train", text, token_ids)
    val_inputs, val_labels = _samples(val, "val", text, token_ids)
    classes = tuple(str(c) for c in getattr(train, "classes", ()) or ())
    return Data(train_inputs, train_labels, val_inputs, val_labels, classes, text)


def _first_convolution(model: nn.Module) -> tuple[str, nn.modules.conv._ConvNd] | None:
    """The model's first layer with parameters (module order), when it is a convolution."""
    for name, module in model.named_modules():
        if next(module.parameters(recurse=False), None) is None:
            continue
        return (name, module) if isinstance(module, nn.modules.conv._ConvNd) else None
    return None


def _error_on(model: nn.Module, sample: Tensor) -> Exception | None:
    """What the model raises on ``sample`` (None when it runs)."""
    try:
        with torch.no_grad():
            model(sample)
    except (RuntimeError, ValueError, TypeError, IndexError) as error:
        return error
    return None


_LAYOUTS = {1: "(N, C, L)", 2: "(N, C, H, W)", 3: "(N, C, D, H, W)"}


def fit_channels(data: Data, model: nn.Module) -> Data:
    """``data`` shaped for ``model``: images without a channel axis (``(N, H, W)``) get one when the model's first
    layer is a convolution of one input channel (with a warning saying so); a clear error naming the inputs'
    shape and the layout the first layer takes when the model cannot run on them."""
    first = _first_convolution(model)
    if first is None or not data.train.is_floating_point():
        return data
    error = _error_on(model, data.train[:1])
    if error is None:
        return data
    name, conv = first
    spatial = len(conv.kernel_size)
    layout = _LAYOUTS.get(spatial, f"N, C and {spatial} spatial axes")
    shape = tuple(data.train.shape)
    if data.train.dim() == spatial + 1 and data.val.dim() == spatial + 1:  # no channel axis
        if conv.in_channels == 1 and _error_on(model, data.train[:1].unsqueeze(1)) is None:
            logger.warning(
                "data: %s: the inputs have shape %s, without a channel axis; the model's first layer %r takes one "
                "channel, so they are read as %s with C=1",
                data.source,
                shape,
                name,
                layout,
            )
            return replace(data, train=data.train.unsqueeze(1), val=data.val.unsqueeze(1))
        raise ConfigError(
            f"data: {data.source}: the inputs have shape {shape}, without a channel axis, and the model's first "
            f"layer {name!r} takes {conv.in_channels} channels: store them as {layout} with C={conv.in_channels}"
        )
    first_line = str(error).splitlines()[0] if str(error) else ""
    raise ConfigError(
        f"data: {data.source}: the model cannot run on inputs of shape {shape}; its first layer {name!r} takes "
        f"{layout} with C={conv.in_channels} ({type(error).__name__}: {first_line})"
    )


def load_data(section: dict[str, Any], token_ids: bool = False) -> Data:
    """The data of a configuration's ``data`` section (see the module docstring); ``token_ids``: the
    model is a Hugging Face one, whose ``.npz`` inputs are integer token ids."""
    path = section.get("path")
    if section.get("factory") is not None:
        return _from_factory(section, token_ids)
    if token_ids and (path is None or Path(path).suffix != ".npz"):
        raise ConfigError(
            "data.path: a Hugging Face model reads token ids from a .npz file (x_train, x_val) or a data.factory"
        )
    if path is None:
        digits_train, digits_test = load_digits_split()
        size = section["input_size"]
        return Data(
            digits_rgb(digits_train.images, size),
            digits_train.labels,
            digits_rgb(digits_test.images, size),
            digits_test.labels,
            tuple(str(i) for i in range(10)),
            "digits",
        )
    location = Path(path)
    if location.suffix == ".npz":
        if not location.is_file():
            raise ConfigError(f"data.path: no such file {location}")
        return _npz(location, token_ids)
    if not location.is_dir():
        raise ConfigError(f"data.path: {location} is neither a folder (train/ and val/) nor a .npz file")
    train_images, train_labels, names = _folder_split(location / "train", section, None)
    val_images, val_labels, _ = _folder_split(location / "val", section, names)
    return Data(train_images, train_labels, val_images, val_labels, tuple(names), str(location))
