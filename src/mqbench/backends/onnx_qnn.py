"""The ONNX QLinear backend: what onnxruntime's QLinear operators need, for an all-integer graph."""

from mqbench.backends.families import AFFINE_TRANSFORMERS, PER_TENSOR_WEIGHTS, QLINEAR
from mqbench.backends.spec import BackendSpec, QuantizerSpec
from mqbench.scheme import QuantScheme

__all__ = ["SPEC"]

SPEC = BackendSpec(
    name="onnx_qnn",
    weight=QuantizerSpec(QuantScheme(8, symmetric=False)),
    activation=QuantizerSpec(QuantScheme(8, symmetric=False)),
    placement=QLINEAR,
    description="onnxruntime QLinear operators (all-integer ONNX)",
    deploy=("qlinear_onnx",),
    served_on_cpu=True,
    ptq_recipe=PER_TENSOR_WEIGHTS,
    transformer_recipe=AFFINE_TRANSFORMERS,
)
