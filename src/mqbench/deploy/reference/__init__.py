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

Everything else is dequantized and run in float with ``onnx.reference`` (Conv and ConvTranspose by
:mod:`~mqbench.deploy.reference.windows` in float64, Resize by :mod:`~mqbench.deploy.reference.resize`
as ONNX defines it), and quantized again at the next QuantizeLinear.

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
scales and the usual cause (a scale at its floor, from a calibration that saw a near-zero range): what
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

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from mqbench.deploy.reference.values import (
    AccumulatorOverflowWarning,
    Context,
    Quant,
    Value,
    accumulator,
    per_axis,
    requantize_value,
    run_float,
    saturate_int32,
    to_array,
)
from mqbench.deploy.reference.windows import (
    FLOAT_KERNELS,
    conv2d,
    conv_transpose,
    transpose_geometry,
    window_args,
    window_geometry,
    window_view,
)
from mqbench.nn.quantized.functional import (
    ADD_FRACTION_BITS,
    INT32_RANGE,
    ROUNDINGS,
    add_rescale,
    exact_matmul,
    requantize,
    requantize_multiplier,
    round_to_grid,
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


_SHAPE_OPS = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Slice", "Expand", "Tile"})


_Handler = Callable[[onnx.NodeProto, list[Any], dict[str, Any], Context], "list[Value] | None"]


def _int_conv(node: onnx.NodeProto, inputs: list[Any], attrs: dict[str, Any], ctx: Context) -> list[Value] | None:
    x, w = inputs[0], inputs[1]
    if not (isinstance(x, Quant) and isinstance(w, Quant) and x.narrow and w.narrow):
        return None
    if x.q.ndim != 4 or w.q.ndim != 4 or not x.scalar_params() or not w.varies_only_on([0]):
        return None
    geometry = window_geometry(attrs, x.q.shape[2:], w.q.shape[2:])
    if geometry is None:
        return None
    group = int(attrs.get("group", 1))
    acc = conv2d(x.centered(), w.centered(), group, geometry)
    if ctx.apply or ctx.record:
        args = window_args(geometry)
        acc = ctx.saturate(
            node, acc, x, w, lambda raw, fill, layout: conv_saturation_correction(raw, w.q, *args, group, fill, layout)
        )
    out_c = w.q.shape[0]
    scale = np.broadcast_to(x.scale.reshape(()) * w.scale.reshape(-1), (out_c,))
    bias = inputs[2] if len(inputs) > 2 else None
    return [accumulator(acc, scale, bias, (1, out_c, 1, 1))]


def _int_conv_transpose(
    node: onnx.NodeProto, inputs: list[Any], attrs: dict[str, Any], ctx: Context
) -> list[Value] | None:
    """ConvTranspose of integers: exact accumulation; weights per tensor or per output channel of a group (axis 1)."""
    x, w = inputs[0], inputs[1]
    if not (isinstance(x, Quant) and isinstance(w, Quant) and x.narrow and w.narrow):
        return None
    if x.q.ndim < 3 or w.q.ndim != x.q.ndim or not x.scalar_params() or not w.varies_only_on([1]):
        return None
    geometry = transpose_geometry(attrs, x.q.shape[2:], w.q.shape[2:])
    group = int(attrs.get("group", 1))
    acc = None if geometry is None else conv_transpose(x.centered(), w.centered(), group, geometry)
    if acc is None:
        return None
    out_c = acc.shape[1]  # channel g * (out_c / group) + k has the weight scale of column k
    per_column = np.tile(w.scale.reshape(-1), group) if w.scale.size > 1 else w.scale.reshape(-1)
    scale = np.broadcast_to(x.scale.reshape(()) * per_column, (out_c,))
    bias = inputs[2] if len(inputs) > 2 else None
    return [accumulator(acc, scale, bias, (1, out_c, *[1] * (acc.ndim - 2)))]


def _int_gemm(node: onnx.NodeProto, inputs: list[Any], attrs: dict[str, Any], ctx: Context) -> list[Value] | None:
    a, b = inputs[0], inputs[1]
    if not (isinstance(a, Quant) and isinstance(b, Quant) and a.narrow and b.narrow):
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
    if bias is not None and int(np.prod(np.shape(to_array(bias)))) not in (1, n):
        return None  # a full (M, N) bias: keep it simple, run in float
    if bias is not None and int(np.prod(np.shape(to_array(bias)))) == 1:
        bias = np.full(n, to_array(bias).reshape(-1)[0])
    return [accumulator(acc, scale, bias, (1, n))]


def _int_matmul(node: onnx.NodeProto, inputs: list[Any], attrs: dict[str, Any], ctx: Context) -> list[Value] | None:
    a, b = inputs
    if not (isinstance(a, Quant) and isinstance(b, Quant) and a.narrow and b.narrow):
        return None
    if a.q.ndim < 2 or b.q.ndim < 2 or not a.scalar_params():
        return None
    if not (b.scalar_params() or (b.q.ndim == 2 and b.varies_only_on([1]))):
        return None
    acc = exact_matmul(a.centered(), b.centered())
    if ctx.apply or ctx.record:
        acc = ctx.saturate(node, acc, a, b, lambda raw, fill, layout: _matmul_correction(raw, b.q, layout))
    return [Quant(acc, a.scale * b.scale, np.zeros((), np.int64), wide=True)]


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


def _int_add(node: onnx.NodeProto, inputs: list[Any], attrs: dict[str, Any], ctx: Context) -> list[Value] | None:
    a, b = inputs
    if node.op_type == "Add" and isinstance(a, Quant) != isinstance(b, Quant):
        return _add_to_accumulator(*((a, b) if isinstance(a, Quant) else (b, a)))
    if not (isinstance(a, Quant) and isinstance(b, Quant) and a.narrow and b.narrow):
        return None
    if node.op_type == "Mul":
        return [Quant(a.centered() * b.centered(), a.scale * b.scale, np.zeros((), np.int64), wide=True)]
    # both to the common scale 2 * max(scales) * 2**-ADD_FRACTION_BITS, then add
    total, scale = add_rescale(a.centered(), a.scale, b.centered(), b.scale, ctx.rounding, node.op_type == "Sub")
    return [Quant(total, np.asarray(scale), np.zeros((), np.int64), wide=True)]


def _add_to_accumulator(acc: Quant, other: np.ndarray) -> list[Value] | None:
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


def _transpose(node: onnx.NodeProto, inputs: list[Any], attrs: dict[str, Any], ctx: Context) -> list[Value] | None:
    """Transpose of integers; per-axis parameters move with their axis."""
    x = inputs[0]
    if not isinstance(x, Quant):
        return None
    rank = x.q.ndim
    perm = list(attrs.get("perm", range(rank - 1, -1, -1)))
    params = [x.scale, x.zero_point] + [b for pair in x.clamps for b in pair]
    if any(p.size != 1 and p.ndim != rank for p in params):
        return None
    moved = [p if p.ndim != rank else np.transpose(p, perm) for p in params]
    clamps = tuple((moved[i], moved[i + 1]) for i in range(2, len(moved), 2))
    return [replace(x, q=np.transpose(x.q, perm), scale=moved[0], zero_point=moved[1], clamps=clamps)]


def _clamp(node: onnx.NodeProto, inputs: list[Any], attrs: dict[str, Any], ctx: Context) -> list[Value] | None:
    x = inputs[0]
    if not isinstance(x, Quant):
        return None
    inf = np.asarray(np.inf, np.float32)
    if node.op_type == "Relu":
        bounds = (np.zeros((), np.float32), inf)
    elif node.op_type == "Clip":
        lo = inputs[1] if len(inputs) > 1 and inputs[1] is not None else attrs.get("min", -np.inf)
        hi = inputs[2] if len(inputs) > 2 and inputs[2] is not None else attrs.get("max", np.inf)
        if isinstance(lo, Quant) or isinstance(hi, Quant):
            return None
        bounds = (np.asarray(lo, np.float32).reshape(()), np.asarray(hi, np.float32).reshape(()))
    else:  # Max / Min with one constant operand
        if len(inputs) != 2 or isinstance(inputs[1], Quant):
            return None
        other = np.asarray(inputs[1], np.float32)
        if np.broadcast_shapes(x.q.shape, other.shape) != x.q.shape:
            return None
        bounds = (other, inf) if node.op_type == "Max" else (-inf, other)
    return [replace(x, clamps=(*x.clamps, bounds))]


def _int_pool(node: onnx.NodeProto, inputs: list[Any], attrs: dict[str, Any], ctx: Context) -> list[Value] | None:
    x = inputs[0]
    if not isinstance(x, Quant) or x.q.ndim < 3 or not x.varies_only_on([0, 1]):
        return None
    if node.op_type == "GlobalAveragePool":
        if not x.narrow:
            return None
        spatial = tuple(range(2, x.q.ndim))
        total = x.centered().sum(axis=spatial, keepdims=True)
        count = int(np.prod(x.q.shape[2:]))
        return [Quant(total, x.scale / count, np.zeros((), np.int64), wide=True)]
    kernel = list(attrs.get("kernel_shape", []))
    geometry = window_geometry(attrs, x.q.shape[2:], kernel)
    if geometry is None or attrs.get("ceil_mode", 0) or (len(node.output) > 1 and node.output[1]):
        return None
    if node.op_type == "MaxPool":  # max commutes with a positive scale and with clamps
        lowest = np.iinfo(np.int64).min
        return [replace(x, q=window_view(x.q, kernel, geometry, lowest).max(axis=(-2, -1)))]
    if not x.narrow or (any(geometry[1]) and not attrs.get("count_include_pad", 0)):
        return None
    total = window_view(x.centered(), kernel, geometry, 0).sum(axis=(-2, -1))
    return [Quant(total, x.scale / (kernel[0] * kernel[1]), np.zeros((), np.int64), wide=True)]


def _concat(node: onnx.NodeProto, inputs: list[Any], attrs: dict[str, Any], ctx: Context) -> list[Value] | None:
    first = inputs[0]
    if not all(isinstance(v, Quant) and v.scalar_params() for v in inputs):
        return None
    for v in inputs[1:]:
        if v.wide != first.wide or v.scale != first.scale or v.zero_point != first.zero_point:
            return None
        if len(v.clamps) != len(first.clamps) or any(
            p[0] != q[0] or p[1] != q[1] for p, q in zip(v.clamps, first.clamps, strict=True)
        ):
            return None
    return [replace(first, q=np.concatenate([v.q for v in inputs], axis=int(attrs["axis"])))]


def _quantize(node: onnx.NodeProto, inputs: list[Any], attrs: dict[str, Any], ctx: Context) -> list[Value] | None:
    x, scale = inputs[0], to_array(inputs[1])
    zero = to_array(inputs[2]) if len(inputs) > 2 and inputs[2] is not None else np.zeros((), np.uint8)
    if attrs.get("block_size", 0) or not np.issubdtype(zero.dtype, np.integer) or "output_dtype" in attrs:
        return None
    rank = x.q.ndim if isinstance(x, Quant) else np.ndim(x)
    axis = int(attrs.get("axis", 1))
    scale_b, zero_b = per_axis(scale, axis, rank), per_axis(zero, axis, rank).astype(np.int64)
    info = np.iinfo(zero.dtype)
    if isinstance(x, Quant):
        y = requantize_value(x, scale_b, zero_b, int(info.min), int(info.max), ctx.rounding)
    else:
        y = np.clip(round_to_grid(x, scale_b, zero_b), info.min, info.max)
    return [y.astype(zero.dtype)]


def _dequantize(node: onnx.NodeProto, inputs: list[Any], attrs: dict[str, Any], ctx: Context) -> list[Value] | None:
    q, scale = inputs[0], to_array(inputs[1])
    zero = to_array(inputs[2]) if len(inputs) > 2 and inputs[2] is not None else np.zeros((), np.int64)
    if isinstance(q, Quant) or not np.issubdtype(q.dtype, np.integer) or attrs.get("block_size", 0):
        return None
    if not np.issubdtype(zero.dtype, np.integer) or scale.dtype.kind != "f":
        return None
    axis = int(attrs.get("axis", 1))
    scale_b = per_axis(scale, axis, q.ndim).astype(np.float64)
    zero_b = per_axis(zero, axis, q.ndim).astype(np.int64)
    signed = bool(np.issubdtype(q.dtype, np.signedinteger))
    wide, constant = q.dtype.itemsize > 1, node.input[0] in ctx.constants
    return [Quant(q.astype(np.int64), scale_b, zero_b, wide=wide, dtype=scale.dtype, signed=signed, constant=constant)]


def _shape_op(node: onnx.NodeProto, inputs: list[Any], attrs: dict[str, Any], ctx: Context) -> list[Value] | None:
    """A data-movement op on the integers themselves (per-tensor parameters only)."""
    x = inputs[0]
    if not isinstance(x, Quant) or not x.scalar_params() or any(isinstance(v, Quant) for v in inputs[1:]):
        return None
    return [replace(x, q=r) for r in run_float(node, [x.q, *inputs[1:]], ctx.opsets)]


_HANDLERS: dict[str, _Handler] = {
    "QuantizeLinear": _quantize, "DequantizeLinear": _dequantize, "Conv": _int_conv, "Gemm": _int_gemm,
    "MatMul": _int_matmul, "Concat": _concat, "Transpose": _transpose, "ConvTranspose": _int_conv_transpose,
    **dict.fromkeys(("Add", "Sub", "Mul"), _int_add), **dict.fromkeys(("Relu", "Clip", "Max", "Min"), _clamp),
    **dict.fromkeys(("MaxPool", "AveragePool", "GlobalAveragePool"), _int_pool),
    **dict.fromkeys(_SHAPE_OPS, _shape_op),
}  # fmt: skip


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
    env, _ = _execute(qdq_model, inputs, outputs, Context(rounding, (), saturation))
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
    ctx = Context(rounding, (), None, tuple(saturations))
    env, ctx = _execute(qdq_model, inputs, outputs, ctx)
    return {model.runtime: dict(ctx.saturated.get(model.runtime, {})) for model in saturations}, env


def _execute(
    qdq_model: onnx.ModelProto,
    inputs: Mapping[str, np.ndarray],
    outputs: Sequence[str] | None,
    ctx: Context,
) -> tuple[dict[str, np.ndarray], Context]:
    if ctx.rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {ctx.rounding!r}")
    graph = qdq_model.graph
    constants = {init.name for init in graph.initializer} - {value.name for value in graph.input}
    for node in graph.node:  # what is computed from constants alone (a weight's Q -> DQ) is constant too
        if all(name in constants for name in node.input if name):
            constants.update(name for name in node.output if name)
    ctx = replace(ctx, opsets=list(qdq_model.opset_import), constants=frozenset(constants))
    env: dict[str, Value] = {init.name: numpy_helper.to_array(init) for init in graph.initializer}
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
        results: list[Value] | None = handler(node, args, attrs, ctx) if handler is not None else None
        if node.op_type == "Identity":
            results = [args[0]]
        if results is None and node.op_type in FLOAT_KERNELS:
            results = FLOAT_KERNELS[node.op_type](node, args, attrs)
        if results is None:
            results = list(run_float(node, args, ctx.opsets))
        for i, result in enumerate(results):
            if isinstance(result, Quant) and result.wide:
                results[i] = saturate_int32(node, args, result, ctx)
        for name, result in zip(node.output, results, strict=True):
            if name:
                env[name] = result
    return {name: to_array(env[name]) for name in wanted}, ctx
