"""compressed-tensors checkpoints: the folder transformers and vLLM load a quantized Hugging Face model from.

The folder holds ``config.json`` (the source model's configuration plus ``quantization_config`` with
``quant_method: compressed-tensors``) and ``model.safetensors``. Each quantized linear layer ``name`` stores,
in the ``pack-quantized`` format:

* ``name.weight_packed``: int32 words, the integers of each row densely packed, ``bits`` bits an element, element
  ``i`` at bit ``i * bits`` of the row's little-endian bit string (rows padded to whole groups of 32 elements);
  each integer ``q`` of the signed grid ``[-2**(bits-1), 2**(bits-1) - 1]`` is stored as ``q + 2**(bits-1)``;
* ``name.weight_scale``: ``[out, in / group]`` (strategy ``group``), ``[out, 1]`` (``channel``) or ``[1]``
  (``tensor``);
* ``name.weight_zero_point`` (asymmetric grids only): the signed zero points, packed the same way along the
  output channels;
* ``name.weight_shape``: the weight's ``[out, in]`` as int64.

A layer that quantizes its input too (W8A8, FP8) is stored unpacked: ``int-quantized`` holds ``name.weight`` as
int8 integers, ``float-quantized`` as FP8 E4M3 values (``cast(clamp(w / s, -448, 448))``), each with
``name.weight_scale`` per output channel (``[out, 1]``) or per tensor, and ``name.input_scale`` (``[1]``, and
``name.input_zero_point`` for an asymmetric grid): the static per-tensor scale the runtime quantizes the layer's input
with, ``clamp(round(x / s) + z, -2**(bits-1), 2**(bits-1) - 1)`` or FP8's cast. Only the inputs of linear layers are
held, and an int grid only whole (TensorRT's [-127, 127] is not the runtime's [-128, 127]); anything else is
refused with a warning.

The runtime computes ``weight = (q - z) * scale`` in the dtype of the scales. Scales are stored in the dtype of
the model's float weights, so that a float32 model's file computes the simulation's weights exactly; an
asymmetric grid of the simulation (``[0, 2**bits - 1]``) is the signed one shifted by ``2**(bits-1)``, zero points
alike, which leaves ``(q - z) * scale`` unchanged.

Layers the simulation leaves float keep their float weights and are listed in ``ignore``. A model that is not a
Hugging Face model (no configuration kept by ``prepare_by_platform``) has no such checkpoint, and nothing is
written; a quantization the format cannot hold (groups that do not divide a layer's input channels, a quantized
weight that is not a linear layer's, a Hadamard rotation that changed the architecture) is named in a warning and
nothing is written either: the ONNX artifacts still are.

transformers loads the folder with the compressed-tensors package installed; on a CPU, with
``quantization_config=CompressedTensorsConfig(dequantize=True)`` for weight-only layers (verification loads it so),
which also reads asymmetric zero points (transformers' packed layout does not take them in the packed shape vLLM
reads), and with the default ``CompressedTensorsConfig()`` for layers whose inputs are quantized (``dequantize=True``
would drop the input scales).

Example:
    >>> pack_bits(np.array([[1, 2, 3]], np.int64), 4).tolist()  # element i at bit 4 * i of the row
    [[801]]
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import shutil
import struct
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from mqbench.deploy.comparison import ArtifactReport, compare
from mqbench.deploy.writers.hf_checkpoint import Names, hf_checkpoint
from mqbench.qparams import TensorQParams
from mqbench.utils.hf_capture import INPUT_NAMES, REPLACED_LAYERS, SOURCE_CONFIG, attention_of

if TYPE_CHECKING:
    from mqbench.deploy.context import DeployContext

__all__ = [
    "FORMAT",
    "KEY",
    "SUFFIX",
    "format_of",
    "integer_levels",
    "loaded_by_consumer",
    "pack_bits",
    "quantization_config",
    "serve",
    "verify",
    "write",
    "write_safetensors",
]

KEY = "compressed_tensors"
SUFFIX = "_compressed_tensors"
FORMAT = "pack-quantized"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "generation_config.json",
)
_SAFETENSORS_DTYPES = {
    np.dtype(np.float32): "F32",
    np.dtype(np.float16): "F16",
    np.dtype(np.int32): "I32",
    np.dtype(np.int64): "I64",
    np.dtype(np.int8): "I8",
    np.dtype(np.uint8): "U8",
}


def integer_levels(entry: TensorQParams, weight: np.ndarray) -> np.ndarray:
    """The integers (int64, on the entry's grid) a quantized ``weight`` holds: ``clip(rint(w / s) + z)``, each
    element with its own group's, channel's or the tensor's scale and zero point."""
    values = np.asarray(weight, np.float64)
    scale: Any
    zero: Any
    if entry.group_size is not None:
        scale = entry.expanded(entry.scale.astype(np.float64), values.shape)
        zero = entry.expanded(entry.zero_point.astype(np.float64), values.shape)
    elif entry.axis is not None:
        shape = [1] * values.ndim
        shape[entry.axis] = -1
        scale, zero = entry.scale.astype(np.float64).reshape(shape), entry.zero_point.astype(np.float64).reshape(shape)
    else:
        scale, zero = float(entry.scale[0]), float(entry.zero_point[0])
    return np.clip(np.rint(values / scale) + zero, entry.quant_min, entry.quant_max).astype(np.int64)


def pack_bits(values: np.ndarray, bits: int) -> np.ndarray:
    """Rows of unsigned ``bits``-bit values (``[rows, cols]``) densely packed into int32 words: element ``i`` of a
    row at bit ``i * bits`` of its little-endian bit string, a row padded with zeros to a multiple of 32 elements,
    ``ceil(cols * bits / 32)`` words kept."""
    rows = np.asarray(values, np.uint64).reshape(values.shape[0], -1)
    cols = rows.shape[1]
    padded = -(-cols // 32) * 32
    if padded > cols:
        rows = np.concatenate([rows, np.zeros((rows.shape[0], padded - cols), np.uint64)], axis=1)
    chunks = rows.reshape(rows.shape[0], padded // 32, 32)  # 32 elements fill exactly `bits` words
    shifts = (np.arange(32, dtype=np.uint64) * np.uint64(bits))[None, None, :]
    words = np.zeros((rows.shape[0], padded // 32, bits), np.uint64)
    for word in range(bits):  # the part of each element that falls in this word of the chunk
        low = np.uint64(32 * word)
        placed = np.where(
            shifts >= low,
            chunks << np.clip(shifts - low, 0, 63).astype(np.uint64),
            chunks >> np.clip(low - shifts, 0, 63).astype(np.uint64),
        )
        words[:, :, word] = np.sum(placed & np.uint64(0xFFFFFFFF), axis=2) & np.uint64(0xFFFFFFFF)
    flat = words.reshape(rows.shape[0], -1)[:, : -(-cols * bits // 32)]
    return flat.astype(np.uint32).view(np.int32)


def _scheme(entry: TensorQParams, shape: tuple[int, ...]) -> tuple[dict[str, Any] | None, str]:
    """The compressed-tensors weight arguments that hold ``entry`` for a linear weight of ``shape``, or why not."""
    if len(shape) != 2:
        return None, f"a weight of shape {list(shape)} (the format holds linear layers' 2-D weights)"
    if entry.grid != "linear" or entry.extra.get("fp8"):
        return None, f"a {entry.grid} grid (pack-quantized holds integers)"
    bits = entry.bits
    signed = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    symmetric = bool(np.all(entry.zero_point == 0)) and entry.quant_min < 0
    if entry.quant_min < 0 and not (signed[0] <= entry.quant_min and entry.quant_max <= signed[1]):
        return None, f"the grid [{entry.quant_min}, {entry.quant_max}] (pack-quantized holds signed {bits}-bit ones)"
    if entry.quant_min >= 0 and (entry.quant_min, entry.quant_max) != (0, 2**bits - 1):
        return None, f"the grid [{entry.quant_min}, {entry.quant_max}] (an unsigned grid must be [0, {2**bits - 1}])"
    if not 1 <= bits <= 8:
        return None, f"{bits} bits (pack-quantized holds 1 to 8)"
    args: dict[str, Any] = {"num_bits": bits, "type": "int", "symmetric": symmetric, "dynamic": False}
    if entry.group_size is not None:
        size = entry.group_size
        if shape[1] % size:
            fits = sorted((g for g in (16, 32, 64, 128, 256) if shape[1] % g == 0), key=lambda g: (abs(g - size), g))
            return None, (
                f"groups of {size} over {shape[1]} input channels (the format needs whole groups"
                + (f"; {fits[0]} divides them)" if fits else ")")
            )
        args.update(strategy="group", group_size=size)
    elif entry.axis is not None:
        if entry.axis != 0:
            return None, f"scales along axis {entry.axis} (the format holds one per output channel)"
        args.update(strategy="channel")
    else:
        args.update(strategy="tensor")
    return args, ""


def _compressed(
    name: str, entry: TensorQParams, weight: np.ndarray, args: Mapping[str, Any], dtype: np.dtype
) -> dict[str, np.ndarray]:
    """The tensors of one quantized linear layer ``name`` (its module path)."""
    bits = int(args["num_bits"])
    offset = 2 ** (bits - 1)
    levels = integer_levels(entry, weight)
    shift = offset if entry.quant_min >= 0 else 0  # an unsigned grid is the signed one shifted
    out, _ = weight.shape
    scale: np.ndarray
    zero: np.ndarray
    if args["strategy"] == "group":
        scale = entry.blocked(entry.scale, weight.shape).reshape(out, -1)
        zero = entry.blocked(entry.zero_point.astype(np.int64), weight.shape).reshape(out, -1)
    elif args["strategy"] == "channel":
        scale, zero = entry.scale.reshape(out, 1), entry.zero_point.astype(np.int64).reshape(out, 1)
    else:
        scale, zero = entry.scale.reshape(1), entry.zero_point.astype(np.int64).reshape(1)
    tensors = {
        f"{name}.weight_packed": pack_bits(levels - shift + offset, bits),
        f"{name}.weight_scale": np.asarray(scale, dtype),
        f"{name}.weight_shape": np.asarray(weight.shape, np.int64),
    }
    if not args["symmetric"]:
        signed_zero = zero - shift
        if args["strategy"] == "tensor":
            tensors[f"{name}.weight_zero_point"] = signed_zero.astype(np.int8)
        else:  # packed along the output channels
            tensors[f"{name}.weight_zero_point"] = np.ascontiguousarray(pack_bits((signed_zero + offset).T, bits).T)
    return tensors


def quantization_config(groups: list[tuple[dict[str, Any], list[str]]], ignore: list[str]) -> dict[str, Any]:
    """``config.json``'s ``quantization_config``: one group per distinct scheme (``weights`` and
    ``input_activations``), each targeting its layers by name (``Linear`` where one scheme covers every quantized
    linear layer); the format follows from the schemes (:func:`format_of`)."""
    config_groups = {
        f"group_{i}": {
            "targets": targets,
            "weights": group["weights"],
            "input_activations": group.get("input_activations"),
            "output_activations": None,
        }
        for i, (group, targets) in enumerate(groups)
    }
    return {
        "quant_method": "compressed-tensors",
        "format": format_of([group for group, _ in groups]),
        "quantization_status": "compressed",
        "config_groups": config_groups,
        "ignore": ignore,
    }


def format_of(groups: list[dict[str, Any]]) -> str:
    """The compressed-tensors format of a folder's schemes: ``pack-quantized`` for weight-only integers,
    ``int-quantized`` for integer weights and inputs, ``float-quantized`` for FP8 weights and inputs."""
    kinds = {(g["weights"]["type"], g.get("input_activations") is not None) for g in groups}
    if kinds == {("int", False)}:
        return FORMAT
    if kinds == {("int", True)}:
        return "int-quantized"
    if kinds == {("float", True)}:
        return "float-quantized"
    raise ValueError(f"one folder holds one format; these schemes need several: {sorted(kinds)}")


def write_safetensors(path: Path, tensors: Mapping[str, Any], metadata: Mapping[str, str]) -> Path:
    """A safetensors file: an 8-byte little-endian header length, the JSON header (dtype, shape, byte offsets per
    tensor), then the tensors' bytes in order. Values are numpy arrays, or torch FP8 E4M3 tensors."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    arrays = []
    for name, value in tensors.items():
        if isinstance(value, torch.Tensor) and value.dtype == torch.float8_e4m3fn:
            dtype, array = "F8_E4M3", np.ascontiguousarray(value.contiguous().view(torch.uint8).numpy())
        else:
            array = np.ascontiguousarray(value)
            if array.dtype not in _SAFETENSORS_DTYPES:
                raise ValueError(f"{name}: dtype {array.dtype} is not written")
            dtype = _SAFETENSORS_DTYPES[array.dtype]
        header[name] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
        arrays.append(array)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as file:
        file.write(struct.pack("<Q", len(text)))
        file.write(text)
        for array in arrays:
            file.write(array.tobytes())
    return path


def _float_dtype(module: nn.Module) -> np.dtype:
    floats = {p.dtype for p in module.parameters() if p.is_floating_point()}
    return np.dtype(np.float16) if floats == {torch.float16} else np.dtype(np.float32)


def _copy_tokenizer(config: Mapping[str, Any], folder: Path) -> list[str]:
    """The tokenizer files of the folder the source model was loaded from, copied into ``folder``."""
    source = config.get("_name_or_path") or ""
    where = Path(source).expanduser() if source else None
    if where is None or not where.is_dir():
        return []
    copied = []
    for name in TOKENIZER_FILES:
        if (where / name).is_file():
            shutil.copyfile(where / name, folder / name)
            copied.append(name)
    return copied


def _input_schemes(
    module: nn.Module, table: Any
) -> tuple[dict[str, tuple[dict[str, Any], TensorQParams]], list[tuple[str, str]]]:
    """Per linear layer whose input the simulation quantizes: the compressed-tensors input arguments and the
    entry; and what the format cannot hold, as (tensor, why): an activation quantizer read by anything but a
    linear layer's input, a grid the format does not have."""
    modules = dict(module.named_modules())
    calls: dict[str, list[torch.fx.Node]] = {}
    if isinstance(module, torch.fx.GraphModule):
        for node in module.graph.nodes:
            if node.op == "call_module":
                calls.setdefault(str(node.target), []).append(node)
    inputs: dict[str, tuple[dict[str, Any], TensorQParams]] = {}
    refused = []
    for tensor, entry in table.items():
        if entry.kind == "weight":
            continue
        args, why = _activation_scheme(entry)
        if args is not None:
            why = ""
        readers = [(call, user) for call in calls.get(entry.quantizer, []) for user in call.users]
        others = [
            user.name
            for call, user in readers
            if user.op != "call_module"
            or not isinstance(modules.get(str(user.target)), nn.Linear)
            or user.args[0] is not call
        ]
        if others or not readers:
            where = f"a quantizer read by {others[0]}" if others else "a quantizer the graph does not show"
            why = f"{where} (the format quantizes the inputs of linear layers only)"
        if why:
            refused.append((tensor, why))
        elif args is not None:
            inputs.update((str(user.target), (args, entry)) for _, user in readers)
    return inputs, refused


def _activation_scheme(entry: TensorQParams) -> tuple[dict[str, Any] | None, str]:
    """The compressed-tensors ``input_activations`` that hold a per-tensor activation quantizer, or why not."""
    if entry.axis is not None or entry.group_size is not None:
        return None, "an activation scale per channel (the format's static input scales are per tensor)"
    if entry.grid == "fp8_e4m3":
        return {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor", "dynamic": False}, ""
    if entry.grid != "linear":
        return None, f"a {entry.grid} grid (the format holds integers and FP8 E4M3)"
    bits = entry.bits
    symmetric = bool(np.all(entry.zero_point == 0)) and entry.quant_min < 0
    if entry.quant_min < 0 and (entry.quant_min, entry.quant_max) != (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1):
        return None, (
            f"inputs on the grid [{entry.quant_min}, {entry.quant_max}] (the runtime rounds inputs onto "
            f"[{-(2 ** (bits - 1))}, {2 ** (bits - 1) - 1}], which differs where an input passes the calibrated "
            "range; prepare with extra_qconfig_dict {'a_qscheme': {'symmetric_range': False}} for this checkpoint)"
        )
    if entry.quant_min >= 0 and (entry.quant_min, entry.quant_max) != (0, 2**bits - 1):
        return None, f"the grid [{entry.quant_min}, {entry.quant_max}] (an unsigned grid must be [0, {2**bits - 1}])"
    return {"num_bits": bits, "type": "int", "symmetric": symmetric, "strategy": "tensor", "dynamic": False}, ""


def _fp8_scheme(entry: TensorQParams, shape: tuple[int, ...]) -> tuple[dict[str, Any] | None, str]:
    """The compressed-tensors weight arguments of an FP8 E4M3 weight, or why not."""
    if len(shape) != 2:
        return None, f"a weight of shape {list(shape)} (the format holds linear layers' 2-D weights)"
    if entry.grid != "fp8_e4m3":
        return None, f"a {entry.grid} grid (float-quantized holds FP8 E4M3)"
    if entry.group_size is not None or entry.axis not in (None, 0):
        return None, "FP8 scales other than per output channel or per tensor"
    strategy = "tensor" if entry.axis is None else "channel"
    return {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy, "dynamic": False}, ""


def _scale_shape(args: Mapping[str, Any], out: int) -> tuple[int, ...]:
    return (out, 1) if args["strategy"] == "channel" else (1,)


def _unpacked(name: str, entry: TensorQParams, weight: np.ndarray, args: Mapping[str, Any], dtype: np.dtype) -> dict:
    """The tensors of one layer in ``int-quantized`` (int8 integers) or ``float-quantized`` (FP8 E4M3 values)."""
    out = weight.shape[0]
    scale = np.asarray(entry.scale.reshape(_scale_shape(args, out)), dtype)
    tensors: dict[str, Any] = {f"{name}.weight_scale": scale}
    if args["type"] == "float":
        fp8 = torch.clamp(torch.from_numpy(weight) / torch.from_numpy(scale.astype(np.float32)), -448.0, 448.0)
        tensors[f"{name}.weight"] = fp8.to(torch.float8_e4m3fn)
        return tensors
    shift = 2 ** (entry.bits - 1) if entry.quant_min >= 0 else 0  # an unsigned grid is the signed one shifted
    tensors[f"{name}.weight"] = (integer_levels(entry, weight) - shift).astype(np.int8)
    if not args["symmetric"]:
        zero = entry.zero_point.astype(np.int64).reshape(_scale_shape(args, out)) - shift
        tensors[f"{name}.weight_zero_point"] = zero.astype(np.int8)
    return tensors


def _input_tensors(name: str, entry: TensorQParams, args: Mapping[str, Any], dtype: np.dtype) -> dict:
    tensors: dict[str, Any] = {f"{name}.input_scale": np.asarray(entry.scale.reshape(1), dtype)}
    if not args["symmetric"]:
        shift = 2 ** (entry.bits - 1) if entry.quant_min >= 0 else 0
        tensors[f"{name}.input_zero_point"] = (entry.zero_point.astype(np.int64).reshape(1) - shift).astype(np.int8)
    return tensors


def _reasons(refused: list[tuple[str, str]]) -> str:
    """What the format cannot hold, one clause per reason, naming the first tensors of each."""
    by_reason: dict[str, list[str]] = {}
    for tensor, why in refused:
        by_reason.setdefault(why, []).append(tensor)
    clauses = [
        f"{why}: {', '.join(tensors[:3])}{f' and {len(tensors) - 3} more' if len(tensors) > 3 else ''}"
        for why, tensors in by_reason.items()
    ]
    return "; ".join(clauses)


def write(context: DeployContext) -> Path | None:
    """``{model_name}_compressed_tensors/``: ``config.json`` and ``model.safetensors`` (see the module docstring);
    None (nothing written) for a model that is not a Hugging Face model or a quantization the format cannot hold."""
    checkpoint = hf_checkpoint(context, KEY)
    if checkpoint is None:
        return None
    module, source = checkpoint.module, checkpoint.config
    if source.get(REPLACED_LAYERS):
        warnings.warn(
            f"{KEY}: not written, {source[REPLACED_LAYERS]} of the model's layers are not nn.Linear in its "
            "architecture (GPT-2's Conv1D stores its weight [in, out]), and the format quantizes Linear layers; the "
            "ONNX artifacts hold them",
            stacklevel=3,
        )
        return None
    params = checkpoint.weights
    dtype = _float_dtype(module)
    inputs, refused = _input_schemes(module, context.table)
    compressed: dict[str, Any] = {}
    schemes: dict[str, tuple[dict[str, Any], list[str]]] = {}
    quantized: set[str] = set()
    for tensor, entry in context.table.items():
        if entry.kind != "weight":
            continue
        owner, _, leaf = tensor.rpartition(".")
        parameter = params.get(tensor)
        linear = isinstance(module.get_submodule(owner), nn.Linear) if parameter is not None and owner else False
        if parameter is None or leaf != "weight" or not linear:
            refused.append((tensor, "not the weight of a linear layer of the model"))
            continue
        weight = parameter.float().numpy()
        fp8 = entry.grid == "fp8_e4m3"
        args, why = _fp8_scheme(entry, weight.shape) if fp8 else _scheme(entry, weight.shape)
        if args is None:
            refused.append((tensor, why))
            continue
        activations = inputs.get(owner)
        if inputs and activations is None:
            refused.append((tensor, "its layer's input is float while other layers' inputs are quantized"))
            continue
        if activations is not None and activations[0]["type"] != args["type"]:
            refused.append((tensor, f"{args['type']} weights with {activations[0]['type']} inputs"))
            continue
        if activations is None and fp8:
            refused.append((tensor, "FP8 weights with float inputs (the format's FP8 layers quantize inputs)"))
            continue
        if activations is None:
            compressed.update(_compressed(owner, entry, weight, args, dtype))
        else:
            if args.get("strategy") == "group":
                refused.append((tensor, "groups with quantized inputs (int-quantized holds channels or tensors)"))
                continue
            compressed.update(_unpacked(owner, entry, weight, args, dtype))
            compressed.update(_input_tensors(owner, activations[1], activations[0], dtype))
        group = {"weights": args, "input_activations": activations[0] if activations else None}
        schemes.setdefault(json.dumps(group, sort_keys=True), (group, []))[1].append(owner)
        quantized.add(tensor)
    if refused or not quantized:
        if refused:
            warnings.warn(f"{KEY}: not written, the format cannot hold {_reasons(refused)}", stacklevel=3)
        return None
    names = checkpoint.names
    linears = [name for name, m in module.named_modules() if isinstance(m, nn.Linear)]
    ignore = [names.layer(name) for name in linears if f"{name}.weight" not in quantized]
    groups = [(group, [names.layer(owner) for owner in owners]) for group, owners in schemes.values()]
    if len(groups) == 1:
        groups = [(groups[0][0], ["Linear"])]
    try:
        format_of([group for group, _ in groups])
    except ValueError as error:
        warnings.warn(f"{KEY}: not written, {error}", stacklevel=3)
        return None
    config = {key: value for key, value in source.items() if key != "_name_or_path" and not key.startswith("mqbench_")}
    tied = bool(config.get("tie_word_embeddings", False))
    tensors: dict[str, Any] = {}
    seen: dict[int, str] = {}
    for name, parameter in params.items():
        if name in quantized:
            continue
        key = module.get_parameter(name).data_ptr()
        if key in seen and tied:  # a tied output layer is the embedding: the runtime ties it again
            continue
        seen.setdefault(key, name)
        tensors[name] = parameter.numpy().astype(dtype, copy=False)
    if tied and any(f"{name}.weight" in quantized for name in linears if names.layer(name).endswith("lm_head")):
        config["tie_word_embeddings"] = False  # a quantized output layer is no longer the float embedding
    tensors.update(compressed)
    tensors = {names.rename(key): value for key, value in tensors.items()}
    folder = context.folder / f"{context.model_name}{SUFFIX}"
    folder.mkdir()
    config["quantization_config"] = quantization_config(groups, ignore)
    config["dtype"] = "float16" if dtype == np.float16 else "float32"
    config.pop("torch_dtype", None)
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    write_safetensors(folder / "model.safetensors", tensors, {"format": "pt"})
    _copy_tokenizer(source, folder)
    return folder


def _dequantizing(config_class: Any, activations: bool = False) -> Any:
    """transformers' compressed-tensors option that computes a folder on a CPU: for weight-only layers, every weight
    decompressed at load (``dequantize=True`` in 5.x, ``run_compressed=False`` in 4.x); for layers that quantize
    their inputs too, the quantized model compressed-tensors builds (``dequantize=False`` in 5.x, ``dequantize=True``
    would load a float model that drops the input scales), which quantizes each input with its stored scale."""
    if "dequantize" in inspect.signature(config_class.__init__).parameters:
        return config_class(dequantize=not activations)
    return config_class(run_compressed=False)


def _load(folder: str, attention: str | None = None) -> nn.Module:
    """The folder as transformers loads it with compressed-tensors on a CPU: its architecture's class, float32,
    ``attention`` as the simulation computed it (None: transformers' default), with the option of
    :func:`_dequantizing`."""
    import transformers

    config = json.loads((Path(folder) / "config.json").read_text())
    architecture = getattr(transformers, config["architectures"][0])
    activations = config.get("quantization_config", {}).get("format") != FORMAT
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, info = architecture.from_pretrained(
            folder,
            output_loading_info=True,
            dtype=torch.float32,
            quantization_config=_dequantizing(transformers.CompressedTensorsConfig, activations),
            **({} if attention is None else {"attn_implementation": attention}),
        )
    problems = {key: list(info.get(key) or ()) for key in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    problems = {key: values[:4] for key, values in problems.items() if values}
    if problems:
        raise ValueError(f"{KEY}: transformers did not load {folder} whole: {problems}")
    return model.eval()


def _logits(model: nn.Module, feeds: Mapping[str, np.ndarray], names: Names | None = None) -> np.ndarray:
    """``model``'s logits on the deployment's inputs (those its forward takes, by the architecture's name)."""
    accepted = set(inspect.signature(model.forward).parameters)
    arguments = (names or Names({})).arguments(feeds)
    call = {name: torch.from_numpy(np.asarray(value)) for name, value in arguments.items() if name in accepted}
    with torch.no_grad():
        outputs = model(**call, use_cache=False)
    logits = outputs.logits if hasattr(outputs, "logits") else outputs[0]
    return logits.detach().numpy()


def serve(result: Any) -> Callable[[Mapping[str, np.ndarray]], list[np.ndarray]]:
    """The folder as transformers serves it on a CPU: its logits."""
    model = _load(result.artifacts[KEY])
    names = Names({INPUT_NAMES: ["input_ids"] if len(result.input_names) == 1 else []})  # one input: token ids
    return lambda feeds: [_logits(model, feeds, names)]


def loaded_by_consumer(load: Callable[[], nn.Module], report: ArtifactReport, what: str) -> nn.Module | None:
    """``load()``, or None with the reason in ``report.missing`` where the consumer does not load ``what`` (its
    verdict: a failed verification saying what it said)."""
    try:
        return load()
    except Exception as error:
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        report.missing = [f"transformers did not load {what} ({type(error).__name__}: {first})"]
        return None


def verify(result: Any, feeds: Mapping[str, np.ndarray], run: Any) -> ArtifactReport:
    """The folder loaded by transformers with compressed-tensors (decompressed on the CPU): each quantized weight
    against the simulation's, and the logits against the simulation's outputs on the same inputs."""
    folder = result.artifacts[KEY]
    report = ArtifactReport(KEY, "transformers compressed-tensors")
    missing = [name for name in ("transformers", "compressed_tensors") if importlib.util.find_spec(name) is None]
    if missing:
        report.missing = [f"not loaded: {' and '.join(missing)} not installed (pip install compressed-tensors)"]
        return report
    model = loaded_by_consumer(lambda: _load(folder, attention_of(run.model)), report, "the folder")
    if model is None:
        return report
    names = Names(getattr(run.model, SOURCE_CONFIG, None) or {})
    values: dict[str, np.ndarray] = {}
    if result.output_names:  # first: compressed-tensors decompresses an activation-quantized model as it runs
        values[result.output_names[0]] = _logits(model, feeds, names)
    weights = {name: weight for name, weight in model.named_parameters()}
    exposed = {t: result.dequantized[t] for t in result.table if names.rename(t) in weights and t in result.dequantized}
    values.update({name: weights[names.rename(t)].detach().float().numpy() for t, name in exposed.items()})
    return compare(report, values, result.table, exposed, run, result.output_names[:1])
