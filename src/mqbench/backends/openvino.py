"""The OpenVINO backend: network inputs and the inputs of every int8 op; unsigned after ReLU."""

from mqbench.backends.families import CLIPPED, INTEGER_OPS
from mqbench.backends.spec import BackendSpec, Placement, QuantizerSpec
from mqbench.scheme import QuantScheme

__all__ = ["SPEC"]

SPEC = BackendSpec(
    name="openvino",
    weight=QuantizerSpec(QuantScheme(8, symmetric=True, per_channel=True)),
    activation=QuantizerSpec(QuantScheme(8, symmetric=True), observer="EMAMinMaxObserver"),
    placement=Placement(inputs_of=INTEGER_OPS, network_inputs=True, unsigned_after={"relu", "sigmoid"}),
    description="Intel OpenVINO, int8 with unsigned activations after ReLU",
    deploy=("openvino_onnx",),
    served_on_cpu=True,
    ptq_recipe=CLIPPED,
)
