"""Xilinx Vitis AI fixed point (``{model_name}_clip_ranges.json``): scale, bit width and fix position of every tensor.

The Vitis AI DPU computes in signed fixed point: a tensor of ``bit_width`` bits and fix
position ``p`` holds integers in ``[-2**(bit_width - 1), 2**(bit_width - 1) - 1]`` that stand
for ``q * 2**-p``, so a power-of-two scale ``2**-p`` with zero point 0. Layout, MQBench's for
its Vitis backend (``{"scale": s}`` per tensor under ``vitis``) with the bit width, the fix
position (``[bit_width, fix_position]`` is what Vitis AI's own ``quant_info.json`` and XIR's
quantized ops carry) and the kind added::

    {"vitis": {tensor: {"scale": 0.03125, "bit_width": 8, "fix_position": 5, "kind": "activation"},
               weight: {"scale": [0.0078125, ...], "bit_width": 8, "fix_position": [7, ...], "kind": "weight"}}}

A per-channel weight has lists, one value per output channel. The keys are the tensor names of
this deployment's ONNX models (``{model_name}_deploy_model.onnx``), not the node names Vitis
AI's own quantizer gives.

Writing raises ValueError naming the tensor when a scale is not a power of two, a zero point
is not 0, or the integer range is not the full signed range of its bits. Reading back
(:func:`read`) is exact: scale ``2**-p`` (a float32 power of two), zero point 0, the signed
range of ``bit_width`` bits, and lists along the weight's output-channel axis (axis 1 for a
ConvTranspose weight, else 0). ``fix_position``, where given, must agree with the scale. A file
with ``scale`` alone (MQBench's) takes the kind from the float model (its initializers are
weights) and the range from the backend's scheme for that kind.

How the files feed the Vitis AI flow: Vitis AI's tools (the ``vai_q_pytorch`` / ``vai_q_onnx``
quantizers, the XIR library and the ``vai_c_xir`` compiler, shipped in AMD/Xilinx's Docker
images) are not installable here, so this package writes no ``.xmodel`` and nothing here is run
on a DPU. It writes what that flow needs from training: ``{model_name}_deploy_model.onnx``, the
float model with BatchNorm merged and every weight already clipped to its fixed-point range, and
this file, the bit width and fix position of each weight and activation. On a machine with
Vitis AI, a conversion step maps each ONNX tensor name to the XIR op that produces or holds it
and gives that op's fix point these values (XIR's quantized ops carry ``bit_width`` and
``fix_point``), or writes them into the quantizer's own ``quant_info.json`` under its node
names and exports the ``.xmodel`` from there; ``vai_c_xir -x model.xmodel -a arch.json`` then
compiles it for the target DPU. With power-of-two scales and pre-clipped weights the DPU's
shifts work on the same integer grid as the simulation (a DPU may round exact ties differently
from round-half-to-even); ``{model_name}.onnx``, standard Q/DQ with the same scales, is the
reference to compare its results with.

Example:
    >>> import numpy as np
    >>> from mqbench.qparams import TensorQParams
    >>> from mqbench.deploy.writers.vitis import vitis_entry
    >>> vitis_entry("conv1", TensorQParams(np.array([2.0**-5]), np.array([0]), -128, 127))
    {'scale': 0.03125, 'bit_width': 8, 'fix_position': 5, 'kind': 'activation'}
    >>> vitis_entry("conv1", TensorQParams(np.array([0.3]), np.array([0]), -128, 127))
    Traceback (most recent call last):
    ...
    ValueError: tensor 'conv1': Vitis AI needs power-of-two scales, got 0.30000001192092896
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
    get_scalar_int,
    get_section,
    load_json,
    make_entry,
    scheme_for,
    write_json,
)
from mqbench.qparams import KINDS, QParamTable, TensorQParams, pot_exponent

if TYPE_CHECKING:
    from mqbench.deploy.context import DeployContext

__all__ = ["SUFFIX", "read", "vitis_entry", "write"]

SUFFIX = "_clip_ranges.json"


def _signed_range(bits: int) -> tuple[int, int]:
    return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1


def vitis_entry(tensor: str, entry: TensorQParams) -> dict[str, Any]:
    """Scale, bit width, fix position and kind of one entry (lists per channel); ValueError naming the tensor."""
    if entry.grid != "linear" or not entry.symmetric:
        raise ValueError(f"tensor {tensor!r}: Vitis AI fixed point has zero point 0 on a linear grid")
    bits = entry.bits
    if (entry.quant_min, entry.quant_max) != _signed_range(bits):
        raise ValueError(
            f"tensor {tensor!r}: Vitis AI fixed point is the full signed range {list(_signed_range(bits))} of "
            f"{bits} bits, got [{entry.quant_min}, {entry.quant_max}]"
        )
    positions = []
    for scale in entry.scale.tolist():
        try:
            positions.append(pot_exponent(scale))
        except ValueError:
            raise ValueError(f"tensor {tensor!r}: Vitis AI needs power-of-two scales, got {scale!r}") from None
    return {
        "scale": as_values(entry.scale, entry.per_channel),
        "bit_width": bits,
        "fix_position": positions if entry.per_channel else positions[0],
        "kind": entry.kind,
    }


def write(context: DeployContext) -> Path:
    """Write ``{model_name}_clip_ranges.json``: every table entry under ``vitis``, in the table's order."""
    params = {tensor: vitis_entry(tensor, entry) for tensor, entry in context.table.items()}
    return write_json(context.path(SUFFIX), {"vitis": params})


