"""The HiSilicon NNIE backend: 8-bit log-domain quantization in front of every int8 op."""

from mqbench.backends.families import EXPLICIT, PER_TENSOR_WEIGHTS
from mqbench.backends.spec import BackendSpec, QuantizerSpec
from mqbench.scheme import QuantScheme

__all__ = ["SPEC"]

SPEC = BackendSpec(
    name="nnie",
    weight=QuantizerSpec(QuantScheme(8, symmetric=True), fake_quantize="NNIEFakeQuantize"),
    activation=QuantizerSpec(
        QuantScheme(8, symmetric=True), fake_quantize="NNIEFakeQuantize", observer="EMAMinMaxObserver"
    ),
    placement=EXPLICIT,
    description="HiSilicon NNIE, 8-bit logarithmic grid",
    deploy=("nnie_json",),
    lsb_tolerance=2,  # allowed per-tensor difference on this coarse grid
    ptq_recipe=PER_TENSOR_WEIGHTS,
)
