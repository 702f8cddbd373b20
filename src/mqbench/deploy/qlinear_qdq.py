"""What a QLinear graph means, written back as standard Q/DQ ops (for the integer reference executor).

onnxruntime runs QLinearConv, QGemm and QLinearMatMul on int8 kernels whose results depend on the
CPU (see :mod:`mqbench.nn.quantized.saturation`). To check the *file* independently of the host,
:func:`qlinear_as_qdq` rewrites each integer operator ``Op(x_q, x_scale, x_zero_point, ..., y_scale,
y_zero_point)`` into ``QuantizeLinear(Op(DequantizeLinear(x_q, ...), ...), y_scale, y_zero_point)``,
the int32 bias as a DequantizeLinear on the accumulator scale ``x_scale * w_scale``. Tensor names of
the integer values are kept, so the integer tensors a QLinear model exposes are the QuantizeLinear
outputs of the rewritten one, and :func:`~mqbench.deploy.reference.run_reference` runs it with int32
accumulation and fixed-point requantization.

Example:
    >>> import numpy as np
    >>> from onnx import TensorProto, helper, numpy_helper
    >>> inits = [numpy_helper.from_array(np.array(v, t), n) for n, v, t in [
    ...     ("s", 0.5, np.float32), ("z", 0, np.uint8), ("ws", 0.25, np.float32), ("wz", 0, np.int8),
    ...     ("w", [[[[2]]]], np.int8)]]
    >>> node = helper.make_node("QLinearConv", ["x", "s", "z", "w", "ws", "wz", "s", "z"], ["y"])
    >>> graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.UINT8, [1, 1, 1, 1])],
    ...     [helper.make_tensor_value_info("y", TensorProto.UINT8, None)], inits)
    >>> model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    >>> [n.op_type for n in qlinear_as_qdq(model).graph.node]
    ['DequantizeLinear', 'DequantizeLinear', 'Conv', 'QuantizeLinear']
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from mqbench.deploy.onnx_graph import all_names, constant, initializer_map
from mqbench.deploy.onnx_graph import unique_name as _unique

__all__ = ["qlinear_as_qdq"]

_Rewrite = Callable[["_Writer", onnx.NodeProto], None]


class _Writer:
    def __init__(self, model: onnx.ModelProto) -> None:
        self.model = model
        self.taken = all_names(model.graph)
        self.inits = initializer_map(model.graph)
        self.nodes: list[onnx.NodeProto] = []

    def dequantize(self, q: str, scale: str, zero_point: str, base: str, axis: int | None = None) -> str:
        out = _unique(f"{base}_dq", self.taken)
        attrs: dict[str, Any] = {} if axis is None else {"axis": axis}
        self.nodes.append(helper.make_node("DequantizeLinear", [q, scale, zero_point], [out], name=out, **attrs))
        return out

    def weight_axis(self, scale: str, axis: int) -> int | None:
        """The axis of a per-channel weight scale, None for a scalar one."""
        init = self.inits.get(scale)
        return None if init is None or int(np.prod(init.dims)) <= 1 else axis

    def bias(self, node: onnx.NodeProto, bias: str, scales: Sequence[str]) -> str:
        """An int32 bias dequantized on the accumulator scale (the product of the operands' scales)."""
        values = [numpy_helper.to_array(self.inits[s]).astype(np.float32) for s in scales]
        product = (values[0].reshape(-1) * values[1].reshape(-1)).astype(np.float32)
        scale = _unique(f"{node.name or bias}_bias_scale", self.taken)
        zero = _unique(f"{node.name or bias}_bias_zero", self.taken)
        self.model.graph.initializer.extend(
            [constant(scale, product), constant(zero, np.zeros(product.shape, np.int32))]
        )
        return self.dequantize(bias, scale, zero, bias, 0 if product.size > 1 else None)

    def compute(self, op: str, node: onnx.NodeProto, inputs: list[str], y: tuple[str, str], **attrs: Any) -> None:
        out = _unique(f"{node.output[0]}_float", self.taken)
        self.nodes.append(helper.make_node(op, inputs, [out], name=node.name or out, **attrs))
        self.nodes.append(helper.make_node("QuantizeLinear", [out, *y], [node.output[0]], name=f"{out}_q"))


def _attrs(node: onnx.NodeProto, keep: Sequence[str] | None = None) -> dict[str, Any]:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute if keep is None or a.name in keep}


