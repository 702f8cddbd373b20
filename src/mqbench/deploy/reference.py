"""Integer reference executor for Q/DQ ONNX models: what int8 hardware computes.

A standard Q/DQ model describes quantized inference in float (DequantizeLinear -> float op ->
QuantizeLinear). Hardware instead multiplies 8-bit integers, accumulates in int32 and
requantizes with a fixed-point multiplier and a shift. :func:`run_reference` walks the graph in
order and runs the recognizable patterns that way:

* DQ(x) and DQ(w) -> Conv / ConvTranspose / Gemm / MatMul: exact accumulation of
  ``(x_q - x_zp) * (w_q - w_zp)`` plus the bias quantized to the accumulator scale
  ``x_scale * w_scale`` (round half to even); ConvTranspose with any groups, strides, dilations,
  pads, output padding or output shape, its weight per tensor or per output column (axis 1);
* DQ(a), DQ(b) -> Add / Sub: both rescaled to a common fixed point (20 fraction bits), added;
  Mul: the integer product;
* AveragePool / GlobalAveragePool: the integer window sum, divided in the requantization;
* MaxPool, Reshape, Flatten, Transpose, Squeeze, Unsqueeze, Slice, Concat (equal parameters):
  on the integers themselves;
* Relu, Clip and Max / Min with a constant before a QuantizeLinear: integer clamps, exactly as
  ``Q(clip(x, lo, hi)) == clip(Q(x), Q(lo), Q(hi))`` (quantization is monotone);
* QuantizeLinear of an integer value: ``clamp(((acc * m0 + 2**(n-1)) >> n) + zp, qmin, qmax)``
  with ``acc_scale / y_scale ~= m0 * 2**-n`` and a 31-bit ``m0`` (per channel where the scales are).

Everything else is dequantized and run in float with ``onnx.reference`` (Conv and ConvTranspose
with this module's own float64 kernels), and quantized again at the next QuantizeLinear.

Rounding: the requantization shift rounds half up (``+ 2**(n-1)`` then an arithmetic shift, i.e.
towards +inf at exact ties), the single add-and-shift that fixed-point datapaths implement
(``rounding=`` selects half to even or half away from zero instead). Float QuantizeLinear and
the bias quantization round half to even, as ONNX specifies. Exact ties are rare unless the
scales are related by powers of two (then half up and the float graph's half to even differ).

Exactness: int8 x int8 convolutions and matrix products run as float64 matrix products of the
zero-point-centred integers. Every product is below ``255 * 255 < 2**16`` in magnitude, so every
partial sum is an exact integer while the reduction length stays below ``2**37`` terms (int64
beyond that). An accumulator beyond the int32 range has no int32 result that equals it (and
devices that wrap differ from each other), so it saturates at the int32 bounds, as saturating
multiply-accumulate units do, with an :class:`AccumulatorOverflowWarning` naming the node, its
scales and the usual cause (a degenerate scale from a calibration that saw a zero range): what
the node feeds then parts from the simulation, and a verification fails at that tensor.

The integer kernels (fixed-point multiplier and requantization, exact convolution and matrix
accumulation, bias quantization, the Add rescaling) are those of
:mod:`mqbench.nn.quantized.functional`, shared with the integer reference modules of
:mod:`mqbench.nn.quantized`; ``requantize_multiplier``, ``requantize``, ``ROUNDINGS`` and
``ADD_FRACTION_BITS`` are re-exported here.

Example:
    >>> import numpy as np
    >>> from onnx import TensorProto, helper, numpy_helper
    >>> from mqbench.deploy.reference import run_reference
    >>> inits = [numpy_helper.from_array(np.array(v, dtype), n) for n, v, dtype in [
    ...     ("s", 0.1, np.float32), ("z", 0, np.int8), ("w", [[3], [-2]], np.int8),
    ...     ("ws", 0.05, np.float32), ("ys", 0.02, np.float32)]]
    >>> nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"]),
    ...     helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"]),
    ...     helper.make_node("DequantizeLinear", ["w", "ws", "z"], ["wd"]),
    ...     helper.make_node("MatMul", ["xd", "wd"], ["m"]),
    ...     helper.make_node("QuantizeLinear", ["m", "ys", "z"], ["yq"]),
    ...     helper.make_node("DequantizeLinear", ["yq", "ys", "z"], ["y"])]
    >>> graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2])],
    ...     [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1])], inits)
    >>> model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    >>> out = run_reference(model, {"x": np.array([[0.5, 0.25]], np.float32)}, ["yq", "y"])
    >>> out["yq"], out["y"]
    (array([[3]], dtype=int8), array([[0.06]], dtype=float32))
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from mqbench.nn.quantized.functional import (
    ADD_FRACTION_BITS,
    INT32_RANGE,
    ROUNDINGS,
    add_rescale,
    conv_accumulate,
    conv_transpose_accumulate,
    exact_matmul,
    quantize_bias,
    requantize,
    requantize_multiplier,
    rescale,
    round_to_grid,
    sliding_windows,
)
from mqbench.nn.quantized.saturation import PairSaturation, conv_saturation_correction, pair_saturation_correction

__all__ = [
    "ADD_FRACTION_BITS",
    "ROUNDINGS",
    "AccumulatorOverflowWarning",
    "requantize",
    "requantize_multiplier",
    "run_reference",
    "saturated_layers",
]


class AccumulatorOverflowWarning(UserWarning):
    """An int32 accumulator of the integer reference left the int32 range (it saturates there)."""


_SHAPE_OPS = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Slice", "Expand", "Tile"})


@dataclass(frozen=True)
class _Quant:
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


_Value = np.ndarray | _Quant


@dataclass(frozen=True)
class _Context:
    rounding: str
    opsets: Sequence[onnx.OperatorSetIdProto]
    apply: PairSaturation | None = None  # computes convolutions and matrix products as this kernel does
    record: tuple[PairSaturation, ...] = ()  # records where these kernels would change the accumulator
    saturated: dict[str, dict[str, float]] = field(default_factory=dict)  # runtime -> node -> changed fraction
    constants: frozenset[str] = frozenset()  # the tensors computed from the model's constants alone
    overflows: dict[str, str] = field(default_factory=dict)  # node -> why its int32 accumulator saturated

    def saturate(
        self, node: onnx.NodeProto, acc: np.ndarray, x: _Quant, w: _Quant, correction: _Correction
    ) -> np.ndarray:
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


_Correction = Callable[[np.ndarray, int, str], np.ndarray]
_Handler = Callable[[onnx.NodeProto, list[Any], dict[str, Any], _Context], "list[_Value] | None"]


def _array(value: _Value) -> np.ndarray:
    return value.to_float() if isinstance(value, _Quant) else value


def _param(values: np.ndarray, axis: int, rank: int) -> np.ndarray:
    """A per-tensor (size 1) or per-axis (1-d) quantization parameter, shaped to broadcast at ``rank``."""
    values = np.asarray(values)
    if values.size == 1:
        return values.reshape(())
    if values.ndim != 1 or rank == 0 or not -rank <= axis < rank:
        raise ValueError(f"per-axis parameters of shape {values.shape} do not fit axis {axis} of a rank-{rank} tensor")
    shape = [1] * rank
    shape[axis % rank] = values.size
    return values.reshape(shape)


def _requantize_value(
    x: _Quant, scale: np.ndarray, zero_point: np.ndarray, lo: int, hi: int, rounding: str
) -> np.ndarray:
    """QuantizeLinear of an integer value: fixed-point rescale, the clamps on the output grid, saturation."""
    ratio = np.broadcast_to(x.scale, np.broadcast_shapes(x.scale.shape, scale.shape)) / scale.astype(np.float64)
    y = rescale(x.centered(), ratio, rounding) + zero_point
    result = y.astype(np.float64)  # exact: |y| < 2**32
    for clamp_lo, clamp_hi in x.clamps:
        result = np.clip(result, round_to_grid(clamp_lo, scale, zero_point), round_to_grid(clamp_hi, scale, zero_point))
    return np.clip(result, lo, hi).astype(np.int64)


# -- the float reference for everything else ----------------------------------------------------
def _run_float(node: onnx.NodeProto, inputs: list[Any], opsets: Sequence[onnx.OperatorSetIdProto]) -> list[np.ndarray]:
    from onnx.reference import ReferenceEvaluator

    feeds = {name: _array(v) for name, v in zip(node.input, inputs, strict=True) if name}
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


def _geometry(attrs: dict[str, Any], spatial: Sequence[int], kernel: Sequence[int]) -> tuple[list[int], ...] | None:
    """(strides, pads, dilations) of a 2-d window op, ``None`` where not 2-d."""
    strides = list(attrs.get("strides", [1, 1]))
    dilations = list(attrs.get("dilations", [1, 1]))
    pads = list(attrs.get("pads", [0, 0, 0, 0]))
    if len(spatial) != 2 or len(kernel) != 2 or len(strides) != 2 or len(dilations) != 2 or len(pads) != 4:
        return None
    auto = attrs.get("auto_pad", b"NOTSET")
    auto = auto.decode() if isinstance(auto, bytes) else auto
    if auto == "VALID":
        pads = [0, 0, 0, 0]
    elif auto in ("SAME_UPPER", "SAME_LOWER"):
        for i in range(2):
            out = -(-spatial[i] // strides[i])
            total = max(0, (out - 1) * strides[i] + (kernel[i] - 1) * dilations[i] + 1 - spatial[i])
            begin = total // 2 if auto == "SAME_UPPER" else total - total // 2
            pads[i], pads[i + 2] = begin, total - begin
    return strides, pads, dilations


def _window_args(geometry: tuple[list[int], ...]) -> tuple[list[int], list[tuple[int, int]], list[int]]:
    """(strides, (begin, end) pads, dilations) of a 2-d ONNX geometry, for the shared window kernels."""
    strides, pads, dilations = geometry
    return strides, [(pads[0], pads[2]), (pads[1], pads[3])], dilations


def _windows(x: np.ndarray, kernel: Sequence[int], geometry: tuple[list[int], ...], fill: Any) -> np.ndarray:
    """``(N, C, OH, OW, kh, kw)`` view of every window of the padded 4-d ``x``."""
    return sliding_windows(x, kernel, *_window_args(geometry), fill=fill)


def _conv2d(x: np.ndarray, w: np.ndarray, group: int, geometry: tuple[list[int], ...]) -> np.ndarray:
    """2-d convolution without bias: exact int64 for integers, float64 for floats."""
    return conv_accumulate(x, w, *_window_args(geometry), groups=group)


def _float_conv(node: onnx.NodeProto, inputs: list[Any], attrs: dict[str, Any]) -> list[_Value] | None:
    x, w = _array(inputs[0]), _array(inputs[1])
    if x.ndim != 4 or w.ndim != 4:
        return None
    geometry = _geometry(attrs, x.shape[2:], w.shape[2:])
    if geometry is None:
        return None
    out = _conv2d(x, w, int(attrs.get("group", 1)), geometry)
    if len(inputs) > 2 and inputs[2] is not None:
        out = out + _array(inputs[2]).astype(np.float64).reshape(1, -1, 1, 1)
    return [out.astype(x.dtype)]


def _transpose_geometry(
    attrs: dict[str, Any], spatial: Sequence[int], kernel: Sequence[int]
) -> tuple[list[int], list[tuple[int, int]], list[int], list[int]] | None:
    """(strides, (begin, end) pads, dilations, output padding) of a ConvTranspose, as ONNX defines them.

    ``output_shape`` (or ``auto_pad`` SAME_*, which asks for ``input * stride``) sets the pads:
    ``total = stride * (input - 1) + output_padding + dilation * (kernel - 1) + 1 - output_shape``,
    the odd one at the end for SAME_UPPER, at the beginning otherwise. ``None`` where the attributes do not fit.
    """
    dims = len(spatial)
    strides = list(attrs.get("strides", [1] * dims))
    dilations = list(attrs.get("dilations", [1] * dims))
    extra = list(attrs.get("output_padding", [0] * dims))
    pads = list(attrs.get("pads", [0] * (2 * dims)))
    auto = attrs.get("auto_pad", b"NOTSET")
    auto = auto.decode() if isinstance(auto, bytes) else auto
    shape = list(attrs.get("output_shape", []))
    if auto in ("SAME_UPPER", "SAME_LOWER") and not shape:
        shape = [size * stride for size, stride in zip(spatial, strides, strict=False)]
    if any(len(v) != dims for v in (kernel, strides, dilations, extra)) or len(pads) != 2 * dims:
        return None
    if shape:
        if len(shape) != dims:
            return None
        for i in range(dims):
            total = strides[i] * (spatial[i] - 1) + extra[i] + dilations[i] * (kernel[i] - 1) + 1 - shape[i]
            small, large = total // 2, total - total // 2
            pads[i], pads[i + dims] = (small, large) if auto == "SAME_UPPER" else (large, small)
    elif auto == "VALID":
        pads = [0] * (2 * dims)
    if min(pads) < 0 or min(extra) < 0:
        return None
    return strides, [(pads[i], pads[i + dims]) for i in range(dims)], dilations, extra


def _conv_transpose(
    x: np.ndarray, w: np.ndarray, group: int, geometry: tuple[list[int], list[tuple[int, int]], list[int], list[int]]
) -> np.ndarray | None:
    """N-d transposed convolution without bias: exact int64 for integers, float64 for floats.

    The unpadded result (every input sample spread over its window), ``output_padding`` zeros added
    at the end, the pads cut off both ends; ``None`` where the channels do not fit ``group``.
    """
    strides, pads, dilations, extra = geometry
    if x.shape[1] != w.shape[0] or w.shape[0] % group:
        return None
    full = conv_transpose_accumulate(x, w, strides, 0, 0, dilations, group)
    full = np.pad(full, [(0, 0), (0, 0), *[(0, e) for e in extra]])
    if any(begin + end >= size for (begin, end), size in zip(pads, full.shape[2:], strict=True)):
        return None
    return full[
        (
            slice(None),
            slice(None),
            *[slice(begin, size - end) for (begin, end), size in zip(pads, full.shape[2:], strict=True)],
        )
    ]


def _float_conv_transpose(node: onnx.NodeProto, inputs: list[Any], attrs: dict[str, Any]) -> list[_Value] | None:
    x, w = _array(inputs[0]), _array(inputs[1])
    geometry = _transpose_geometry(attrs, x.shape[2:], w.shape[2:]) if x.ndim == w.ndim >= 3 else None
    out = None if geometry is None else _conv_transpose(x, w, int(attrs.get("group", 1)), geometry)
    if out is None:
        return None
    if len(inputs) > 2 and inputs[2] is not None:
        out = out + _array(inputs[2]).astype(np.float64).reshape(1, -1, *[1] * (x.ndim - 2))
    return [out.astype(x.dtype)]


_FLOAT_KERNELS: dict[str, Callable[[onnx.NodeProto, list[Any], dict[str, Any]], list[_Value] | None]] = {
    "Conv": _float_conv,
    "ConvTranspose": _float_conv_transpose,
}  # this module's own float kernels, where onnx.reference is slow (Conv) or wrong (grouped ConvTranspose)


# -- integer kernels --------------------------------------------------------------------------
def _accumulator(acc: np.ndarray, scale: np.ndarray, bias: _Value | None, bias_shape: tuple[int, ...]) -> _Quant:
    """The int32 accumulator plus the bias quantized to its scale (round half to even)."""
    acc = np.asarray(acc, np.int64)  # exact integers (see the module notes)
    if bias is not None:  # a DQ'd int32 bias on this scale comes back exactly (below 2**24)
        acc = acc + quantize_bias(np.asarray(_array(bias)).reshape(-1), scale.reshape(-1)).reshape(bias_shape)
    return _Quant(
        acc, scale.reshape(bias_shape) if scale.size > 1 else scale.reshape(()), np.zeros((), np.int64), wide=True
    )


def _int_conv(node: onnx.NodeProto, inputs: list[Any], attrs: dict[str, Any], ctx: _Context) -> list[_Value] | None:
    x, w = inputs[0], inputs[1]
    if not (isinstance(x, _Quant) and isinstance(w, _Quant) and x.narrow and w.narrow):
        return None
    if x.q.ndim != 4 or w.q.ndim != 4 or not x.scalar_params() or not w.varies_only_on([0]):
        return None
    geometry = _geometry(attrs, x.q.shape[2:], w.q.shape[2:])
    if geometry is None:
        return None
    group = int(attrs.get("group", 1))
    acc = _conv2d(x.centered(), w.centered(), group, geometry)
    if ctx.apply or ctx.record:
        args = _window_args(geometry)
        acc = ctx.saturate(
            node, acc, x, w, lambda raw, fill, layout: conv_saturation_correction(raw, w.q, *args, group, fill, layout)
        )
    out_c = w.q.shape[0]
    scale = np.broadcast_to(x.scale.reshape(()) * w.scale.reshape(-1), (out_c,))
    bias = inputs[2] if len(inputs) > 2 else None
    return [_accumulator(acc, scale, bias, (1, out_c, 1, 1))]


def _int_conv_transpose(
    node: onnx.NodeProto, inputs: list[Any], attrs: dict[str, Any], ctx: _Context
) -> list[_Value] | None:
    """ConvTranspose of integers: exact accumulation; weights per tensor or per output channel of a group (axis 1)."""
    x, w = inputs[0], inputs[1]
    if not (isinstance(x, _Quant) and isinstance(w, _Quant) and x.narrow and w.narrow):
        return None
    if x.q.ndim < 3 or w.q.ndim != x.q.ndim or not x.scalar_params() or not w.varies_only_on([1]):
        return None
    geometry = _transpose_geometry(attrs, x.q.shape[2:], w.q.shape[2:])
    group = int(attrs.get("group", 1))
    acc = None if geometry is None else _conv_transpose(x.centered(), w.centered(), group, geometry)
    if acc is None:
        return None
    out_c = acc.shape[1]  # channel g * (out_c / group) + k has the weight scale of column k
    per_column = np.tile(w.scale.reshape(-1), group) if w.scale.size > 1 else w.scale.reshape(-1)
    scale = np.broadcast_to(x.scale.reshape(()) * per_column, (out_c,))
    bias = inputs[2] if len(inputs) > 2 else None
    return [_accumulator(acc, scale, bias, (1, out_c, *[1] * (acc.ndim - 2)))]


def _int_gemm(node: onnx.NodeProto, inputs: list[Any], attrs: dict[str, Any], ctx: _Context) -> list[_Value] | None:
    a, b = inputs[0], inputs[1]
    if not (isinstance(a, _Quant) and isinstance(b, _Quant) and a.narrow and b.narrow):
        return None
    if a.q.ndim != 2 or b.q.ndim != 2 or attrs.get("alpha", 1.0) != 1.0 or attrs.get("beta", 1.0) != 1.0:
        return None
    trans_b = bool(attrs.get("transB", 0))
    if not a.scalar_params() or not b.varies_only_on([0 if trans_b else 1]):
        return None
    left = a.centered().T if attrs.get("transA", 0) else a.centered()
    right = b.centered().T if trans_b else b.centered()
    if left.shape[1] != right.shape[0]:
        return None  # let the float reference report the shapes
    n = right.shape[1]
    scale = np.broadcast_to(a.scale.reshape(()) * b.scale.reshape(-1), (n,))
    acc = exact_matmul(left, right)
    if ctx.apply or ctx.record:
        raw_right = b.q.T if trans_b else b.q
        transpose = bool(attrs.get("transA", 0))
        acc = ctx.saturate(
            node,
            acc,
            a,
            b,
            lambda raw, fill, layout: _matmul_correction(raw.T if transpose else raw, raw_right, layout),
        )
    bias = inputs[2] if len(inputs) > 2 else None
    if bias is not None and int(np.prod(np.shape(_array(bias)))) not in (1, n):
        return None  # a full (M, N) bias: keep it simple, run in float
    if bias is not None and int(np.prod(np.shape(_array(bias)))) == 1:
        bias = np.full(n, _array(bias).reshape(-1)[0])
    return [_accumulator(acc, scale, bias, (1, n))]


def _int_matmul(node: onnx.NodeProto, inputs: list[Any], attrs: dict[str, Any], ctx: _Context) -> list[_Value] | None:
    a, b = inputs
    if not (isinstance(a, _Quant) and isinstance(b, _Quant) and a.narrow and b.narrow):
        return None
    if a.q.ndim < 2 or b.q.ndim < 2 or not a.scalar_params():
        return None
    if not (b.scalar_params() or (b.q.ndim == 2 and b.varies_only_on([1]))):
        return None
    acc = exact_matmul(a.centered(), b.centered())
    if ctx.apply or ctx.record:
        acc = ctx.saturate(node, acc, a, b, lambda raw, fill, layout: _matmul_correction(raw, b.q, layout))
    return [_Quant(acc, a.scale * b.scale, np.zeros((), np.int64), wide=True)]


def _matmul_correction(left: np.ndarray, right: np.ndarray, layout: str) -> np.ndarray:
    """Pair saturation's correction of ``left @ right`` (NumPy's batched semantics): pairs along the reduction."""
    if right.ndim == 2:
        rows = left.reshape(-1, 1, left.shape[-1])
        correction = pair_saturation_correction(rows, right[None], layout)
        return correction.reshape(*left.shape[:-1], right.shape[-1])
    if left.ndim == 1 or right.ndim == 1:
        raise ValueError("a batched product with a vector operand has no pair-saturation model")
    batch = np.broadcast_shapes(left.shape[:-2], right.shape[:-2])
    lefts = np.broadcast_to(left, (*batch, *left.shape[-2:])).reshape(-1, *left.shape[-2:])
    rights = np.broadcast_to(right, (*batch, *right.shape[-2:])).reshape(-1, *right.shape[-2:])
    blocks = [_matmul_correction(a, b, layout) for a, b in zip(lefts, rights, strict=True)]
    return np.stack(blocks).reshape(*batch, left.shape[-2], right.shape[-1])


def _int_add(node: onnx.NodeProto, inputs: list[Any], attrs: dict[str, Any], ctx: _Context) -> list[_Value] | None:
    a, b = inputs
    if node.op_type == "Add" and isinstance(a, _Quant) != isinstance(b, _Quant):
        return _add_to_accumulator(*((a, b) if isinstance(a, _Quant) else (b, a)))
    if not (isinstance(a, _Quant) and isinstance(b, _Quant) and a.narrow and b.narrow):
        return None
    if node.op_type == "Mul":
        return [_Quant(a.centered() * b.centered(), a.scale * b.scale, np.zeros((), np.int64), wide=True)]
    # both to the common scale 2 * max(scales) * 2**-ADD_FRACTION_BITS, then add
    total, scale = add_rescale(a.centered(), a.scale, b.centered(), b.scale, ctx.rounding, node.op_type == "Sub")
    return [_Quant(total, np.asarray(scale), np.zeros((), np.int64), wide=True)]


def _add_to_accumulator(acc: _Quant, other: np.ndarray) -> list[_Value] | None:
    """An accumulator plus a float tensor (the bias after a MatMul): the addend rounded to its grid, half to even."""
    if not acc.wide or acc.clamps or np.any(acc.zero_point != 0) or other.dtype.kind != "f":
        return None
    if np.broadcast_shapes(acc.q.shape, other.shape) != acc.q.shape:
        return None
    with np.errstate(all="ignore"):
        total = acc.q + np.rint(other.astype(np.float64) / acc.scale)
    if not np.all(np.isfinite(total)) or total.min() < INT32_RANGE[0] or total.max() > INT32_RANGE[1]:
        return None
    return [replace(acc, q=total.astype(np.int64))]


def _transpose(node: onnx.NodeProto, inputs: list[Any], attrs: dict[str, Any], ctx: _Context) -> list[_Value] | None:
    """Transpose of integers; per-axis parameters move with their axis."""
    x = inputs[0]
    if not isinstance(x, _Quant):
        return None
    rank = x.q.ndim
    perm = list(attrs.get("perm", range(rank - 1, -1, -1)))
    params = [x.scale, x.zero_point] + [b for pair in x.clamps for b in pair]
    if any(p.size != 1 and p.ndim != rank for p in params):
        return None
    moved = [p if p.ndim != rank else np.transpose(p, perm) for p in params]
    clamps = tuple((moved[i], moved[i + 1]) for i in range(2, len(moved), 2))
    return [replace(x, q=np.transpose(x.q, perm), scale=moved[0], zero_point=moved[1], clamps=clamps)]


def _clamp(node: onnx.NodeProto, inputs: list[Any], attrs: dict[str, Any], ctx: _Context) -> list[_Value] | None:
    x = inputs[0]
    if not isinstance(x, _Quant):
        return None
    inf = np.asarray(np.inf, np.float32)
    if node.op_type == "Relu":
        bounds = (np.zeros((), np.float32), inf)
    elif node.op_type == "Clip":
        lo = inputs[1] if len(inputs) > 1 and inputs[1] is not None else attrs.get("min", -np.inf)
        hi = inputs[2] if len(inputs) > 2 and inputs[2] is not None else attrs.get("max", np.inf)
        if isinstance(lo, _Quant) or isinstance(hi, _Quant):
            return None
        bounds = (np.asarray(lo, np.float32).reshape(()), np.asarray(hi, np.float32).reshape(()))
    else:  # Max / Min with one constant operand
        if len(inputs) != 2 or isinstance(inputs[1], _Quant):
            return None
        other = np.asarray(inputs[1], np.float32)
        if np.broadcast_shapes(x.q.shape, other.shape) != x.q.shape:
            return None
        bounds = (other, inf) if node.op_type == "Max" else (-inf, other)
    return [replace(x, clamps=(*x.clamps, bounds))]


def _int_pool(node: onnx.NodeProto, inputs: list[Any], attrs: dict[str, Any], ctx: _Context) -> list[_Value] | None:
    x = inputs[0]
    if not isinstance(x, _Quant) or x.q.ndim < 3 or not x.varies_only_on([0, 1]):
        return None
    if node.op_type == "GlobalAveragePool":
        if not x.narrow:
            return None
        spatial = tuple(range(2, x.q.ndim))
        total = x.centered().sum(axis=spatial, keepdims=True)
        count = int(np.prod(x.q.shape[2:]))
        return [_Quant(total, x.scale / count, np.zeros((), np.int64), wide=True)]
    kernel = list(attrs.get("kernel_shape", []))
    geometry = _geometry(attrs, x.q.shape[2:], kernel)
    if geometry is None or attrs.get("ceil_mode", 0) or (len(node.output) > 1 and node.output[1]):
        return None
    if node.op_type == "MaxPool":  # max commutes with a positive scale and with clamps
        lowest = np.iinfo(np.int64).min
        return [replace(x, q=_windows(x.q, kernel, geometry, lowest).max(axis=(-2, -1)))]
    if not x.narrow or (any(geometry[1]) and not attrs.get("count_include_pad", 0)):
        return None
    total = _windows(x.centered(), kernel, geometry, 0).sum(axis=(-2, -1))
    return [_Quant(total, x.scale / (kernel[0] * kernel[1]), np.zeros((), np.int64), wide=True)]


def _concat(node: onnx.NodeProto, inputs: list[Any], attrs: dict[str, Any], ctx: _Context) -> list[_Value] | None:
    first = inputs[0]
    if not all(isinstance(v, _Quant) and v.scalar_params() for v in inputs):
        return None
    for v in inputs[1:]:
        if v.wide != first.wide or v.scale != first.scale or v.zero_point != first.zero_point:
            return None
        if len(v.clamps) != len(first.clamps) or any(
            p[0] != q[0] or p[1] != q[1] for p, q in zip(v.clamps, first.clamps, strict=True)
        ):
            return None
    return [replace(first, q=np.concatenate([v.q for v in inputs], axis=int(attrs["axis"])))]


def _quantize(node: onnx.NodeProto, inputs: list[Any], attrs: dict[str, Any], ctx: _Context) -> list[_Value] | None:
    x, scale = inputs[0], _array(inputs[1])
    zero = _array(inputs[2]) if len(inputs) > 2 and inputs[2] is not None else np.zeros((), np.uint8)
    if attrs.get("block_size", 0) or not np.issubdtype(zero.dtype, np.integer) or "output_dtype" in attrs:
        return None
    rank = x.q.ndim if isinstance(x, _Quant) else np.ndim(x)
    axis = int(attrs.get("axis", 1))
    scale_b, zero_b = _param(scale, axis, rank), _param(zero, axis, rank).astype(np.int64)
    info = np.iinfo(zero.dtype)
    if isinstance(x, _Quant):
        y = _requantize_value(x, scale_b, zero_b, int(info.min), int(info.max), ctx.rounding)
    else:
        y = np.clip(round_to_grid(x, scale_b, zero_b), info.min, info.max)
    return [y.astype(zero.dtype)]


def _dequantize(node: onnx.NodeProto, inputs: list[Any], attrs: dict[str, Any], ctx: _Context) -> list[_Value] | None:
    q, scale = inputs[0], _array(inputs[1])
    zero = _array(inputs[2]) if len(inputs) > 2 and inputs[2] is not None else np.zeros((), np.int64)
    if isinstance(q, _Quant) or not np.issubdtype(q.dtype, np.integer) or attrs.get("block_size", 0):
        return None
    if not np.issubdtype(zero.dtype, np.integer) or scale.dtype.kind != "f":
        return None
    axis = int(attrs.get("axis", 1))
    scale_b = _param(scale, axis, q.ndim).astype(np.float64)
    zero_b = _param(zero, axis, q.ndim).astype(np.int64)
    signed = bool(np.issubdtype(q.dtype, np.signedinteger))
    wide, constant = q.dtype.itemsize > 1, node.input[0] in ctx.constants
    return [_Quant(q.astype(np.int64), scale_b, zero_b, wide=wide, dtype=scale.dtype, signed=signed, constant=constant)]


def _shape_op(node: onnx.NodeProto, inputs: list[Any], attrs: dict[str, Any], ctx: _Context) -> list[_Value] | None:
    """A data-movement op on the integers themselves (per-tensor parameters only)."""
    x = inputs[0]
    if not isinstance(x, _Quant) or not x.scalar_params() or any(isinstance(v, _Quant) for v in inputs[1:]):
        return None
    return [replace(x, q=r) for r in _run_float(node, [x.q, *inputs[1:]], ctx.opsets)]


_HANDLERS: dict[str, _Handler] = {
    "QuantizeLinear": _quantize, "DequantizeLinear": _dequantize, "Conv": _int_conv, "Gemm": _int_gemm,
    "MatMul": _int_matmul, "Concat": _concat, "Transpose": _transpose, "ConvTranspose": _int_conv_transpose,
    **dict.fromkeys(("Add", "Sub", "Mul"), _int_add), **dict.fromkeys(("Relu", "Clip", "Max", "Min"), _clamp),
    **dict.fromkeys(("MaxPool", "AveragePool", "GlobalAveragePool"), _int_pool),
    **dict.fromkeys(_SHAPE_OPS, _shape_op),
}  # fmt: skip


def _int32(node: onnx.NodeProto, inputs: list[Any], value: _Quant, ctx: _Context) -> _Quant:
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
        if isinstance(v, _Quant) and not v.wide
    ]
    name = node.name or node.output[0]
    message = (
        f"node {name!r} ({node.op_type}): its int32 accumulator reaches {low}..{high}, a {bits}-bit value, on the "
        f"scale {float(np.min(value.scale)):.3g} (the operands' scales: {', '.join(operands) or 'none'}); "
        f"the integer reference saturates it at int32, so {node.output[0]!r} and what it feeds differ from the "
        "simulation. A scale this small against the values (or the bias) usually comes from a calibration that "
        "saw a zero range, e.g. all-zero data: calibrate on representative inputs."
    )
    ctx.overflows[name] = message
    warnings.warn(message, AccumulatorOverflowWarning, stacklevel=4)
    return replace(value, q=np.clip(value.q, *INT32_RANGE))


def run_reference(
    qdq_model: onnx.ModelProto,
    inputs: Mapping[str, np.ndarray],
    outputs: Sequence[str] | None = None,
    rounding: str = "half_up",
    saturation: PairSaturation | None = None,
) -> dict[str, np.ndarray]:
    """Run a Q/DQ model the way integer hardware does; return the requested tensors (graph outputs by default).

    Any tensor of the model may be requested: a QuantizeLinear output comes back as its
    integers, a DequantizeLinear output as ``scale * (q - zero_point)`` in float32, the output
    of a Conv / Gemm / MatMul / Add recognized as integer as its accumulator's real value
    (``acc * x_scale * w_scale``). Inputs are cast to the model's declared element types.
    ``rounding`` settles exact ties in the fixed-point requantization (see :func:`requantize`);
    ``"half_even"`` reproduces the float graph's ties, the default ``"half_up"`` the usual hardware.
    ``saturation`` (a :class:`~mqbench.nn.quantized.saturation.PairSaturation`) computes the
    integer convolutions and matrix products as a CPU without VNNI does, with 16-bit pair sums.
    """
    env, _ = _execute(qdq_model, inputs, outputs, _Context(rounding, (), saturation))
    return env


def saturated_layers(
    qdq_model: onnx.ModelProto,
    inputs: Mapping[str, np.ndarray],
    saturations: Sequence[PairSaturation],
    outputs: Sequence[str] = (),
    rounding: str = "half_even",
) -> tuple[dict[str, dict[str, float]], dict[str, np.ndarray]]:
    """Where CPUs without VNNI would compute this deployment differently: a prediction on any host.

    One exact run of the integer reference (its ``outputs`` are returned too) that records, for each
    kernel model in ``saturations`` (see :mod:`mqbench.nn.quantized.saturation`), the nodes whose
    accumulator 16-bit pair saturation would change on these inputs: ``{runtime: {node: fraction}}``.
    """
    ctx = _Context(rounding, (), None, tuple(saturations))
    env, ctx = _execute(qdq_model, inputs, outputs, ctx)
    return {model.runtime: dict(ctx.saturated.get(model.runtime, {})) for model in saturations}, env


def _execute(
    qdq_model: onnx.ModelProto,
    inputs: Mapping[str, np.ndarray],
    outputs: Sequence[str] | None,
    ctx: _Context,
) -> tuple[dict[str, np.ndarray], _Context]:
    if ctx.rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {ctx.rounding!r}")
    graph = qdq_model.graph
    constants = {init.name for init in graph.initializer} - {value.name for value in graph.input}
    for node in graph.node:  # what is computed from constants alone (a weight's Q -> DQ) is constant too
        if all(name in constants for name in node.input if name):
            constants.update(name for name in node.output if name)
    ctx = replace(ctx, opsets=list(qdq_model.opset_import), constants=frozenset(constants))
    env: dict[str, _Value] = {init.name: numpy_helper.to_array(init) for init in graph.initializer}
    for value in graph.input:
        if value.name in inputs:
            dtype = helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type)
            env[value.name] = np.asarray(inputs[value.name], dtype)
        elif value.name not in env:
            raise ValueError(f"missing input {value.name!r}; the model reads {[v.name for v in graph.input]}")
    unknown = sorted(set(inputs) - {v.name for v in graph.input})
    if unknown:
        raise ValueError(f"inputs {unknown} are not inputs of the model")
    wanted = list(outputs) if outputs is not None else [v.name for v in graph.output]
    produced = set(env) | {name for node in graph.node for name in node.output if name}
    missing = [name for name in wanted if name not in produced]
    if missing:
        raise ValueError(f"the model has no tensors named {missing[:5]}")
    for node in graph.node:
        if node.domain not in ("", "ai.onnx"):
            raise ValueError(f"node {node.name!r} is in domain {node.domain!r}; only standard ONNX ops run")
        for name in node.input:
            if name and name not in env:
                raise ValueError(f"node {node.name!r} reads {name!r} before anything produces it")
        args: list[Any] = [env[name] if name else None for name in node.input]
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        handler = _HANDLERS.get(node.op_type)
        results: list[_Value] | None = handler(node, args, attrs, ctx) if handler is not None else None
        if node.op_type == "Identity":
            results = [args[0]]
        if results is None and node.op_type in _FLOAT_KERNELS:
            results = _FLOAT_KERNELS[node.op_type](node, args, attrs)
        if results is None:
            results = list(_run_float(node, args, ctx.opsets))
        for i, result in enumerate(results):
            if isinstance(result, _Quant) and result.wide:
                results[i] = _int32(node, args, result, ctx)
        for name, result in zip(node.output, results, strict=True):
            if name:
                env[name] = result
    return {name: _array(env[name]) for name in wanted}, ctx
