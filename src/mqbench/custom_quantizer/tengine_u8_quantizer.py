"""MQBench's ``TengineQuantizer`` under its module path: the ModelQuantizer with the ``tengine_u8`` backend's rules.

Subclass it and register the subclass (``@register_model_quantizer(...)``) as with MQBench; the
rules themselves are data (``ParamsTable["tengine_u8"].placement``).
"""

from mqbench.custom_quantizer.model_quantizer import ModelQuantizer

__all__ = ["TengineQuantizer"]


class TengineQuantizer(ModelQuantizer):
    """The ModelQuantizer following the placement rules of ``tengine_u8``."""

    backend = "tengine_u8"
