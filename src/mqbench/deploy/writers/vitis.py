"""Xilinx Vitis AI fix positions (``{model_name}_vitis.json``): bit width and fix position of every tensor.

The Vitis AI DPU computes in signed fixed point: a tensor of ``bit_width`` bits and fix
position ``p`` holds integers in ``[-2**(bit_width - 1), 2**(bit_width - 1) - 1]`` that stand
for ``q * 2**-p``, so a power-of-two scale ``2**-p`` with zero point 0. Layout, after the
``quant_info.json`` that Vitis AI's PyTorch quantizer writes (``[[bit_width, fix_position]]``
per tensor; weights under ``param``, activations under ``output``)::

    {"param": {weight: [[8, 8]], ...}, "output": {tensor: [[8, 5]], ...}}

A per-channel weight has one pair per output channel. The keys are the tensor names of this
deployment's ONNX models (``{model_name}_deploy_model.onnx``), not the node names Vitis AI's
own quantizer gives.

Writing raises ValueError naming the tensor when a scale is not a power of two, a zero point
is not 0, or the integer range is not the full signed range of its bits. Reading back
(:func:`read`) is exact: scale ``2**-p`` (a float32 power of two), zero point 0 and the signed
range of ``bit_width`` bits; the only loss is representational: a per-channel weight with a
single channel comes back per tensor.

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
    >>> from mqbench.deploy.writers.vitis import fix_positions
    >>> fix_positions("conv1", TensorQParams(np.array([2.0**-5]), np.array([0]), -128, 127))
    [[8, 5]]
    >>> fix_positions("conv1", TensorQParams(np.array([0.3]), np.array([0]), -128, 127))
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
from mqbench.deploy.writers.common import ModelTensors, get_section, load_json, make_entry, write_json
from mqbench.qparams import QParamTable, TensorQParams, pot_exponent

if TYPE_CHECKING:
    from mqbench.deploy.context import DeployContext

__all__ = ["SUFFIX", "fix_positions", "read", "write"]

SUFFIX = "_vitis.json"


def _signed_range(bits: int) -> tuple[int, int]:
    return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1


def fix_positions(tensor: str, entry: TensorQParams) -> list[list[int]]:
    """``[[bit_width, fix_position]]`` for one entry (one pair per channel); ValueError naming the tensor."""
    if entry.grid != "linear" or not entry.symmetric:
        raise ValueError(f"tensor {tensor!r}: Vitis AI fixed point has zero point 0 on a linear grid")
    bits = entry.bits
    if (entry.quant_min, entry.quant_max) != _signed_range(bits):
        raise ValueError(
            f"tensor {tensor!r}: Vitis AI fixed point is the full signed range {list(_signed_range(bits))} of "
            f"{bits} bits, got [{entry.quant_min}, {entry.quant_max}]"
        )
    pairs = []
    for scale in entry.scale.tolist():
        try:
            pairs.append([bits, pot_exponent(scale)])
        except ValueError:
            raise ValueError(f"tensor {tensor!r}: Vitis AI needs power-of-two scales, got {scale!r}") from None
    return pairs


def write(context: DeployContext) -> Path:
    """Write ``{model_name}_vitis.json``: weights under ``param``, activations under ``output``."""
    params: dict[str, list[list[int]]] = {}
    outputs: dict[str, list[list[int]]] = {}
    for tensor, entry in context.table.items():
        (params if entry.kind == "weight" else outputs)[tensor] = fix_positions(tensor, entry)
    return write_json(context.path(SUFFIX), {"param": params, "output": outputs})


def _pairs(tensor: str, value: Any, path: str | Path) -> list[tuple[int, int]]:
    def valid(pair: Any) -> bool:
        return (
            isinstance(pair, list)
            and len(pair) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in pair)
            and 1 < pair[0] <= 32
        )

    if not isinstance(value, list) or not value or not all(valid(pair) for pair in value):
        raise ValueError(
            f"{path}: tensor {tensor!r} needs a list of [bit_width, fix_position] integer pairs, got {value!r}"
        )
    return [(pair[0], pair[1]) for pair in value]


def read(path: str | Path, spec: BackendSpec, float_model: onnx.ModelProto) -> QParamTable:
    """The fixed-point quantization of every tensor in a Vitis fix-position file (exact)."""
    data = load_json(path)
    model = ModelTensors(float_model)
    entries: dict[str, TensorQParams] = {}
    for section, kind in (("output", "activation"), ("param", "weight")):
        for tensor, value in get_section(data, section, path).items():
            if tensor in entries:
                raise ValueError(f"{path}: tensor {tensor!r} is under both 'param' and 'output'")
            pairs = _pairs(tensor, value, path)
            bits = {b for b, _ in pairs}
            if len(bits) != 1:
                raise ValueError(f"{path}: the channels of tensor {tensor!r} differ in bit width")
            positions = [p for _, p in pairs]
            if any(not -126 <= p <= 149 for p in positions):
                raise ValueError(f"{path}: tensor {tensor!r} has a fix position outside float32's range: {positions}")
            quant_min, quant_max = _signed_range(bits.pop())
            axis = model.channel_axis(tensor, len(pairs), path) if len(pairs) > 1 else None
            entries[tensor] = make_entry(
                tensor,
                path,
                scale=np.array([2.0**-p for p in positions], np.float32),
                zero_point=np.zeros(len(pairs), np.int32),
                quant_min=quant_min,
                quant_max=quant_max,
                axis=axis,
                kind=kind,
            )
    return QParamTable(entries)