def _conv(w: _Writer, node: onnx.NodeProto) -> None:
    x, xs, xz, weight, ws, wz, ys, yz, *rest = node.input
    args = [w.dequantize(x, xs, xz, x), w.dequantize(weight, ws, wz, weight, w.weight_axis(ws, 0))]
    if rest and rest[0]:
        args.append(w.bias(node, rest[0], [xs, ws]))
    w.compute("Conv", node, args, (ys, yz), **_attrs(node))


def _gemm(w: _Writer, node: onnx.NodeProto) -> None:
    a, a_s, a_z, b, b_s, b_z, *rest = node.input
    attrs = _attrs(node, ("transA", "transB", "alpha"))
    c = rest[0] if rest else ""
    y = (rest[1], rest[2]) if len(rest) > 2 else None
    if y is None:  # float output: no requantization
        raise ValueError(f"QGemm {node.name!r} has a float output; only quantized outputs are checked")
    args = [
        w.dequantize(a, a_s, a_z, a),
        w.dequantize(b, b_s, b_z, b, w.weight_axis(b_s, 0 if attrs.get("transB") else 1)),
    ]
    if c:
        args.append(w.bias(node, c, [a_s, b_s]))
    w.compute("Gemm", node, args, y, **attrs)


def _matmul(w: _Writer, node: onnx.NodeProto) -> None:
    a, a_s, a_z, b, b_s, b_z, ys, yz = node.input
    args = [w.dequantize(a, a_s, a_z, a), w.dequantize(b, b_s, b_z, b, w.weight_axis(b_s, 1))]
    w.compute("MatMul", node, args, (ys, yz))


def _binary(op: str) -> _Rewrite:
    def rewrite(w: _Writer, node: onnx.NodeProto) -> None:
        a, a_s, a_z, b, b_s, b_z, ys, yz = node.input
        w.compute(op, node, [w.dequantize(a, a_s, a_z, a), w.dequantize(b, b_s, b_z, b)], (ys, yz))

    return rewrite


def _unary(op: str, keep: Sequence[str]) -> _Rewrite:
    def rewrite(w: _Writer, node: onnx.NodeProto) -> None:
        x, xs, xz, ys, yz = node.input
        w.compute(op, node, [w.dequantize(x, xs, xz, x)], (ys, yz), **_attrs(node, keep))

    return rewrite


def _concat(w: _Writer, node: onnx.NodeProto) -> None:
    ys, yz, *rest = node.input
    parts = [w.dequantize(rest[i], rest[i + 1], rest[i + 2], rest[i]) for i in range(0, len(rest), 3)]
    w.compute("Concat", node, parts, (ys, yz), **_attrs(node, ("axis",)))


_POOL = ("auto_pad", "ceil_mode", "count_include_pad", "kernel_shape", "pads", "strides")
_REWRITES: dict[str, _Rewrite] = {
    "QLinearConv": _conv,
    "QGemm": _gemm,
    "QLinearMatMul": _matmul,
    "QLinearAdd": _binary("Add"),
    "QLinearMul": _binary("Mul"),
    "QLinearConcat": _concat,
    "QLinearGlobalAveragePool": _unary("GlobalAveragePool", ()),
    "QLinearAveragePool": _unary("AveragePool", _POOL),
    "QLinearLeakyRelu": _unary("LeakyRelu", ("alpha",)),
    "QLinearSigmoid": _unary("Sigmoid", ()),
}


def qlinear_as_qdq(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of the QLinear ``model`` with every integer operator as DequantizeLinear -> op -> QuantizeLinear."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    writer = _Writer(model)
    for node in model.graph.node:
        rewrite = _REWRITES.get(node.op_type)
        if rewrite is None:
            if node.domain not in ("", "ai.onnx"):
                raise ValueError(f"node {node.name!r}: no Q/DQ form of {node.domain}.{node.op_type}")
            writer.nodes.append(node)
        else:
            rewrite(writer, node)
    del model.graph.node[:]
    model.graph.node.extend(writer.nodes)
    del model.graph.value_info[:]
    kept = [o for o in model.opset_import if o.domain not in ("com.microsoft",)]
    del model.opset_import[:]
    model.opset_import.extend(kept)
    return model
