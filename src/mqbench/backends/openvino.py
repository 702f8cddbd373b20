"""The OpenVINO backend: network inputs and the inputs of every int8 op; unsigned after ReLU."""

from mqbench.backends.families import INTEGER_OPS
from mqbench.backends.spec import BackendSpec, Placement, PTQRecipe, QuantizerSpec
from mqbench.scheme import QuantScheme

__all__ = ["SPEC"]

# OpenVINO's own post-training defaults where they help (measured against NNCF on ImageNet MobileNetV2 in
# benchmarks/peers/run.py): each activation's range is the mean over the calibration samples of each sample's
# min / max, then bias correction; on CPUs without VNNI the layers reading a signed input get 7-bit weights.
RECIPE = PTQRecipe(activation_observer="MeanMinMaxObserver", bias_correction=True, guard_pair_saturation=True)

SPEC = BackendSpec(
    name="openvino",
    weight=QuantizerSpec(QuantScheme(8, symmetric=True, per_channel=True)),
    activation=QuantizerSpec(QuantScheme(8, symmetric=True), observer="EMAMinMaxObserver"),
    placement=Placement(
        inputs_of=INTEGER_OPS,
        network_inputs=True,
        unsigned_after={"relu", "sigmoid"},
        per_channel_depthwise_inputs=True,
    ),
    description="Intel OpenVINO, int8 with unsigned activations after ReLU",
    deploy=("openvino_onnx",),
    served_on_cpu=True,
    ptq_recipe=RECIPE,
)
