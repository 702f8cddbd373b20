"""STPU quantization parameters (``{model_name}_stpu_minmax.json``): the full linear quantization of every tensor.

Layout::

    {"activation": {tensor: {"scale", "zero_point", "min", "max", "bits", "quant_min", "quant_max"}},
     "weight": {weight: {... the same, with lists for "scale", "zero_point", "min", "max"
                         and "axis" when per channel}}}

``min`` / ``max`` are the float images ``(quant_min - zero_point) * scale`` and
``(quant_max - zero_point) * scale`` of the integer range (float32 values, informative).
Reading back (:func:`read`) is exact: every quantity the table holds is in the file. The log
grid has no STPU form; writing it raises ValueError.

The file name is MQBench's; the layout is not. MQBench's file is one flat object of
``{"min": -127 * scale, "max": 127 * scale}`` per activation and per ``{node}_weights``, with a
bias ``alpha`` per ``{node}_bias`` and an ``emin`` exponent on the outputs of convolutions,
Gemm and upsampling that the STPU toolchain derives from those ranges, beside a
``{model_name}_for_stpu.onnx`` model. That layout keeps only a symmetric [-127, 127] range
per tensor under its node's name, so it cannot be read back into the quantization this
deployment simulates; this file keeps every tensor under its ONNX name with its scale, zero
point and integer range, and ``{model_name}_deploy_model.onnx`` is the model it belongs to.

Example:
    >>> import numpy as np
    >>> from mqbench.qparams import TensorQParams
    >>> from mqbench.deploy.writers.stpu import stpu_entry
    >>> stpu_entry(TensorQParams(np.array([0.5]), np.array([0]), -127, 127))
    {'scale': 0.5, 'zero_point': 0, 'min': -63.5, 'max': 63.5, 'bits': 8, 'quant_min': -127, 'quant_max': 127}
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx

from mqbench.backends.spec import BackendSpec
from mqbench.deploy.writers.common import (
    ModelTensors,
    get_float,
    get_int,
    get_scalar_int,
    linear_values,
    make_entry,
    read_by_kind,
    write_by_kind,
)
from mqbench.qparams import QParamTable, TensorQParams

if TYPE_CHECKING:
    from mqbench.deploy.context import DeployContext

__all__ = ["SUFFIX", "read", "stpu_entry", "write"]

SUFFIX = "_stpu_minmax.json"


def stpu_entry(entry: TensorQParams) -> dict[str, Any]:
    """The STPU parameters of one entry (lists and ``axis`` per channel)."""
    values = linear_values(entry, "STPU", "scale")
    values.update(bits=entry.bits, quant_min=entry.quant_min, quant_max=entry.quant_max)
    if entry.per_channel:
        values["axis"] = entry.axis
    return values


def write(context: DeployContext) -> Path:
    """Write ``{model_name}_stpu_minmax.json`` (every table entry, by kind)."""
    return write_by_kind(context, SUFFIX, stpu_entry)


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
    return read_by_kind(path, float_model, _entry)
