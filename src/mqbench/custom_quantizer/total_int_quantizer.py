"""MQBench's ``TotalINTQuantizer`` under its module path: the ModelQuantizer with the ``snpe`` backend's rules.

Subclass it and register the subclass (``@register_model_quantizer(...)``) as with MQBench; the
rules themselves are data (``ParamsTable["snpe"].placement``).
"""

from mqbench.custom_quantizer.model_quantizer import ModelQuantizer

__all__ = ["TotalINTQuantizer"]


class TotalINTQuantizer(ModelQuantizer):
    """The ModelQuantizer following the placement rules of ``snpe``."""

    backend = "snpe"
