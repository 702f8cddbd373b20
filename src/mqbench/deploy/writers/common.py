"""Helpers shared by the parameter-file writers and readers: float32 values, JSON, the float model's weights.

Every writer stores float32 quantities as the Python float of the float32 value, which JSON
and ``repr`` print with the shortest digits that read back to the same float32 bits:

    >>> import numpy as np
    >>> from mqbench.deploy.writers.common import f32
    >>> value = f32(np.float32(0.1))
    >>> value, bool(np.float32(float(repr(value))) == np.float32(0.1))
    (0.10000000149011612, True)
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx

from mqbench.backends.spec import BackendSpec
from mqbench.qparams import QParamTable, TensorQParams
from mqbench.scheme import QuantScheme

if TYPE_CHECKING:
    from mqbench.deploy.context import DeployContext

__all__ = [
    "ModelTensors",
    "as_values",
    "f32",
    "get_float",
    "get_int",
    "get_scalar",
    "get_scalar_int",
    "get_section",
    "load_json",
    "make_entry",
    "scheme_for",
    "write_json",
]


def f32(value: Any) -> float:
    """The Python float of ``value`` rounded to float32 (prints and parses back to the same float32)."""
    return float(np.float32(value))


def as_values(array: np.ndarray, per_channel: bool) -> float | list[float]:
    """One float (per tensor) or a list of floats (per channel), each a float32 value."""
    values = [f32(v) for v in np.asarray(array, dtype=np.float32).reshape(-1)]
    return values if per_channel else values[0]


def _dumps(value: Any, depth: int) -> str:
    """JSON with objects indented two spaces per level and lists on one line."""
    if isinstance(value, Mapping) and value:
        pad = "  " * (depth + 1)
        items = [f"{pad}{json.dumps(str(k))}: {_dumps(v, depth + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + "  " * depth + "}"
    return json.dumps(value, allow_nan=False, separators=(", ", ": "))


def write_json(path: Path, data: Mapping[str, Any]) -> Path:
    """Write ``data`` as JSON (objects indented, lists on one line); non-finite floats are refused."""
    try:
        text = _dumps(data, 0)
    except ValueError as error:
        raise ValueError(f"{path}: cannot write a non-finite number as JSON ({error})") from None
    path.write_text(text + "\n", encoding="utf-8")
    return path


def load_json(path: str | Path) -> dict[str, Any]:
    """The JSON object in ``path``; ValueError naming the file when it is unreadable or not an object."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"{path}: cannot read the parameter file ({error})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object at the top level, got {type(data).__name__}")
    return data


def get_section(data: Mapping[str, Any], key: str, path: str | Path) -> dict[str, Any]:
    """``data[key]``, which must be a JSON object."""
    if key not in data:
        raise ValueError(f"{path}: missing the {key!r} section")
    section = data[key]
    if not isinstance(section, dict):
        raise ValueError(f"{path}: {key!r} must be a JSON object, got {type(section).__name__}")
    return section


def _number(value: Any, what: str, path: str | Path) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{path}: {what} must be a finite number, got {value!r}")
    return float(value)


def get_float(entry: Mapping[str, Any], key: str, tensor: str, path: str | Path) -> float | list[float]:
    """A number or a non-empty list of numbers under ``key`` of a tensor's entry."""
    if not isinstance(entry, Mapping) or key not in entry:
        raise ValueError(f"{path}: the entry of tensor {tensor!r} has no {key!r}")
    value = entry[key]
    if isinstance(value, list):
        if not value:
            raise ValueError(f"{path}: {key!r} of tensor {tensor!r} is an empty list")
        return [_number(v, f"{key!r} of tensor {tensor!r}", path) for v in value]
    return _number(value, f"{key!r} of tensor {tensor!r}", path)


def get_scalar(entry: Mapping[str, Any], key: str, tensor: str, path: str | Path) -> float:
    """A single number under ``key`` of a tensor's entry."""
    value = get_float(entry, key, tensor, path)
    if isinstance(value, list):
        raise ValueError(f"{path}: {key!r} of tensor {tensor!r} must be one number, got a list")
    return value


def get_scalar_int(entry: Mapping[str, Any], key: str, tensor: str, path: str | Path) -> int:
    """A single integer under ``key`` of a tensor's entry."""
    value = get_int(entry, key, tensor, path)
    if isinstance(value, list):
        raise ValueError(f"{path}: {key!r} of tensor {tensor!r} must be one integer, got a list")
    return value


