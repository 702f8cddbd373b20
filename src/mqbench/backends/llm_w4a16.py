"""Weight-only 4-bit quantization for transformers (W4A16): group-wise symmetric weights, activations float.

Each group of 128 input channels of a Linear (or Embedding, or Conv) weight has its own scale on the grid
[-8, 7]; activations stay in the float type the runtime computes in. Deployed as ONNX's blocked
DequantizeLinear on packed 4-bit integers (opset 21) and as onnxruntime's MatMulNBits, what its generative
runtime runs.
"""

from mqbench.backends.spec import BackendSpec, Placement, QuantizerSpec
from mqbench.scheme import QuantScheme

__all__ = ["SPEC"]

SPEC = BackendSpec(
    name="llm_w4a16",
    weight=QuantizerSpec(
        QuantScheme(4, symmetric=True, per_channel=True, group_size=128), "FixedFakeQuantize", "MinMaxObserver"
    ),
    activation=None,
    placement=Placement(),
    description="weight-only 4-bit, symmetric groups of 128 input channels, activations float (W4A16)",
    deploy=("matmulnbits_onnx", "compressed_tensors", "gguf", "genai"),
    weight_only=True,
    float_layers=("lm_head", "embedding"),  # as LLM runtimes serve them; float_layers: [] quantizes them
)
