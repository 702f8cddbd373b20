"""The OpenVINO backend: network inputs and inputs of every int8 op (a transformer's residual adds float)."""

from mqbench.backends.families import INTEGER_OPS
from mqbench.backends.spec import BackendSpec, Placement, PTQRecipe, QuantizerSpec
from mqbench.scheme import QuantScheme

__all__ = ["SPEC"]

# OpenVINO's own post-training defaults where they help (measured against NNCF on ImageNet MobileNetV2 in
# benchmarks/peers/run.py): each activation's range is the mean over the calibration samples of each sample's
# min / max, then bias correction from each layer's float input means, recorded in the calibration pass (NNCF's fast
# bias correction: on an AVX-512 host half the time of a pass through the quantized model, 5.3 -> 2.7 s when
# measured, before that pass stopped running each layer twice; two crops of 256 on MobileNetV2 and six of 450
# gained on ResNet-50); on CPUs without VNNI the layers reading a signed input get 7-bit weights.
RECIPE = PTQRecipe(
    activation_observer="MeanMinMaxObserver",
    bias_correction=True,
    fast_bias_correction=True,
    guard_pair_saturation=True,
)
# A transformer's (all-MiniLM-L6-v2 against NNCF's transformer preset, the ViT, SmolLM2): its residual adds stay
# float (the placement), its activations are on an asymmetric grid (TRANSFORMER_ACTIVATION) and the outliers of the
# linear inputs move into the weights at strength 0.9; its outlier channels are not clipped. Measured in simulation,
# MiniLM's mean embedding cosine / the ViT's top-1 agreement / SmolLM2's perplexity (float 10.14): symmetric
# activations at NNCF's matmul strength 0.95, 0.9974 / 0.976 / 12.52; asymmetric at 0.95, 0.9978 / 0.987 / 11.50;
# at 0.9, 0.9980 / 0.984 / 11.21; at 0.8, 0.9982 / 0.980 / 11.10 (NNCF: 0.9979 / 0.949).
TRANSFORMER_RECIPE = PTQRecipe(smooth=True, smooth_alpha=0.9, guard_pair_saturation=True)
# Each activation of a transformer with its own zero point, as NNCF's transformer preset quantizes them (OpenVINO's
# FakeQuantize takes any range): LayerNorm outputs, GELU's and attention's inputs are not centred on zero.
TRANSFORMER_ACTIVATION = QuantizerSpec(QuantScheme(8, symmetric=False), observer="EMAMinMaxObserver")

SPEC = BackendSpec(
    name="openvino",
    weight=QuantizerSpec(QuantScheme(8, symmetric=True, per_channel=True)),
    activation=QuantizerSpec(QuantScheme(8, symmetric=True), observer="EMAMinMaxObserver"),
    placement=Placement(
        inputs_of=INTEGER_OPS,
        network_inputs=True,
        unsigned_after={"relu", "sigmoid"},
        per_channel_depthwise_inputs=True,
        float_residual_adds=True,
        float_attention_values=True,
        matmul_inputs_at_layers=True,
    ),
    description="Intel OpenVINO, int8 with unsigned activations after ReLU",
    deploy=("openvino_onnx",),
    served_on_cpu=True,
    ptq_recipe=RECIPE,
    transformer_recipe=TRANSFORMER_RECIPE,
    transformer_activation=TRANSFORMER_ACTIVATION,
)
