"""The integer reference's values: integers on a grid (:class:`Quant`), a run's :class:`Context`, and
the int32 accumulator as hardware holds it (:func:`saturate_int32`); the float evaluator for the rest."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import onnx
from onnx import helper

from mqbench.nn.quantized.functional import (
    INT32_RANGE,
    quantize_bias,
    rescale,
    round_to_grid,
)
from mqbench.nn.quantized.saturation import PairSaturation

__all__ = [
    "AccumulatorOverflowWarning",
    "Context",
    "Correction",
    "Quant",
    "Value",
    "accumulator",
    "per_axis",
    "requantize_value",
    "run_float",
    "saturate_int32",
    "to_array",
]


class AccumulatorOverflowWarning(UserWarning):
    """An int32 accumulator of the integer reference left the int32 range (it saturates there)."""


@dataclass(frozen=True)
class Quant:
    """Integers whose real value is ``scale * (q - zero_point)``, then each of ``clamps`` (lo, hi) in turn.

    ``wide`` marks an int32 accumulator (or a container wider than 8 bits) as opposed to an
    8-bit tensor; ``scale`` (float64) and ``zero_point`` (int64) broadcast against ``q``.
    """

    q: np.ndarray
    scale: np.ndarray
    zero_point: np.ndarray
    clamps: tuple[tuple[np.ndarray, np.ndarray], ...] = ()
    wide: bool = False
    dtype: Any = np.float32
    signed: bool = True  # the integer container's signedness (int8 vs uint8)
    constant: bool = False  # dequantized from a constant of the model (a weight), not computed at run time

    @property
    def narrow(self) -> bool:
        """An unclamped 8-bit value: a valid integer-kernel operand."""
        return not self.wide and not self.clamps

    def centered(self) -> np.ndarray:
        return self.q - self.zero_point

    def scalar_params(self) -> bool:
        return (
            self.scale.size == 1
            and self.zero_point.size == 1
            and all(lo.size == hi.size == 1 for lo, hi in self.clamps)
        )

    def varies_only_on(self, axes: Sequence[int]) -> bool:
        """Scale, zero point and clamp bounds are constant along every axis not in ``axes``."""
        rank = self.q.ndim
        params = [self.scale, self.zero_point] + [b for pair in self.clamps for b in pair]
        return all(
            p.size == 1 or (p.ndim == rank and all(p.shape[i] == 1 for i in range(rank) if i not in axes))
            for p in params
        )

    def to_float(self) -> np.ndarray:
        # float64 product of an integer below 2**24 and a float32 scale is exact: one rounding, like float32
        x = (self.centered() * self.scale).astype(self.dtype)
        for lo, hi in self.clamps:
            x = np.minimum(np.maximum(x, lo.astype(self.dtype)), hi.astype(self.dtype))
        return x


Value = np.ndarray | Quant


@dataclass(frozen=True)
class Context:
    rounding: str
    opsets: Sequence[onnx.OperatorSetIdProto]
    apply: PairSaturation | None = None  # computes convolutions and matrix products as this kernel does
    record: tuple[PairSaturation, ...] = ()  # records where these kernels would change the accumulator
    saturated: dict[str, dict[str, float]] = field(default_factory=dict)  # runtime -> node -> changed fraction
    constants: frozenset[str] = frozenset()  # the tensors computed from the model's constants alone
    overflows: dict[str, str] = field(default_factory=dict)  # node -> why its int32 accumulator saturated

    def saturate(self, node: onnx.NodeProto, acc: np.ndarray, x: Quant, w: Quant, correction: Correction) -> np.ndarray:
        """``acc`` with the applied model's pair-saturation correction; records every model's.

        ``correction(raw_x, raw_fill, layout)`` computes one model's correction from the kernel's
        unsigned activation operand ``raw_x`` (padded with ``raw_fill``); ``w`` is the signed operand
        (a weight, or the right operand of a product of two activations).
        """
        if x.wide or w.wide or not w.signed or np.any(w.zero_point != 0):
            return acc
        models = dict.fromkeys((*self.record, *((self.apply,) if self.apply else ())))
        for model in models:
            if not (w.constant or model.activation_products):
                continue
            raw = model.raw_activation(x.q, x.signed)
            if raw is None:
                continue
            fill = int(model.raw_activation(x.zero_point.reshape(()), x.signed))  # type: ignore[arg-type]
            delta = correction(raw, fill, model.layout)
            changed = float(np.count_nonzero(delta)) / max(delta.size, 1)
            if changed and model in self.record:
                self.saturated.setdefault(model.runtime, {})[node.name or node.output[0]] = changed
            if model == self.apply:
                acc = acc + delta
        return acc


Correction = Callable[[np.ndarray, int, str], np.ndarray]


def to_array(value: Value) -> np.ndarray:
    return value.to_float() if isinstance(value, Quant) else value


def per_axis(values: np.ndarray, axis: int, rank: int) -> np.ndarray:
    """A per-tensor (size 1) or per-axis (1-d) quantization parameter, shaped to broadcast at ``rank``."""
    values = np.asarray(values)
    if values.size == 1:
        return values.reshape(())
    if values.ndim != 1 or rank == 0 or not -rank <= axis < rank:
        raise ValueError(f"per-axis parameters of shape {values.shape} do not fit axis {axis} of a rank-{rank} tensor")
    shape = [1] * rank
    shape[axis % rank] = values.size
    return values.reshape(shape)


def requantize_value(
    x: Quant, scale: np.ndarray, zero_point: np.ndarray, lo: int, hi: int, rounding: str
) -> np.ndarray:
    """QuantizeLinear of an integer value: fixed-point rescale, the clamps on the output grid, saturation."""
    ratio = np.broadcast_to(x.scale, np.broadcast_shapes(x.scale.shape, scale.shape)) / scale.astype(np.float64)
    y = rescale(x.centered(), ratio, rounding) + zero_point
    result = y.astype(np.float64)  # exact: |y| < 2**32
    for clamp_lo, clamp_hi in x.clamps:
        result = np.clip(result, round_to_grid(clamp_lo, scale, zero_point), round_to_grid(clamp_hi, scale, zero_point))
    return np.clip(result, lo, hi).astype(np.int64)


def _gather_elements(node: onnx.NodeProto, data: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """ONNX GatherElements (onnx's reference evaluator reads only the first index of each row once the gathered
    axis is longer than 64: numpy's ``choose`` takes at most 64 choices)."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    axis = int(attrs.get("axis", 0)) % data.ndim
    indices = np.asarray(indices, np.int64)
    return np.take_along_axis(data, np.where(indices < 0, indices + data.shape[axis], indices), axis=axis)


def run_float(node: onnx.NodeProto, inputs: list[Any], opsets: Sequence[onnx.OperatorSetIdProto]) -> list[np.ndarray]:
    from onnx.reference import ReferenceEvaluator

    feeds = {name: to_array(v) for name, v in zip(node.input, inputs, strict=True) if name}
    if node.op_type == "GatherElements" and not node.domain:
        return [_gather_elements(node, *(np.asarray(v) for v in feeds.values()))]
    graph = helper.make_graph(
        [node],
        "single_node",
        [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape) for n, a in feeds.items()],
        [helper.make_empty_tensor_value_info(o) for o in node.output if o],
    )
    model = helper.make_model(graph, opset_imports=list(opsets))
    try:
        results = ReferenceEvaluator(model).run(None, feeds)
    except Exception as error:  # the evaluator raises many types; name the node
        raise ValueError(f"node {node.name!r} ({node.op_type}) failed in the float reference: {error}") from error
    it = iter(results)
    return [np.asarray(next(it)) if o else np.zeros(0) for o in node.output]


