"""MQBench's ``AcademicQuantizer`` under its module path: the ModelQuantizer with the ``academic`` backend's rules.

Subclass it and register the subclass (``@register_model_quantizer(...)``) as with MQBench; the
rules themselves are data (``ParamsTable["academic"].placement``).
"""

from mqbench.custom_quantizer.model_quantizer import ModelQuantizer

__all__ = ["AcademicQuantizer"]


class AcademicQuantizer(ModelQuantizer):
    """The ModelQuantizer following the placement rules of ``academic``."""

    backend = "academic"
