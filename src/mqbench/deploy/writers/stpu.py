"""STPU quantization parameters (``{model_name}_stpu.json``): the full linear quantization of every tensor.

Layout::

    {"activation": {tensor: {"scale", "zero_point", "bits", "min", "max", "quant_min", "quant_max"}},
     "weight": {weight: {... the same, with lists for "scale", "zero_point", "min", "max"
                         and "axis" when per channel}}}

``min`` / ``max`` are the float images ``(quant_min - zero_point) * scale`` and
``(quant_max - zero_point) * scale`` of the integer range (float32 values, informative).
Reading back (:func:`read`) is exact: every quantity the table holds is in the file. The log
grid has no STPU form; writing it raises ValueError.

Example:
    >>> import numpy as np
    >>> from mqbench.deploy.table import TensorQParams
    >>> from mqbench.deploy.writers.stpu import stpu_entry
    >>> stpu_entry(TensorQParams(np.array([0.5]), np.array([0]), -127, 127))
    {'scale': 0.5, 'zero_point': 0, 'bits': 8, 'min': -63.5, 'max': 63.5, 'quant_min': -127, 'quant_max': 127}
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx

from mqbench.backends.spec import BackendSpec
from mqbench.deploy.table import QParamTable, TensorQParams
from mqbench.deploy.writers.common import (
    ModelTensors,
    as_values,
    get_float,
    get_int,
    get_scalar_int,
    get_section,
    load_json,
    make_entry,
    write_json,
)

if TYPE_CHECKING:
    from mqbench.convert_deploy import DeployContext

__all__ = ["SUFFIX", "read", "stpu_entry", "write"]

SUFFIX = "_stpu.json"


def stpu_entry(entry: TensorQParams) -> dict[str, Any]:
    """The STPU parameters of one entry (lists and ``axis`` per channel)."""
    if entry.grid != "linear":
        raise ValueError(f"STPU parameters describe linear grids, not the {entry.grid!r} grid")
    per_channel = entry.per_channel
    low, high = entry.float_range()
    values: dict[str, Any] = {
        "scale": as_values(entry.scale, per_channel),
        "zero_point": entry.zero_point.tolist() if per_channel else int(entry.zero_point[0]),
        "bits": entry.bits,
        "min": as_values(np.asarray(low), per_channel),
        "max": as_values(np.asarray(high), per_channel),
        "quant_min": entry.quant_min,
        "quant_max": entry.quant_max,
    }
    if per_channel:
        values["axis"] = entry.axis
    return values


def write(context: DeployContext) -> Path:
    """Write ``{model_name}_stpu.json`` (every table entry, by kind)."""
    data: dict[str, dict[str, Any]] = {"activation": {}, "weight": {}}
    for tensor, entry in context.table.items():
        try:
            data[entry.kind][tensor] = stpu_entry(entry)
        except ValueError as error:
            raise ValueError(f"tensor {tensor!r}: {error}") from None
    return write_json(context.path(SUFFIX), data)


def _entry(tensor: str, values: Any, kind: str, model: ModelTensors, path: str | Path) -> TensorQParams:
    if not isinstance(values, dict):
        raise ValueError(f"{path}: the parameters of tensor {tensor!r} must be a JSON object")
    scale = get_float(values, "scale", tensor, path)
    zero_point = get_int(values, "zero_point", tensor, path)
    per_channel = "axis" in values
    if isinstance(scale, list) != per_channel or isinstance(zero_point, list) != per_channel:
        raise ValueError(f"{path}: tensor {tensor!r} needs lists of scales and zero points exactly when it has an axis")
    axis = None
    if per_channel:
        axis = get_scalar_int(values, "axis", tensor, path)
        model.check_channels(tensor, axis, len(np.atleast_1d(scale)), path)
    quant_min = get_scalar_int(values, "quant_min", tensor, path)
    quant_max = get_scalar_int(values, "quant_max", tensor, path)
    result = make_entry(
        tensor,
        path,
        scale=np.asarray(scale, np.float32),
        zero_point=np.asarray(zero_point, np.int64),
        quant_min=quant_min,
        quant_max=quant_max,
        axis=axis,
        kind=kind,
    )
    if "bits" in values and get_scalar_int(values, "bits", tensor, path) != result.bits:
        raise ValueError(f"{path}: tensor {tensor!r} says {values['bits']} bits for range [{quant_min}, {quant_max}]")
    return result


def read(path: str | Path, spec: BackendSpec, float_model: onnx.ModelProto) -> QParamTable:
    """The quantization an STPU parameter file describes (exact)."""
    data = load_json(path)
    model = ModelTensors(float_model)
    entries: dict[str, TensorQParams] = {}
    for kind in ("activation", "weight"):
        for tensor, values in get_section(data, kind, path).items():
            if tensor in entries:
                raise ValueError(f"{path}: tensor {tensor!r} is both an activation and a weight")
            entries[tensor] = _entry(tensor, values, kind, model, path)
    return QParamTable(entries)
