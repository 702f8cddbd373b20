"""OpenPPL quantization parameters (``{model_name}_clip_ranges.json``), for the PPL W8A16 and PPL CUDA backends.

Layout, MQBench's for its PPL backend (one object per tensor under ``ppl``), with ``kind`` added
and ``axis`` for a per-channel weight::

    {"ppl": {tensor: {"step", "zero_point", "min", "max", "bit", "type": "biased", "kind": "activation"},
             weight: {"step": [...], "zero_point": [...], "min": [...], "max": [...], "bit",
                      "type": "biased", "kind": "weight", "axis": 0}}}

``step`` is the scale, ``min`` / ``max`` the float images ``(quant_min - zero_point) * step``
and ``(quant_max - zero_point) * step`` of the integer range (float32 values), ``bit`` the
width of the integer range; a per-channel entry has lists (one value per channel) and its
channel ``axis``. ``type`` is always ``"biased"`` (a scale with a zero point).

Reading back (:func:`read`) is exact: scale and zero point as written, and the integer range
from ``round(min / step) + zero_point`` and ``round(max / step) + zero_point`` (rounding
``min`` and ``max`` to float32 moves ``min / step`` by at most ``|level| * 2**-24``, under
0.004 even for 16 bits), checked to agree across channels and to fit in ``bit`` bits. A file
without ``kind`` (MQBench's) takes it from the float model (its initializers are weights), and
per-channel lists without ``axis`` take the weight's output-channel axis. The log grid (NNIE)
has no PPL form; writing it raises ValueError.

PPL CUDA gets the same file. MQBench's PPL CUDA deployment dumps ``{"ppl-cuda": {tensor: amax}}``
to this file name and then overwrites it with plain ``tensor: amax`` lines, so no JSON of its
own survives there to follow; the ``ppl`` layout above holds everything that backend needs.

Example:
    >>> import numpy as np
    >>> from mqbench.qparams import TensorQParams
    >>> from mqbench.deploy.writers.ppl import ppl_entry
    >>> ppl_entry(TensorQParams(np.array([0.5]), np.array([10]), 0, 255))
    {'step': 0.5, 'zero_point': 10, 'min': -5.0, 'max': 122.5, 'bit': 8, 'type': 'biased', 'kind': 'activation'}
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
    get_section,
    linear_values,
    load_json,
    make_entry,
    write_json,
)
from mqbench.qparams import KINDS, QParamTable, TensorQParams

if TYPE_CHECKING:
    from mqbench.deploy.context import DeployContext

__all__ = ["SUFFIX", "ppl_entry", "read", "write"]

SUFFIX = "_clip_ranges.json"
TYPE = "biased"


def ppl_entry(entry: TensorQParams) -> dict[str, Any]:
    """The PPL parameters of one entry (lists and ``axis`` per channel)."""
    values = linear_values(entry, "PPL", "step")
    values.update(bit=entry.bits, type=TYPE, kind=entry.kind)
    if entry.per_channel:
        values["axis"] = entry.axis
    return values


def write(context: DeployContext) -> Path:
    """Write ``{model_name}_clip_ranges.json``: every table entry under ``ppl``, in the table's order."""
    params: dict[str, dict[str, Any]] = {}
    for tensor, entry in context.table.items():
        try:
            params[tensor] = ppl_entry(entry)
        except ValueError as error:
            raise ValueError(f"tensor {tensor!r}: {error}") from None
    return write_json(context.path(SUFFIX), {"ppl": params})


def _integer_bound(
    bound: np.ndarray, step: np.ndarray, zero_point: np.ndarray, name: str, tensor: str, path: Any
) -> int:
    levels = bound.astype(np.float64) / step.astype(np.float64)
    nearest = np.rint(levels)
    values = set((nearest + zero_point).astype(np.int64).tolist())
    if np.any(np.abs(levels - nearest) > 0.1) or len(values) != 1:
        raise ValueError(
            f"{path}: {name!r} of tensor {tensor!r} is not one integer level of its step for every channel"
        )
    return values.pop()


def _entry(tensor: str, values: Any, model: ModelTensors, path: str | Path) -> TensorQParams:
    if not isinstance(values, dict):
        raise ValueError(f"{path}: the parameters of tensor {tensor!r} must be a JSON object")
    if values.get("type", TYPE) != TYPE:
        raise ValueError(f"{path}: tensor {tensor!r} has type {values['type']!r}; PPL parameters are {TYPE!r}")
    kind = values.get("kind", model.kind(tensor))
    if kind not in KINDS:
        raise ValueError(f"{path}: tensor {tensor!r} has kind {kind!r}; valid: {', '.join(map(repr, KINDS))}")
    fields = {key: get_float(values, key, tensor, path) for key in ("step", "min", "max")}
    zero_point = get_int(values, "zero_point", tensor, path)
    per_channel = isinstance(fields["step"], list)
    if any(isinstance(v, list) != per_channel for v in (*fields.values(), zero_point)):
        raise ValueError(
            f"{path}: tensor {tensor!r} needs lists for all of 'step', 'zero_point', 'min' and 'max' "
            "(per channel) or numbers for all (per tensor)"
        )
    step = np.atleast_1d(np.asarray(fields["step"], np.float32))
    zp = np.atleast_1d(np.asarray(zero_point, np.int64))
    low = np.atleast_1d(np.asarray(fields["min"], np.float32))
    high = np.atleast_1d(np.asarray(fields["max"], np.float32))
    if not step.shape == zp.shape == low.shape == high.shape:
        raise ValueError(f"{path}: the per-channel lists of tensor {tensor!r} differ in length")
    if np.any(step <= 0):
        raise ValueError(f"{path}: the steps of tensor {tensor!r} must be positive")
    axis = None
    if "axis" in values:
        if not per_channel:
            raise ValueError(f"{path}: tensor {tensor!r} has an 'axis' but one step; give a list per channel")
        axis = get_scalar_int(values, "axis", tensor, path)
        model.check_channels(tensor, axis, len(step), path)
    elif per_channel:
        axis = model.channel_axis(tensor, len(step), path)
    quant_min = _integer_bound(low, step, zp, "min", tensor, path)
    quant_max = _integer_bound(high, step, zp, "max", tensor, path)
    bits = get_scalar_int(values, "bit", tensor, path)
    if quant_max - quant_min + 1 > 2**bits:
        raise ValueError(f"{path}: tensor {tensor!r} spans [{quant_min}, {quant_max}], more than {bits} bits hold")
    return make_entry(
        tensor, path, scale=step, zero_point=zp, quant_min=quant_min, quant_max=quant_max, axis=axis, kind=kind
    )


def read(path: str | Path, spec: BackendSpec, float_model: onnx.ModelProto) -> QParamTable:
    """The quantization a PPL parameter file describes (exact)."""
    params = get_section(load_json(path), "ppl", path)
    model = ModelTensors(float_model)
    return QParamTable({tensor: _entry(tensor, values, model, path) for tensor, values in params.items()})
