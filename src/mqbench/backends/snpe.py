"""The Qualcomm SNPE backend: all-integer: inputs and outputs of every quantized op, asymmetric uint8."""

from mqbench.backends.families import AFFINE_TRANSFORMERS, PER_TENSOR_WEIGHTS, TOTAL_INT
from mqbench.backends.spec import BackendSpec, QuantizerSpec
from mqbench.scheme import QuantScheme

__all__ = ["SPEC"]

SPEC = BackendSpec(
    name="snpe",
    weight=QuantizerSpec(QuantScheme(8, symmetric=False)),
    activation=QuantizerSpec(QuantScheme(8, symmetric=False), observer="EMAMinMaxObserver"),
    placement=TOTAL_INT,
    description="Qualcomm SNPE / QNN, all-integer uint8",
    deploy=("encodings",),
    ptq_recipe=PER_TENSOR_WEIGHTS,
    transformer_recipe=AFFINE_TRANSFORMERS,
)
