"""The Academic backend: inputs of conv and linear, quantizers from the user's configuration."""

from mqbench.backends.spec import BackendSpec, Placement

__all__ = ["SPEC"]

SPEC = BackendSpec(
    name="academic",
    weight=None,
    activation=None,
    placement=Placement(inputs_of={"conv", "linear", "deconv"}, first_last_8bit=True),
    description="research settings: quantizers from extra_qconfig_dict, first/last layer 8-bit",
    deploy=("clip_ranges",),
    mixed_precision_bits=(2, 3, 4, 5, 6, 7, 8),
)
