"""The TensorRT backend: explicit quantization (Q/DQ) in front of every int8 op."""

from mqbench.backends.families import CLIPPED, EXPLICIT
from mqbench.backends.spec import BackendSpec, QuantizerSpec
from mqbench.scheme import QuantScheme

__all__ = ["SPEC"]

SPEC = BackendSpec(
    name="tensorrt",
    weight=QuantizerSpec(QuantScheme(8, symmetric=True, per_channel=True, symmetric_range=True)),
    activation=QuantizerSpec(QuantScheme(8, symmetric=True, symmetric_range=True), observer="EMAMinMaxObserver"),
    placement=EXPLICIT,
    description="NVIDIA TensorRT, explicit int8 quantization",
    deploy=("clip_ranges", "calib_cache"),
    ptq_recipe=CLIPPED,
)
