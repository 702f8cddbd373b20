"""MQBench's ``OPENVINOQuantizer`` under its module path: the ModelQuantizer with the ``openvino`` backend's rules.

Subclass it and register the subclass (``@register_model_quantizer(...)``) as with MQBench; the
rules themselves are data (``ParamsTable["openvino"].placement``).
"""

from mqbench.custom_quantizer.model_quantizer import ModelQuantizer

__all__ = ["OPENVINOQuantizer"]


class OPENVINOQuantizer(ModelQuantizer):
    """The ModelQuantizer following the placement rules of ``openvino``."""

    backend = "openvino"
