"""Hugging Face attention masks that ``torch.export`` captures as plain tensor ops.

transformers 4.5x builds its 4-d attention masks by ``torch.vmap`` over batch, head, query and key
indices of a mask function (``masking_utils._vmap_for_bhqkv``). Captured by ``torch.export``, that is a
region of functorch level changes that prepare's graph passes and the ONNX exporter cannot keep. The
mask functions transformers ships (causal, padding, sliding window and their ``and_masks`` /
``or_masks`` combinations) are elementwise tensor expressions, so calling them once on broadcast index
tensors gives the same mask; :func:`masks_without_vmap` does that while a model is captured.

Example:
    >>> import torch
    >>> with masks_without_vmap():
    ...     pass  # transformers not imported: nothing to change
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

__all__ = [
    "ATTENTION",
    "BYTE_LEVEL",
    "INPUT_NAMES",
    "LEADING_ROWS",
    "PARAMETER_NAMES",
    "REPLACED_LAYERS",
    "SOURCE_CONFIG",
    "attention_of",
    "broadcast_for_bhqkv",
    "linear_layers",
    "masks_without_vmap",
    "source_config",
]

# The prepared model's attribute holding the Hugging Face model's configuration (a JSON-able dict with
# "architectures"): what a checkpoint a Hugging Face runtime loads (compressed-tensors) is written with.
SOURCE_CONFIG = "mqbench_source_config"
# its key counting the layers prepare replaced by nn.Linear (GPT-2's Conv1D): a checkpoint stores them otherwise
REPLACED_LAYERS = "mqbench_replaced_linear_layers"
# its key naming the model's attention implementation ("sdpa", "eager"): a checkpoint's loader computes attention
# the same way when it checks the checkpoint against the simulation
ATTENTION = "mqbench_attn_implementation"
# for a model that computes a Hugging Face architecture without being its class (``checkpoint_config()``): its
# parameter names mapped onto the architecture's, the forward's arguments that take its inputs (in order), the zero rows
# a parameter takes in front in the architecture (OPT's position table starts at row 2)
PARAMETER_NAMES = "mqbench_parameter_names"
INPUT_NAMES = "mqbench_input_names"
LEADING_ROWS = "mqbench_leading_rows"
# true for a model whose tokens are the 256 bytes (its checkpoints carry a byte-level tokenizer)
BYTE_LEVEL = "mqbench_byte_level"


def source_config(model: nn.Module) -> dict[str, Any] | None:
    """A Hugging Face model's configuration as ``config.json`` holds it (its class in ``architectures``), or None
    for a model without one. A model that computes a Hugging Face architecture without being its class declares
    it with a ``checkpoint_config()`` method (its parameter names mapped: :data:`PARAMETER_NAMES`)."""
    declared = getattr(model, "checkpoint_config", None)
    if callable(declared):
        return dict(declared())
    config = getattr(model, "config", None)
    to_dict = getattr(config, "to_dict", None)
    if not callable(to_dict) or not isinstance(getattr(config, "model_type", None), str):
        return None
    values = dict(to_dict())
    values["architectures"] = [type(model).__name__]
    attention = getattr(config, "_attn_implementation", None)
    if isinstance(attention, str):
        values[ATTENTION] = attention
    return values


def attention_of(model: Any) -> str | None:
    """The attention implementation of the Hugging Face model a prepared ``model`` came from (None: not known)."""
    config = getattr(model, SOURCE_CONFIG, None)
    return config.get(ATTENTION) if isinstance(config, dict) else None


def broadcast_for_bhqkv(mask_function: Callable[..., Any], bh_indices: bool = True) -> Callable[..., Any]:
    """``mask_function`` over every (batch, head, query, key) index at once, by broadcasting: what
    transformers' ``_vmap_for_bhqkv`` computes by four nested ``vmap`` calls, the same shape and values
    (``[B, H, Q, K]``, or ``[Q, K]`` without ``bh_indices``)."""

    def expanded(batch_idx: Any, head_idx: Any, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        if bh_indices:
            shape: tuple[int, ...] = (batch_idx.shape[0], head_idx.shape[0], q_idx.shape[0], kv_idx.shape[0])
            mask = mask_function(
                batch_idx[:, None, None, None],
                head_idx[None, :, None, None],
                q_idx[None, None, :, None],
                kv_idx[None, None, None, :],
            )
        else:
            shape = (q_idx.shape[0], kv_idx.shape[0])
            mask = mask_function(batch_idx, head_idx, q_idx[:, None], kv_idx[None, :])
        return torch.as_tensor(mask, dtype=torch.bool, device=q_idx.device).expand(shape)

    return expanded


@contextlib.contextmanager
def masks_without_vmap() -> Iterator[None]:
    """While inside, transformers' masks (if transformers is imported) are built by broadcasting."""
    masking = sys.modules.get("transformers.masking_utils")
    original = getattr(masking, "_vmap_for_bhqkv", None)
    if masking is None or original is None:
        yield
        return
    # indexing by tensors needs no rewriting without vmap (the rewrite is a higher-order op in the capture)
    indexing = getattr(masking, "TransformGetItemToIndex", None)
    masking._vmap_for_bhqkv = broadcast_for_bhqkv  # type: ignore[attr-defined]
    if indexing is not None:
        masking.TransformGetItemToIndex = contextlib.nullcontext  # type: ignore[attr-defined]
    try:
        yield
    finally:
        masking._vmap_for_bhqkv = original  # type: ignore[attr-defined]
        if indexing is not None:
            masking.TransformGetItemToIndex = indexing  # type: ignore[attr-defined]