def accumulator(acc: np.ndarray, scale: np.ndarray, bias: Value | None, bias_shape: tuple[int, ...]) -> Quant:
    """The int32 accumulator plus the bias quantized to its scale (round half to even)."""
    acc = np.asarray(acc, np.int64)  # exact integers (see the module notes)
    if bias is not None:  # a DQ'd int32 bias on this scale comes back exactly (below 2**24)
        acc = acc + quantize_bias(np.asarray(to_array(bias)).reshape(-1), scale.reshape(-1)).reshape(bias_shape)
    return Quant(
        acc, scale.reshape(bias_shape) if scale.size > 1 else scale.reshape(()), np.zeros((), np.int64), wide=True
    )


def saturate_int32(node: onnx.NodeProto, inputs: list[Any], value: Quant, ctx: Context) -> Quant:
    """An int32 accumulator as the hardware holds it: saturated at the int32 range, with a warning naming why.

    No int32 result equals an accumulator beyond the range (and wrapping differs between devices), so the
    reference saturates, as saturating multiply-accumulate units do, and what the node feeds then parts
    from the simulation: the verdict fails at that tensor, and the warning names the node and its scales.
    """
    low, high = int(value.q.min(initial=0)), int(value.q.max(initial=0))
    if INT32_RANGE[0] <= low and high <= INT32_RANGE[1]:
        return value
    bits = max(abs(low) - 1, high).bit_length() + 1
    operands = [
        f"{float(np.min(v.scale)):.3g} ({name})"
        for name, v in zip(node.input, inputs, strict=True)
        if isinstance(v, Quant) and not v.wide
    ]
    name = node.name or node.output[0]
    message = (
        f"node {name!r} ({node.op_type}): its int32 accumulator reaches {low}..{high}, a {bits}-bit value, on the "
        f"scale {float(np.min(value.scale)):.3g} (the operands' scales: {', '.join(operands) or 'none'}); "
        f"the integer reference saturates it at int32, so {node.output[0]!r} and what it feeds differ from the "
        "simulation. A scale this small against the values (or the bias) usually comes from a calibration that "
        "saw a far narrower range than the data, e.g. near-zero inputs: calibrate on representative inputs."
    )
    ctx.overflows[name] = message
    warnings.warn(message, AccumulatorOverflowWarning, stacklevel=4)
    return replace(value, q=np.clip(value.q, *INT32_RANGE))
