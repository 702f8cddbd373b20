"""Placement rule sets shared by families of backends (one rule set per family)."""

from dataclasses import replace

from mqbench.backends.spec import Placement

__all__ = ["EXPLICIT", "INTEGER_OPS", "QLINEAR", "TOTAL_INT"]

# Ops that integer hardware runs quantized.
INTEGER_OPS = frozenset({"conv", "linear", "deconv", "pool", "add", "mul", "concat", "interpolate", "matmul"})

# Explicit quantization (TensorRT style): Q/DQ in front of every int8 op; a mul feeding an add fuses.
EXPLICIT = Placement(inputs_of=INTEGER_OPS - {"matmul"}, fused_mul_add=True)

# All-integer graphs: the inputs and outputs of every quantized op are integers; the output
# quantizer moves past a following activation or reshape, which the hardware fuses.
TOTAL_INT = Placement(
    inputs_of=INTEGER_OPS, outputs_of=INTEGER_OPS, passthrough=frozenset({"relu", "flatten", "dropout", "reshape"})
)

# onnxruntime's QLinear operator set (conv + relu merged, linear, add, pooling, concat).
QLINEAR = replace(TOTAL_INT, inputs_of=frozenset({"conv", "linear", "add", "pool", "concat"}))
QLINEAR = replace(QLINEAR, outputs_of=QLINEAR.inputs_of)