def _entry(tensor: str, values: Any, spec: BackendSpec, model: ModelTensors, path: str | Path) -> TensorQParams:
    if not isinstance(values, dict):
        raise ValueError(f"{path}: the parameters of tensor {tensor!r} must be a JSON object")
    kind = values.get("kind", model.kind(tensor))
    if kind not in KINDS:
        raise ValueError(f"{path}: tensor {tensor!r} has kind {kind!r}; valid: {', '.join(map(repr, KINDS))}")
    scale = get_float(values, "scale", tensor, path)
    scales = scale if isinstance(scale, list) else [scale]
    try:
        positions = [pot_exponent(value) for value in scales if value > 0]
    except ValueError:
        positions = []
    if len(positions) != len(scales):
        raise ValueError(f"{path}: tensor {tensor!r} needs positive power-of-two scales, got {scale!r}")
    if any(not -126 <= p <= 149 for p in positions):  # 2**-p must be a float32
        raise ValueError(f"{path}: tensor {tensor!r} has a fix position outside float32's range: {positions}")
    if "fix_position" in values:
        meant = positions if isinstance(scale, list) else positions[0]
        if get_int(values, "fix_position", tensor, path) != meant:
            raise ValueError(
                f"{path}: tensor {tensor!r} has fix_position {values['fix_position']!r}, but its scale {scale!r} "
                f"means {meant!r} (scale = 2**-fix_position)"
            )
    if "bit_width" in values:
        bits = get_scalar_int(values, "bit_width", tensor, path)
        if not 1 < bits <= 32:
            raise ValueError(f"{path}: tensor {tensor!r} has bit_width {bits}; valid: 2 to 32")
        quant_min, quant_max = _signed_range(bits)
    else:
        quant_min, quant_max = scheme_for(spec, kind, path).quant_range
    axis = model.channel_axis(tensor, len(scales), path) if isinstance(scale, list) else None
    return make_entry(
        tensor,
        path,
        scale=np.array([2.0**-p for p in positions], np.float32),
        zero_point=np.zeros(len(positions), np.int32),
        quant_min=quant_min,
        quant_max=quant_max,
        axis=axis,
        kind=kind,
    )


def read(path: str | Path, spec: BackendSpec, float_model: onnx.ModelProto) -> QParamTable:
    """The fixed-point quantization of every tensor in a Vitis parameter file (exact)."""
    params = get_section(load_json(path), "vitis", path)
    model = ModelTensors(float_model)
    return QParamTable({tensor: _entry(tensor, values, spec, model, path) for tensor, values in params.items()})
