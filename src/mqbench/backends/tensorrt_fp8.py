"""TensorRT with FP8 (E4M3) explicit quantization: Q/DQ on FLOAT8E4M3FN in front of every quantized op.

Weights have one scale per output channel, activations one per tensor, each ``amax / 448`` of what calibration
saw (FP8's exponent covers the range that an 8-bit integer grid would clip, so no clipping recipe is needed).
Only the inputs of the matrix products are FP8 (convolutions, linear layers, attention's matmuls), as FP8 engines
run them: residual adds, gates and rotary multiplications stay in the engine's 16-bit precision. Their values
span the residual stream's range, and 3 mantissa bits there cost a pretrained LLM (SmolLM2-135M) 2.7x its
perplexity, against +3% with the products' inputs alone.
Deployed as the Q/DQ ONNX model TensorRT builds FP8 engines from (opset 19); onnxruntime runs its FP8
QuantizeLinear / DequantizeLinear on the CPU, so verification runs the file itself. A Hugging Face model whose
quantized inputs are all linear layers' also gets the ``float-quantized`` compressed-tensors folder vLLM serves.
"""

from dataclasses import replace

from mqbench.backends import tensorrt
from mqbench.backends.spec import Placement, PTQRecipe, QuantizerSpec
from mqbench.scheme import QuantScheme

__all__ = ["SPEC"]

SPEC = replace(
    tensorrt.SPEC,
    name="tensorrt_fp8",
    weight=QuantizerSpec(QuantScheme(8, symmetric=True, per_channel=True, fp8="e4m3"), "FP8FakeQuantize"),
    activation=QuantizerSpec(QuantScheme(8, symmetric=True, fp8="e4m3"), "FP8FakeQuantize"),
    placement=Placement(inputs_of={"conv", "deconv", "linear", "matmul"}, fused_mul_add=True),
    description="NVIDIA TensorRT, explicit FP8 (E4M3) quantization of the matrix products' inputs",
    deploy=("compressed_tensors",),
    ptq_recipe=PTQRecipe(),
    float_layers=("lm_head", "embedding"),  # as LLM runtimes serve them; float_layers: [] quantizes them
)
