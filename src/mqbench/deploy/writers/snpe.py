"""SNPE / QNN quantization overrides (``{model_name}_clip_ranges.json``, the file name MQBench gives them).

Layout (the JSON that ``snpe-onnx-to-dlc --quantization_overrides`` and the QNN converters read)::

    {"activation_encodings": {tensor: [{"bitwidth", "min", "max", "scale", "offset", "is_symmetric", "dtype"}]},
     "param_encodings": {weight: [one such dict per output channel, or one]}}

SNPE stores an unsigned integer ``q`` in ``[0, 2**bitwidth - 1]`` and reads it as
``real = (q + offset) * scale``. A table entry with range ``[quant_min, quant_max]`` and zero
point ``zp`` is the same grid shifted, so ``offset = quant_min - zp`` (``-zp`` on an unsigned
grid, ``-2**(bitwidth - 1)`` on a signed grid with zero point 0), ``min = offset * scale`` and
``max = (2**bitwidth - 1 + offset) * scale``. A range narrower than its bits (``[-127, 127]``)
is written as the full range that holds it (``quant_min`` taken as ``-2**(bitwidth - 1)`` on a
signed grid, 0 on an unsigned one), so that zero keeps its code. ``is_symmetric`` is ``"True"`` for a signed grid with
zero point 0 and ``"False"`` otherwise; ``dtype`` is ``"int"``. Scales are written as float32
values; ``min`` and ``max`` (rounded to float32) are derived and not read back.

Reading back (:func:`read`): ``is_symmetric == "True"`` gives the signed range
``[-2**(bitwidth - 1), 2**(bitwidth - 1) - 1]`` with zero point ``-(offset + 2**(bitwidth - 1))``
(0 for what this module writes); otherwise the unsigned range ``[0, 2**bitwidth - 1]`` with zero
point ``-offset``. Lossy cases:

* a narrow range (e.g. [-127, 127] or [0, 254]) cannot be expressed: the format always means all
  ``2**bitwidth`` levels. The reader returns the full range of ``bitwidth`` bits, i.e. [-128, 127]
  for [-127, 127], with the same scale and zero point: one extra level that the narrow grid
  never produces.
* a signed grid with a nonzero zero point comes back as the same levels on the unsigned grid
  (range [0, 2**bitwidth - 1], zero point ``zp - quant_min``).
* a per-channel weight with a single channel is read back per tensor (one dict either way).
* the log grid (NNIE) has no SNPE form; writing it raises ValueError.

Per-channel lists are along axis 0 of the weight (axis 1 for a ConvTranspose weight).

MQBench writes the same layout with ``bitwidth``, ``min`` and ``max`` per activation and an empty
``param_encodings``; this file adds ``scale``, ``offset``, ``is_symmetric`` and ``dtype`` and fills
``param_encodings``, which the SNPE and QNN converters also read (the weights' encodings are then
the training's, not the converter's own).

Example:
    >>> import numpy as np
    >>> from mqbench.qparams import TensorQParams
    >>> from mqbench.deploy.writers.snpe import encodings
    >>> encodings(TensorQParams(np.array([0.5]), np.array([10]), 0, 255))
    [{'bitwidth': 8, 'min': -5.0, 'max': 122.5, 'scale': 0.5, 'offset': -10, 'is_symmetric': 'False', 'dtype': 'int'}]
    >>> encodings(TensorQParams(np.array([0.25]), np.array([0]), -128, 127))[0]["offset"]
    -128
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx

from mqbench.backends.spec import BackendSpec
from mqbench.deploy.writers.common import (
    ModelTensors,
    f32,
    get_scalar,
    get_scalar_int,
    get_section,
    load_json,
    make_entry,
    write_json,
)
from mqbench.qparams import QParamTable, TensorQParams

if TYPE_CHECKING:
    from mqbench.deploy.context import DeployContext

__all__ = ["SUFFIX", "encodings", "read", "write"]

SUFFIX = "_clip_ranges.json"


def encodings(entry: TensorQParams) -> list[dict[str, Any]]:
    """The SNPE encodings of one entry: one dict per tensor, or one per channel."""
    if entry.grid != "linear":
        raise ValueError(f"SNPE encodings describe linear grids, not the {entry.grid!r} grid")
    bits = entry.bits
    symmetric = "True" if entry.signed and entry.symmetric else "False"
    result = []
    low = -(2 ** (bits - 1)) if entry.signed else 0  # the full range of `bits` bits holding the entry's range
    for scale, zero_point in zip(entry.scale.tolist(), entry.zero_point.tolist(), strict=True):
        offset = low - int(zero_point)
        result.append(
            {
                "bitwidth": bits,
                "min": f32(offset * scale),
                "max": f32((2**bits - 1 + offset) * scale),
                "scale": f32(scale),
                "offset": offset,
                "is_symmetric": symmetric,
                "dtype": "int",
            }
        )
    return result


def write(context: DeployContext) -> Path:
    """Write ``{model_name}_clip_ranges.json`` (activation and parameter encodings of every table entry)."""
    activations: dict[str, list[dict[str, Any]]] = {}
    params: dict[str, list[dict[str, Any]]] = {}
    for tensor, entry in context.table.items():
        try:
            values = encodings(entry)
        except ValueError as error:
            raise ValueError(f"tensor {tensor!r}: {error}") from None
        (params if entry.kind == "weight" else activations)[tensor] = values
    return write_json(context.path(SUFFIX), {"activation_encodings": activations, "param_encodings": params})


def _entry(tensor: str, values: Any, kind: str, model: ModelTensors, path: str | Path) -> TensorQParams:
    if isinstance(values, dict):
        values = [values]
    if not isinstance(values, list) or not values or not all(isinstance(v, dict) for v in values):
        raise ValueError(f"{path}: the encodings of tensor {tensor!r} must be a non-empty list of objects")
    bits = {get_scalar_int(v, "bitwidth", tensor, path) for v in values}
    symmetric = {str(v.get("is_symmetric", "False")) for v in values}
    if len(bits) != 1 or len(symmetric) != 1:
        raise ValueError(f"{path}: the channels of tensor {tensor!r} differ in bitwidth or is_symmetric")
    (bitwidth,) = bits
    if not 1 < bitwidth <= 32:
        raise ValueError(f"{path}: tensor {tensor!r} has bitwidth {bitwidth}")
    if symmetric.pop().lower() == "true":
        quant_min, quant_max = -(2 ** (bitwidth - 1)), 2 ** (bitwidth - 1) - 1
    else:
        quant_min, quant_max = 0, 2**bitwidth - 1
    scales = np.array([get_scalar(v, "scale", tensor, path) for v in values], np.float32)
    offsets = np.array([get_scalar_int(v, "offset", tensor, path) for v in values], np.int64)
    axis = model.channel_axis(tensor, len(values), path) if len(values) > 1 else None
    return make_entry(
        tensor,
        path,
        scale=scales,
        zero_point=quant_min - offsets,
        quant_min=quant_min,
        quant_max=quant_max,
        axis=axis,
        kind=kind,
    )


def read(path: str | Path, spec: BackendSpec, float_model: onnx.ModelProto) -> QParamTable:
    """The quantization an SNPE encodings file describes (see the module docstring for the lossy cases)."""
    data = load_json(path)
    model = ModelTensors(float_model)
    entries: dict[str, TensorQParams] = {}
    for section, kind in (("activation_encodings", "activation"), ("param_encodings", "weight")):
        for tensor, values in get_section(data, section, path).items():
            if tensor in entries:
                raise ValueError(f"{path}: tensor {tensor!r} has both activation and parameter encodings")
            entries[tensor] = _entry(tensor, values, kind, model, path)
    return QParamTable(entries)
