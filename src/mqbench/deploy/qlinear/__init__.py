"""Convert a Q/DQ ONNX model into onnxruntime's integer operator form.

Every float operator whose quantized inputs come from DequantizeLinear and whose output goes
straight into a QuantizeLinear (DQ -> op -> Q) becomes the integer operator onnxruntime runs:
QLinearConv (int32 bias at scale ``x_scale * w_scale``), QGemm (``com.microsoft``, int32 bias)
or QLinearMatMul, and from the ``com.microsoft`` domain QLinearAdd, QLinearMul, QLinearConcat,
QLinearGlobalAveragePool, QLinearAveragePool, QLinearLeakyRelu and QLinearSigmoid.

Operators that commute with quantization move to the integer side first: a DequantizeLinear
sinks below Relu, MaxPool, Resize (nearest) and the data-movement operators (Flatten, Reshape,
Transpose, Squeeze, Unsqueeze, Gather, Slice, Identity), and a QuantizeLinear rises above them and
above Clip (quantization is monotone, so ``Q(relu(x)) == max(Q(x), zero_point)``); Shape and Size
read the integers themselves (they have the same shape). A Relu or Clip becomes
an integer Clip at the quantized bounds, or nothing when the bound is the lowest integer anyway,
which fuses a Relu into the operator before it. A DequantizeLinear feeding a QuantizeLinear
with the same parameters disappears. Everything else stays float between its DQ and Q, so the
result always runs. The integer kernels accumulate exactly and requantize in float with round
half to even, like QuantizeLinear; they part from the float graph only at near ties (1 LSB).

Integer activations are held in one 8-bit type (uint8 by default; the integers and zero
points of int8 tensors move by 128, which changes no value): onnxruntime's kernels want one
activation type per operator, and its x86 kernels are fastest on uint8 activations.

The modules: :mod:`~mqbench.deploy.qlinear.converter` is the driver (the graph being rewritten
and its passes); :mod:`~mqbench.deploy.qlinear.operators` and :mod:`~mqbench.deploy.qlinear.commuting`
hold one rule per operator family in a table the driver looks operators up in;
:mod:`~mqbench.deploy.qlinear.build` runs the passes (:func:`to_qlinear`) and writes the artifact,
and :mod:`~mqbench.deploy.qlinear.verification` checks it.

Example:
    >>> import numpy as np
    >>> from onnx import TensorProto, helper, numpy_helper
    >>> from mqbench.deploy.qdq import insert_qdq
    >>> from mqbench.qparams import QParamTable, TensorQParams
    >>> nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv"), helper.make_node("Relu", ["c"], ["y"])]
    >>> weight = numpy_helper.from_array(np.full((3, 2, 1, 1), 0.25, np.float32), "w")
    >>> graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 4, 4])],
    ...     [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [weight])
    >>> model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    >>> act = TensorQParams(np.array([0.5]), np.array([0]), 0, 255)
    >>> w = TensorQParams(np.full(3, 1 / 64), np.zeros(3), -128, 127, axis=0, kind="weight")
    >>> table = QParamTable({"x": act, "w": w, "y": act})
    >>> qlinear, integers = to_qlinear(insert_qdq(model, table)[0], table)
    >>> [node.op_type for node in qlinear.graph.node]
    ['QuantizeLinear', 'QLinearConv', 'DequantizeLinear', 'Identity']
    >>> integers["y"][1:]
    (0.5, 0)
"""

from mqbench.deploy.qlinear.build import exposed_tensors, float_ops, to_qlinear, write
from mqbench.deploy.qlinear.converter import CONTRIB_DOMAIN, METADATA_KEY, IntegerTensors
from mqbench.deploy.qlinear.verification import serve, verify

__all__ = [
    "CONTRIB_DOMAIN",
    "METADATA_KEY",
    "IntegerTensors",
    "exposed_tensors",
    "float_ops",
    "serve",
    "to_qlinear",
    "verify",
    "write",
]
