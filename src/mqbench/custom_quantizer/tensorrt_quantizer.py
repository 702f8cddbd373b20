"""MQBench's ``TRTModelQuantizer`` and ``TensorrtNLPQuantizer`` under its module path.

Each is the ModelQuantizer with its backend's rules (``ParamsTable["tensorrt"].placement``,
``ParamsTable["tensorrt_nlp"].placement``); subclass and register as with MQBench.
"""

from mqbench.custom_quantizer.model_quantizer import ModelQuantizer

__all__ = ["TRTModelQuantizer", "TensorrtNLPQuantizer"]


class TRTModelQuantizer(ModelQuantizer):
    """The ModelQuantizer following TensorRT's rules: the inputs of every int8 op."""

    backend = "tensorrt"


class TensorrtNLPQuantizer(ModelQuantizer):
    """The ModelQuantizer following TensorRT NLP's rules (transformer encoders)."""

    backend = "tensorrt_nlp"
