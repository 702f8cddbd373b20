"""Weight-only 8-bit quantization for transformers (W8A16): ``llm_w4a16`` with 8-bit groups.

Each group of 128 input channels of a weight has its own scale on the grid [-128, 127]; activations stay in the
float type the runtime computes in. Deployed as ONNX's blocked DequantizeLinear on int8 (opset 21) and as
onnxruntime's MatMulNBits with ``bits=8``.
"""

from dataclasses import replace

from mqbench.backends import llm_w4a16

__all__ = ["SPEC"]

SPEC = replace(
    llm_w4a16.SPEC,
    name="llm_w8a16",
    weight=llm_w4a16.SPEC.weight.with_scheme(bits=8) if llm_w4a16.SPEC.weight else None,
    description="weight-only 8-bit, symmetric groups of 128 input channels, activations float (W8A16)",
)