def get_int(entry: Mapping[str, Any], key: str, tensor: str, path: str | Path) -> int | list[int]:
    """An integer or a non-empty list of integers under ``key`` of a tensor's entry."""
    value = get_float(entry, key, tensor, path)
    values = value if isinstance(value, list) else [value]
    if any(v != round(v) for v in values):
        raise ValueError(f"{path}: {key!r} of tensor {tensor!r} must be integers, got {entry[key]!r}")
    if isinstance(value, list):
        return [round(v) for v in value]
    return round(value)


def scheme_for(spec: BackendSpec, kind: str, path: str | Path) -> QuantScheme:
    """The backend's default scheme for ``kind`` ("weight" or "activation")."""
    quantizer = spec.weight if kind == "weight" else spec.activation
    if quantizer is None:
        raise ValueError(
            f"{path}: backend {spec.name!r} has no default {kind} scheme, and the file does not give the integer range"
        )
    return quantizer.scheme


def linear_values(entry: TensorQParams, format_name: str, scale_key: str) -> dict[str, Any]:
    """Scale (under ``scale_key``), zero point and float ``min``/``max`` of a linear entry; lists per channel."""
    if entry.grid != "linear":
        raise ValueError(f"{format_name} parameters describe linear grids, not the {entry.grid!r} grid")
    per_channel = entry.per_channel
    low, high = entry.float_range()
    return {
        scale_key: as_values(entry.scale, per_channel),
        "zero_point": entry.zero_point.tolist() if per_channel else int(entry.zero_point[0]),
        "min": as_values(np.asarray(low), per_channel),
        "max": as_values(np.asarray(high), per_channel),
    }


def write_by_kind(context: DeployContext, suffix: str, describe: Callable[[TensorQParams], dict[str, Any]]) -> Path:
    """Write ``{"activation": {tensor: describe(entry)}, "weight": {...}}`` to ``context.path(suffix)``."""
    data: dict[str, dict[str, Any]] = {"activation": {}, "weight": {}}
    for tensor, entry in context.table.items():
        try:
            data[entry.kind][tensor] = describe(entry)
        except ValueError as error:
            raise ValueError(f"tensor {tensor!r}: {error}") from None
    return write_json(context.path(suffix), data)


EntryReader = Callable[[str, Any, str, "ModelTensors", "str | Path"], TensorQParams]


def read_by_kind(path: str | Path, float_model: onnx.ModelProto, read_entry: EntryReader) -> QParamTable:
    """The table of a file written by :func:`write_by_kind`, one ``read_entry(tensor, values, kind, ...)`` each."""
    data = load_json(path)
    model = ModelTensors(float_model)
    entries: dict[str, TensorQParams] = {}
    for kind in ("activation", "weight"):
        for tensor, values in get_section(data, kind, path).items():
            if tensor in entries:
                raise ValueError(f"{path}: tensor {tensor!r} is both an activation and a weight")
            entries[tensor] = read_entry(tensor, values, kind, model, path)
    return QParamTable(entries)


def make_entry(tensor: str, path: str | Path, **fields: Any) -> TensorQParams:
    """A :class:`TensorQParams`, with the file and tensor named when the values are not valid."""
    try:
        return TensorQParams(**fields)
    except ValueError as error:
        raise ValueError(f"{path}: tensor {tensor!r}: {error}") from None


class ModelTensors:
    """What a reader needs from the float ONNX model: which tensors are weights, and their channel axis."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.dims = {init.name: list(init.dims) for init in model.graph.initializer}
        # A ConvTranspose weight is [C_in, C_out / group, ...]: its output channels are axis 1.
        self.transposed = {
            node.input[1] for node in model.graph.node if node.op_type == "ConvTranspose" and len(node.input) > 1
        }

    def kind(self, tensor: str) -> str:
        """ "weight" for an initializer of the float model, else "activation"."""
        return "weight" if tensor in self.dims else "activation"

    def channel_axis(self, tensor: str, channels: int, path: str | Path) -> int:
        """The axis of per-channel values of a weight (1 for ConvTranspose, else 0), checked against its shape."""
        if tensor not in self.dims:
            raise ValueError(
                f"{path}: tensor {tensor!r} has {channels} per-channel values but is no weight of the model, "
                "and the file gives no channel axis"
            )
        axis = 1 if tensor in self.transposed else 0
        self.check_channels(tensor, axis, channels, path)
        return axis

    def check_channels(self, tensor: str, axis: int, channels: int, path: str | Path) -> None:
        """ValueError when a weight's dimension ``axis`` does not have ``channels`` entries."""
        dims = self.dims.get(tensor)
        if dims is None:
            return
        if not -len(dims) <= axis < len(dims) or dims[axis] != channels:
            raise ValueError(
                f"{path}: tensor {tensor!r} has {channels} per-channel values along axis {axis}, "
                f"but its shape is {dims}"
            )
