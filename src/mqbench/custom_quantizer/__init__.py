"""Quantizer placement: the rule-driven ModelQuantizer and its extension points."""

from mqbench.custom_quantizer.model_quantizer import ModelQuantizer, register_model_quantizer

__all__ = ["ModelQuantizer", "register_model_quantizer"]
