"""Placement rule sets shared by families of backends (one rule set per family)."""

from dataclasses import replace

from mqbench.backends.spec import Placement, PTQRecipe

__all__ = [
    "AFFINE_TRANSFORMERS",
    "CLIPPED",
    "EXPLICIT",
    "INTEGER_OPS",
    "PER_TENSOR_WEIGHTS",
    "QLINEAR",
    "TOTAL_INT",
]

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

# Post-training recipes (BackendSpec.ptq_recipe), measured on ImageNet MobileNetV2 in benchmarks/real_accuracy.py.
# 8-bit activations: clip at the 99.99th percentile of |x| instead of the running min/max, whose
# range a few outliers (residual adds) stretch.
CLIPPED = PTQRecipe(activation_observer="PercentileObserver")
# Per-tensor weight grids besides: equalize the weight ranges of consecutive layers where the
# activation between them allows it (ReLU), then correct the mean error the weights make per
# channel (depthwise layers on a per-tensor grid shift their outputs).
PER_TENSOR_WEIGHTS = PTQRecipe(activation_observer="PercentileObserver", equalize=True, bias_correction=True)
# A transformer on an all-integer uint8 grid (benchmarks/peers/run.py: the zoo ViT against AIMET and torchao, and
# all-MiniLM-L6-v2's embeddings): each activation's scale and zero point minimise its squared error over a histogram
# of all the calibration data, both ends placed independently (GELU's output reaches -0.17 and far up, an attention
# score's input lies mostly below zero). CNNs keep the percentile clipping: on ImageNet MobileNetV2 these ranges
# lose (top-1 agreement with float 0.836 -> 0.781).
AFFINE_TRANSFORMERS = PTQRecipe(activation_observer="AffineHistogramObserver")
