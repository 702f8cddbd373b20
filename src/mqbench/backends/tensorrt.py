"""The TensorRT backend: explicit quantization (Q/DQ) in front of every int8 op.

Activations are on the int8 grid [-128, 127] that TensorRT's QuantizeLinear computes in explicit quantization
(and ModelOpt's and onnxruntime's Q/DQ files use): no Clip stands between a layer and its QuantizeLinear, which
lets a runtime fuse the pair into one int8 kernel. Weights keep the symmetric [-127, 127] of TensorRT's weight
scales. Implicit int8 (the calibration cache, the clip ranges' ``blob_range``) reads the same scale on
[-127, 127]: a value the explicit grid puts at -128 is -127 there. The inputs of matrix products (attention's
``Q K^T`` and ``P V``) are int8 too, as TensorRT runs them in explicit quantization.
"""

from dataclasses import replace

from mqbench.backends.families import CLIPPED, EXPLICIT, INTEGER_OPS
from mqbench.backends.spec import BackendSpec, QuantizerSpec
from mqbench.scheme import QuantScheme

__all__ = ["SPEC"]

SPEC = BackendSpec(
    name="tensorrt",
    weight=QuantizerSpec(QuantScheme(8, symmetric=True, per_channel=True, symmetric_range=True)),
    activation=QuantizerSpec(QuantScheme(8, symmetric=True), observer="EMAMinMaxObserver"),
    placement=replace(EXPLICIT, inputs_of=INTEGER_OPS),
    description="NVIDIA TensorRT, explicit int8 quantization",
    deploy=("clip_ranges", "calib_cache"),
    ptq_recipe=CLIPPED,
)
