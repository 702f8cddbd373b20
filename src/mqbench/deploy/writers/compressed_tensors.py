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
``quantization_config=CompressedTensorsConfig(dequantize=True)`` (verification loads it so), which also reads
asymmetric zero points (transformers' packed layout does not take them in the packed shape vLLM reads).

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
from mqbench.qparams import TensorQParams
from mqbench.utils.hf_capture import REPLACED_LAYERS, SOURCE_CONFIG

if TYPE_CHECKING:
    from mqbench.deploy.context import DeployContext

__all__ = [
    "FORMAT",
    "KEY",
    "SUFFIX",
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
    """``config.json``'s ``quantization_config``: one group per distinct weight scheme, each targeting its layers
    by name (``Linear`` where one scheme covers every quantized linear layer)."""
    config_groups = {
        f"group_{i}": {"targets": targets, "weights": args, "input_activations": None, "output_activations": None}
        for i, (args, targets) in enumerate(groups)
    }
    return {
        "quant_method": "compressed-tensors",
        "format": FORMAT,
        "quantization_status": "compressed",
        "config_groups": config_groups,
        "ignore": ignore,
    }


def write_safetensors(path: Path, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str]) -> Path:
    """A safetensors file: an 8-byte little-endian header length, the JSON header (dtype, shape, byte offsets per
    tensor), then the tensors' bytes in order."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    arrays = []
    for name, value in tensors.items():
        array = np.ascontiguousarray(value)
        if array.dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(f"{name}: dtype {array.dtype} is not written")
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[array.dtype],
            "shape": list(array.shape),
            "data_offsets": [offset, offset + array.nbytes],
        }
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


def write(context: DeployContext) -> Path | None:
    """``{model_name}_compressed_tensors/``: ``config.json`` and ``model.safetensors`` (see the module docstring);
    None (nothing written) for a model that is not a Hugging Face model or a quantization the format cannot hold."""
    module = context.module
    source = getattr(module, SOURCE_CONFIG, None) if module is not None else None
    if module is None or not isinstance(source, Mapping):
        return None
    rotation = module.meta.get("rotation") if isinstance(module, torch.fx.GraphModule) else None
    if rotation and (rotation.get("online") or rotation.get("streams")):
        changed = [*rotation.get("online", ()), *(n for s in rotation.get("streams", ()) for n in s["norms"])]
        warnings.warn(
            f"{KEY}: not written, the Hadamard rotation changed the architecture ({len(changed)} layer(s): inputs "
            f"rotated online, norms without their gains, e.g. {', '.join(changed[:3])}), which a "
            f"{source.get('architectures', ['Hugging Face'])[0]} checkpoint cannot compute; the ONNX artifacts hold it",
            stacklevel=3,
        )
        return None
    if source.get(REPLACED_LAYERS):
        warnings.warn(
            f"{KEY}: not written, {source[REPLACED_LAYERS]} of the model's layers are not nn.Linear in its "
            "architecture (GPT-2's Conv1D stores its weight [in, out]), and the format quantizes Linear layers; the "
            "ONNX artifacts hold them",
            stacklevel=3,
        )
        return None
    params = dict(module.named_parameters(remove_duplicate=False))
    dtype = _float_dtype(module)
    compressed: dict[str, np.ndarray] = {}
    schemes: dict[str, tuple[dict[str, Any], list[str]]] = {}
    refused: list[str] = []
    quantized: set[str] = set()
    for tensor, entry in context.table.items():
        if entry.kind != "weight":
            refused.append(f"{tensor}: activations are quantized (this format holds weight-only layers)")
            continue
        owner, _, leaf = tensor.rpartition(".")
        parameter = params.get(tensor)
        linear = isinstance(module.get_submodule(owner), nn.Linear) if parameter is not None and owner else False
        if parameter is None or leaf != "weight" or not linear:
            refused.append(f"{tensor}: not the weight of a linear layer of the model")
            continue
        weight = parameter.detach().float().numpy()
        args, why = _scheme(entry, weight.shape)
        if args is None:
            refused.append(f"{tensor}: {why}")
            continue
        compressed.update(_compressed(owner, entry, weight, args, dtype))
        schemes.setdefault(json.dumps(args, sort_keys=True), (args, []))[1].append(owner)
        quantized.add(tensor)
    if refused or not quantized:
        if refused:
            shown = "; ".join(refused[:4]) + (f"; and {len(refused) - 4} more" if len(refused) > 4 else "")
            warnings.warn(f"{KEY}: not written, the format cannot hold the quantization of {shown}", stacklevel=3)
        return None
    linears = [name for name, m in module.named_modules() if isinstance(m, nn.Linear)]
    ignore = [name for name in linears if f"{name}.weight" not in quantized]
    groups = list(schemes.values())
    if len(groups) == 1:
        groups = [(groups[0][0], ["Linear"])]
    config = {key: value for key, value in source.items() if key != "_name_or_path" and not key.startswith("mqbench_")}
    tied = bool(config.get("tie_word_embeddings", False))
    tensors: dict[str, np.ndarray] = {}
    seen: dict[int, str] = {}
    for name, parameter in params.items():
        if name in quantized or ".weight_fake_quant." in name or "_fake_quantizer." in name:
            continue
        key = parameter.data_ptr()
        if key in seen and tied:  # a tied output layer is the embedding: the runtime ties it again
            continue
        seen.setdefault(key, name)
        tensors[name] = parameter.detach().numpy().astype(dtype, copy=False)
    if tied and any(f"{name}.weight" in quantized for name in linears if name.endswith("lm_head")):
        config["tie_word_embeddings"] = False  # a quantized output layer is no longer the float embedding
    tensors.update(compressed)
    folder = context.folder / f"{context.model_name}{SUFFIX}"
    folder.mkdir()
    config["quantization_config"] = quantization_config(groups, ignore)
    config["dtype"] = "float16" if dtype == np.float16 else "float32"
    config.pop("torch_dtype", None)
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    write_safetensors(folder / "model.safetensors", tensors, {"format": "pt"})
    _copy_tokenizer(source, folder)
    return folder


def _dequantizing(config_class: Any) -> Any:
    """transformers' compressed-tensors option that decompresses every weight at load: ``dequantize=True`` (5.x),
    ``run_compressed=False`` (4.x)."""
    if "dequantize" in inspect.signature(config_class.__init__).parameters:
        return config_class(dequantize=True)
    return config_class(run_compressed=False)


def _load(folder: str) -> nn.Module:
    """The folder as transformers loads it with compressed-tensors on a CPU: its architecture's class, float32,
    eager attention, every packed weight decompressed at load (``CompressedTensorsConfig(dequantize=True)``)."""
    import transformers

    config = json.loads((Path(folder) / "config.json").read_text())
    architecture = getattr(transformers, config["architectures"][0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, info = architecture.from_pretrained(
            folder,
            output_loading_info=True,
            dtype=torch.float32,
            attn_implementation="eager",
            quantization_config=_dequantizing(transformers.CompressedTensorsConfig),
        )
    problems = {key: list(info.get(key) or ()) for key in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    problems = {key: values[:4] for key, values in problems.items() if values}
    if problems:
        raise ValueError(f"{KEY}: transformers did not load {folder} whole: {problems}")
    return model.eval()


def _logits(model: nn.Module, feeds: Mapping[str, np.ndarray]) -> np.ndarray:
    """``model``'s logits on the deployment's inputs (those its forward takes, by name)."""
    accepted = set(inspect.signature(model.forward).parameters)
    call = {name: torch.from_numpy(np.asarray(value)) for name, value in feeds.items() if name in accepted}
    with torch.no_grad():
        outputs = model(**call, use_cache=False)
    logits = outputs.logits if hasattr(outputs, "logits") else outputs[0]
    return logits.detach().numpy()


def serve(result: Any) -> Callable[[Mapping[str, np.ndarray]], list[np.ndarray]]:
    """The folder as transformers serves it on a CPU: its logits."""
    model = _load(result.artifacts[KEY])
    return lambda feeds: [_logits(model, feeds)]


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
    model = loaded_by_consumer(lambda: _load(folder), report, "the folder")
    if model is None:
        return report
    weights = dict(model.named_parameters())
    exposed = {t: result.dequantized[t] for t in result.table if t in weights and t in result.dequantized}
    values: dict[str, np.ndarray] = {name: weights[t].detach().numpy() for t, name in exposed.items()}
    if result.output_names:
        values[result.output_names[0]] = _logits(model, feeds)
    return compare(report, values, result.table, exposed, run, result.output_names[:1])
