"""MQBench's ``VitisQuantizer`` under its module path: the ModelQuantizer with the ``vitis`` backend's rules.

Subclass it and register the subclass (``@register_model_quantizer(...)``) as with MQBench; the
rules themselves are data (``ParamsTable["vitis"].placement``).
"""

from mqbench.custom_quantizer.model_quantizer import ModelQuantizer

__all__ = ["VitisQuantizer"]


class VitisQuantizer(ModelQuantizer):
    """The ModelQuantizer following the placement rules of ``vitis``."""

    backend = "vitis"
