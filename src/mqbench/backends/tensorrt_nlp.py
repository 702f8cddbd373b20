"""The TensorRT NLP backend: TensorRT's explicit quantization for transformers.

Inputs of Linear layers and of the attention products are int8. Residual adds keep the engine's
float precision (FP16 in an FP16+INT8 engine): a tensor without a Q/DQ pair or a calibration-cache
range is not int8 in TensorRT, and BERT-family residual streams carry activation outliers (FFN
outputs near +-200 next to values below 1) that no 8-bit grid holds. ``calibrate`` migrates the
outliers of linear inputs into the weights (``smooth_linear_inputs``). MQBench's placement, with
8-bit residual adds, is ``dataclasses.replace(SPEC, placement=Placement(inputs_of={"linear",
"matmul", "add"}, add_needs_activations=True))``.

A Hugging Face model whose quantized inputs are all linear layers' (attention by ``scaled_dot_product_attention``)
also gets the ``int-quantized`` compressed-tensors folder vLLM serves: its inputs are on the runtime's full int8
grid, as TensorRT's explicit quantization computes them.
"""

from dataclasses import replace

from mqbench.backends import tensorrt
from mqbench.backends.spec import Placement, PTQRecipe

__all__ = ["SPEC"]

SPEC = replace(
    tensorrt.SPEC,
    name="tensorrt_nlp",
    placement=Placement(inputs_of={"linear", "matmul"}),
    description="NVIDIA TensorRT for transformers: Linear and matmul inputs int8, residual adds in float",
    deploy=("clip_ranges", "calib_cache", "compressed_tensors"),
    smooth_linear_inputs=True,
    ptq_recipe=PTQRecipe(),  # clipping the outlier channels of LayerNorm outputs costs more than it gains
    float_layers=("lm_head", "embedding"),  # as LLM runtimes serve them; float_layers: [] quantizes them
)
