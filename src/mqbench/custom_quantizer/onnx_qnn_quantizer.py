"""MQBench's ``ONNXQNNQuantizer`` under its module path: the ModelQuantizer with the ``onnx_qnn`` backend's rules.

Subclass it and register the subclass (``@register_model_quantizer(...)``) as with MQBench; the
rules themselves are data (``ParamsTable["onnx_qnn"].placement``).
"""

from mqbench.custom_quantizer.model_quantizer import ModelQuantizer

__all__ = ["ONNXQNNQuantizer"]


class ONNXQNNQuantizer(ModelQuantizer):
    """The ModelQuantizer following the placement rules of ``onnx_qnn``."""

    backend = "onnx_qnn"
