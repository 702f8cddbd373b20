"""The Academic NLP backend: inputs of Linear and matmul, quantizers from the user's configuration."""

from mqbench.backends.spec import BackendSpec, Placement

__all__ = ["SPEC"]

SPEC = BackendSpec(
    name="academic_nlp",
    weight=None,
    activation=None,
    placement=Placement(inputs_of={"linear", "matmul"}),
    description="research settings for transformers: quantizers from extra_qconfig_dict",
    deploy=("clip_ranges",),
    mixed_precision_bits=(2, 3, 4, 5, 6, 7, 8),
)
