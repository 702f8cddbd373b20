"""The integer operators of the QLinear form: one :data:`~mqbench.deploy.qlinear.converter.OperatorRule` per family.

Each rule checks everything first and then emits (through :meth:`Converter.emit`) the operator
onnxruntime runs on 8-bit integers: QLinearConv (int32 bias at scale ``x_scale * w_scale``), QGemm
(``com.microsoft``, alpha folded into B's scale, int32 bias) or QLinearMatMul, and from the
``com.microsoft`` domain QLinearAdd, QLinearMul, QLinearConcat, the pooling operators
QLinearGlobalAveragePool and QLinearAveragePool, and the lookup-table activations QLinearLeakyRelu
and QLinearSigmoid. :data:`OPERATOR_RULES` maps each float operator to its rule.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import numpy as np
import onnx

from mqbench.deploy.qlinear.converter import Converter, OperatorRule
from mqbench.deploy.qlinear.grid import Grid, Input, attributes

__all__ = ["OPERATOR_RULES"]

_Inputs = list[Input | None]


def _conv(converter: Converter, node: onnx.NodeProto, inputs: _Inputs, q: onnx.NodeProto, out: Grid) -> bool:
    x, w = inputs[0], converter.weights(inputs[1] if len(inputs) > 1 else None, 0, None)
    if x is None or w is None or not converter.same_type([x], out):
        return False
    accumulator = x[1].scale.astype(np.float64).reshape(-1) * w[1].scale.astype(np.float64).reshape(-1)
    bias = converter.bias(node, 2, accumulator, converter.inits[w[0]].shape[0])
    if bias is not None and not bias.size:
        return False
    w = converter.weight_as(w, x[1].dtype)
    args = [x[0], *converter.qparams(x[1], x[0]), w[0], *converter.qparams(w[1], w[0]), "Y"]
    args += [] if bias is None else [converter.const(bias, f"{node.name}_bias_int32")]
    return converter.emit("QLinearConv", node, args, q, out, **attributes(node))


def _gemm(converter: Converter, node: onnx.NodeProto, inputs: _Inputs, q: onnx.NodeProto, out: Grid) -> bool:
    attrs = attributes(node)
    alpha, beta, trans_b = float(attrs.get("alpha", 1.0)), float(attrs.get("beta", 1.0)), attrs.get("transB", 0)
    a, b = inputs[0], converter.weights(inputs[1] if len(inputs) > 1 else None, 0 if trans_b else 1, 2)
    if a is None or b is None or alpha <= 0 or not converter.same_type([a], out):
        return False
    channels = converter.inits[b[0]].shape[0 if trans_b else 1]
    b_scale = (b[1].scale * np.float32(alpha)).astype(np.float32)  # alpha folds into B's scale
    accumulator = a[1].scale.astype(np.float64).reshape(-1) * b_scale.astype(np.float64).reshape(-1)
    bias = converter.bias(node, 2, accumulator / beta, channels) if beta else None  # beta * C / accumulator
    if bias is not None and not bias.size:
        return False
    b = converter.weight_as(b, a[1].dtype)
    b_grid = Grid(b_scale, b[1].zero_point, b[1].axis)
    c = "" if bias is None else converter.const(bias, f"{node.name}_bias_int32")
    args = [a[0], *converter.qparams(a[1], a[0]), b[0], *converter.qparams(b_grid, b[0]), c, "Y"]
    keep = {k: v for k, v in attrs.items() if k in ("transA", "transB")}
    return converter.emit("QGemm", node, args, q, out, **keep)


def _matmul(converter: Converter, node: onnx.NodeProto, inputs: _Inputs, q: onnx.NodeProto, out: Grid) -> bool:
    a, b = inputs[0], inputs[1]
    if a is None or b is None or not converter.same_type([a], out):
        return False
    found: Input | None = b
    if b[0] in converter.inits:  # a constant B may be quantized per column
        found = converter.weights(b, 1, 2) if not b[1].per_tensor else b
        found = None if found is None else converter.weight_as(found, a[1].dtype)
    elif not b[1].per_tensor or (a[1].dtype == np.int8 and b[1].dtype != np.int8):
        return False  # int8 activations need an int8 B
    if found is None:
        return False
    args = [a[0], *converter.qparams(a[1], a[0]), found[0], *converter.qparams(found[1], found[0]), "Y"]
    return converter.emit("QLinearMatMul", node, args, q, out)


def _operands(converter: Converter, inputs: _Inputs) -> list[str]:
    """Each (per-tensor, checked by ``same_type``) input as its integer tensor, scale and zero point."""
    return [name for x, grid in (i for i in inputs if i is not None) for name in (x, *converter.qparams(grid, x))]


def _elementwise(op: str) -> OperatorRule:
    def rule(converter: Converter, node: onnx.NodeProto, inputs: _Inputs, q: onnx.NodeProto, out: Grid) -> bool:
        if len(inputs) != 2 or not converter.same_type(inputs, out):
            return False
        return converter.emit(op, node, [*_operands(converter, inputs), "Y"], q, out)

    return rule


def _concat(converter: Converter, node: onnx.NodeProto, inputs: _Inputs, q: onnx.NodeProto, out: Grid) -> bool:
    if not converter.same_type(inputs, out):
        return False
    return converter.emit("QLinearConcat", node, ["Y", *_operands(converter, inputs)], q, out, **attributes(node))


def _unary(op: str, **defaults: object) -> OperatorRule:
    """A one-input integer operator taking ``node``'s attributes (with ``defaults`` where it has none)."""

    def rule(converter: Converter, node: onnx.NodeProto, inputs: _Inputs, q: onnx.NodeProto, out: Grid) -> bool:
        attrs, x = attributes(node, drop=("dilations",)), inputs[0]
        if x is None or not converter.same_type([x], out) or any(d != 1 for d in attributes(node).get("dilations", [])):
            return False
        return converter.emit(op, node, [*_operands(converter, [x]), "Y"], q, out, **{**defaults, **attrs})

    return rule


OPERATOR_RULES: Mapping[str, OperatorRule] = MappingProxyType(
    {
        "Conv": _conv,
        "Gemm": _gemm,
        "MatMul": _matmul,
        "Add": _elementwise("QLinearAdd"),
        "Mul": _elementwise("QLinearMul"),
        "Concat": _concat,
        "GlobalAveragePool": _unary("QLinearGlobalAveragePool", channels_last=0),
        "AveragePool": _unary("QLinearAveragePool"),
        "LeakyRelu": _unary("QLinearLeakyRelu", alpha=0.01),
        "Sigmoid": _unary("QLinearSigmoid"),
    }
)
"""Float operator -> the rule writing its integer operator."""
