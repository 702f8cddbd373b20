"""The TensorRT NLP backend: TensorRT's explicit quantization for transformers."""

from dataclasses import replace

from mqbench.backends import tensorrt
from mqbench.backends.spec import Placement

__all__ = ["SPEC"]

SPEC = replace(
    tensorrt.SPEC,
    name="tensorrt_nlp",
    placement=Placement(inputs_of={"linear", "matmul", "add"}, add_needs_activations=True),
    description="NVIDIA TensorRT for transformers: Linear, matmul and residual adds",
    deploy=("clip_ranges", "calib_cache"),
)
