"""The STPU backend: all-integer, symmetric [-127, 127] with fixed quantizers."""

from mqbench.backends.families import PER_TENSOR_WEIGHTS, TOTAL_INT
from mqbench.backends.spec import BackendSpec, QuantizerSpec
from mqbench.scheme import QuantScheme

__all__ = ["SPEC"]

_SCHEME = QuantScheme(8, symmetric=True, symmetric_range=True)

SPEC = BackendSpec(
    name="stpu",
    weight=QuantizerSpec(_SCHEME, fake_quantize="FixedFakeQuantize"),
    activation=QuantizerSpec(_SCHEME, fake_quantize="FixedFakeQuantize", observer="EMAMinMaxObserver"),
    placement=TOTAL_INT,
    description="STPU, all-integer symmetric int8",
    deploy=("stpu_json",),
    ptq_recipe=PER_TENSOR_WEIGHTS,
)
