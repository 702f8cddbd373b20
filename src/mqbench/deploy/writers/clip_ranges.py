"""TensorRT clip ranges (``{model_name}_clip_ranges.json``): the dynamic range of every quantized tensor.

Layout::

    {"tensorrt": {"blob_range": {tensor: amax, weight: [amax per channel], ...}},
     "qparams": {tensor: {"kind", "scale", "zero_point", "quant_min", "quant_max", "bits", "axis",
                          "min", "max", "grid", ...}}}

``amax`` is TensorRT's ``ITensor::setDynamicRange(-amax, amax)``, which it maps onto [-127, 127]:
``max(|min|, |max|)`` of the tensor's float range, and on int8's full grid [-128, 127] (symmetric, zero point 0)
the top level's value ``127 * scale``, so that TensorRT derives the same scale (the -128 level is -127 there); a
per-channel weight has one ``amax`` per output channel. ``qparams`` holds every entry of the parameter table in full
(:meth:`~mqbench.qparams.TensorQParams.to_dict`, without the consumers), for tools and
for the Academic backends, whose quantizers need not be symmetric.

Reading back (:func:`read`):

* backends with default schemes (TensorRT): from ``blob_range`` alone, as TensorRT does it:
  symmetric, zero point 0, ``scale = float32(amax / max(-quant_min, quant_max))`` (127 steps on [-128, 127])
  with the range of the backend's weight scheme for initializers of the float model, of its activation scheme
  otherwise (for 7-bit weights in [-64, 63], amax is 64 steps). Per-channel lists are along axis 0
  (axis 1 for a ConvTranspose weight). Lossy: the file stores amax in float32, so the scale read
  back is within one float32 ulp of the original (about 0.8% of 8-bit scales move by one ulp).
* the Academic backends (no default schemes): from ``qparams``, exactly.

Example:
    >>> import numpy as np
    >>> from mqbench.qparams import TensorQParams
    >>> from mqbench.deploy.writers.clip_ranges import amax
    >>> amax(TensorQParams(np.array([0.5]), np.array([0]), -127, 127))
    63.5
    >>> amax(TensorQParams(np.array([0.1, 0.2]), np.array([100, 0]), 0, 255, axis=0))
    [15.5, 51.0]
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx

from mqbench.backends.spec import BackendSpec
from mqbench.deploy.writers.common import (
    ModelTensors,
    as_values,
    get_float,
    get_int,
    get_scalar,
    get_scalar_int,
    get_section,
    load_json,
    make_entry,
    scheme_for,
    write_json,
)
from mqbench.grids import GRIDS, grid_of
from mqbench.qparams import KINDS, QParamTable, TensorQParams

if TYPE_CHECKING:
    from mqbench.deploy.context import DeployContext

__all__ = ["SUFFIX", "amax", "read", "write"]

SUFFIX = "_clip_ranges.json"


def amax(entry: TensorQParams) -> float | list[float]:
    """TensorRT's dynamic range of the entry (module docstring; ``data_max`` for the log grid); a list per channel."""
    if entry.grid == "linear" and (entry.quant_min, entry.quant_max) == (-128, 127) and not entry.zero_point.any():
        # TensorRT maps [-amax, amax] onto [-127, 127]: the top level's value gives it this scale (-128 is -127 there)
        return as_values((127 * entry.scale.astype(np.float64)).astype(np.float32), entry.per_channel)
    return as_values(grid_of(entry.grid).amax(entry), entry.per_channel)


def _qparams(entry: TensorQParams) -> dict[str, Any]:
    values = entry.to_dict()
    values.pop("consumers", None)
    return values


def write(context: DeployContext) -> Path:
    """Write ``{model_name}_clip_ranges.json`` (every table entry, weights included)."""
    table = context.table
    data = {
        "tensorrt": {"blob_range": {tensor: amax(entry) for tensor, entry in table.items()}},
        "qparams": {tensor: _qparams(entry) for tensor, entry in table.items()},
    }
    return write_json(context.path(SUFFIX), data)


def read(path: str | Path, spec: BackendSpec, float_model: onnx.ModelProto) -> QParamTable:
    """The quantization the backend applies from this file (see the module docstring)."""
    data = load_json(path)
    if "tensorrt" not in data and spec.name in data:  # a backend without a format of its own (MQBench's steps)
        return _read_qparams(get_section(data, spec.name, path), path)
    if spec.weight is None or spec.activation is None:
        return _read_qparams(get_section(data, "qparams", path), path)
    ranges = get_section(get_section(data, "tensorrt", path), "blob_range", path)
    model = ModelTensors(float_model)
    entries: dict[str, TensorQParams] = {}
    for tensor, value in ranges.items():
        bound = get_float({"amax": value}, "amax", tensor, path)
        kind = model.kind(tensor)
        scheme = scheme_for(spec, kind, path)
        bounds = np.atleast_1d(np.asarray(bound, np.float32)).astype(np.float64)
        # amax = max(|min|, |max|), on int8's full grid the top level's value (127 steps, as TensorRT reads it)
        steps = 127 if scheme.quant_range == (-128, 127) else max(-scheme.quant_min, scheme.quant_max)
        scale = (bounds / steps).astype(np.float32)
        axis = model.channel_axis(tensor, len(bounds), path) if isinstance(bound, list) else None
        entries[tensor] = make_entry(
            tensor,
            path,
            scale=scale,
            zero_point=np.zeros(scale.shape, np.int32),
            quant_min=scheme.quant_min,
            quant_max=scheme.quant_max,
            axis=axis,
            kind=kind,
        )
    return QParamTable(entries)


def _read_qparams(section: dict[str, Any], path: str | Path) -> QParamTable:
    entries: dict[str, TensorQParams] = {}
    for tensor, values in section.items():
        if not isinstance(values, dict):
            raise ValueError(f"{path}: the qparams of tensor {tensor!r} must be a JSON object")
        kind = values.get("kind", "activation")
        grid = values.get("grid", "linear")
        axis = values.get("axis")
        if kind not in KINDS or grid not in GRIDS:
            raise ValueError(
                f"{path}: tensor {tensor!r} has kind {kind!r} and grid {grid!r}; valid: {KINDS}, {tuple(GRIDS)}"
            )
        if axis is not None and (isinstance(axis, bool) or not isinstance(axis, int)):
            raise ValueError(f"{path}: the axis of tensor {tensor!r} must be an integer or null, got {axis!r}")
        scale = get_float(values, "scale", tensor, path)
        zero_point = get_int(values, "zero_point", tensor, path)
        if isinstance(scale, list) != (axis is not None) or isinstance(zero_point, list) != (axis is not None):
            raise ValueError(
                f"{path}: tensor {tensor!r} needs lists of scales and zero points exactly when per channel"
            )
        data_max = values.get("data_max")
        entries[tensor] = make_entry(
            tensor,
            path,
            scale=np.asarray(scale, np.float32),
            zero_point=np.asarray(zero_point, np.int64),
            quant_min=get_scalar_int(values, "quant_min", tensor, path),
            quant_max=get_scalar_int(values, "quant_max", tensor, path),
            axis=axis,
            kind=kind,
            grid=grid,
            data_max=None if data_max is None else get_scalar(values, "data_max", tensor, path),
            quantizer=str(values.get("quantizer", "")),
        )
    return QParamTable(entries)