def _transposed_linear(module: nn.Module) -> bool:
    """transformers' ``Conv1D`` (GPT-2 and its relatives): a linear layer with its weight stored ``[in, out]``."""
    cls = type(module)
    return cls.__name__ == "Conv1D" and cls.__module__.startswith("transformers.") and hasattr(module, "nf")


def _rewritten_linear(module: nn.Module) -> bool:
    """A subclass of ``nn.Linear`` in transformers with a forward of its own (Falcon's ``FalconLinear`` computes
    ``x @ weight.T + bias``): a capture sees its matrix product, not a linear layer."""
    cls = type(module)
    return (
        isinstance(module, nn.Linear)
        and cls is not nn.Linear
        and cls.__module__.startswith("transformers.")
        and cls.forward is not nn.Linear.forward
    )


def _same_function(module: nn.Module, linear: nn.Linear) -> bool:
    """Whether ``module`` computes what ``linear`` computes, on random inputs (float32 rounding apart)."""
    inputs = torch.randn(3, 5, linear.in_features, generator=torch.Generator().manual_seed(0))
    inputs = inputs.to(device=linear.weight.device, dtype=linear.weight.dtype)
    with torch.no_grad():
        expected, got = module(inputs), linear(inputs)
    return (
        isinstance(expected, torch.Tensor)
        and expected.shape == got.shape
        and torch.allclose(expected, got, rtol=1e-4, atol=1e-5 * float(got.abs().max().clamp(min=1)))
    )


def linear_layers(model: nn.Module) -> int:
    """Replace, in place, the linear layers transformers writes in forms a capture does not see as layers by the
    ``nn.Linear`` each is, and return how many were replaced: ``Conv1D`` (GPT-2: the weight stored ``[in, out]``,
    used by ``addmm``) with its weight transposed, and subclasses of ``nn.Linear`` with a forward of their own
    (Falcon's ``x @ weight.T + bias``) where that forward computes what ``nn.Linear`` computes on random inputs.

    Captured as they are, they are matrix products with a parameter, not layers: no weight quantizer and no integer
    layer on any backend (GPT-2's every projection stayed float, Falcon's eight of nine). As ``nn.Linear`` they are
    prepared like any linear layer. Called on prepare's own copy of the model; the user's model keeps its layers."""
    replaced = 0
    for name, module in list(model.named_modules()):
        transposed = _transposed_linear(module)
        if not (transposed or _rewritten_linear(module)):
            continue
        weight = module.weight.detach()
        weight = weight.t() if transposed else weight
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=module.bias is not None)
        linear.to(device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            linear.weight.copy_(weight)
            if module.bias is not None:
                linear.bias.copy_(module.bias.detach())
        linear.train(module.training)
        if not transposed and not _same_function(module, linear):
            continue  # a forward that computes something else: captured as it is
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, linear)
        replaced += 1
    return replaced
