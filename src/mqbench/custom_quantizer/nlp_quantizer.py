"""MQBench's ``AcademicNLPQuantizer`` under its module path: a ModelQuantizer with ``academic_nlp``'s rules.

Subclass it and register the subclass (``@register_model_quantizer(...)``) as with MQBench; the
rules themselves are data (``ParamsTable["academic_nlp"].placement``).
"""

from mqbench.custom_quantizer.model_quantizer import ModelQuantizer

__all__ = ["AcademicNLPQuantizer"]


class AcademicNLPQuantizer(ModelQuantizer):
    """The ModelQuantizer following the placement rules of ``academic_nlp``."""

    backend = "academic_nlp"
