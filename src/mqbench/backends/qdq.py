"""The ONNX QDQ backend: standard QuantizeLinear/DequantizeLinear for any ONNX runtime, TensorRT's rules."""

from dataclasses import replace

from mqbench.backends import tensorrt

__all__ = ["SPEC"]

SPEC = replace(
    tensorrt.SPEC,
    name="qdq",
    description="ONNX QuantizeLinear/DequantizeLinear (explicit quantization)",
    deploy=(),
    served_on_cpu=True,  # the Q/DQ model is what onnxruntime serves
)
