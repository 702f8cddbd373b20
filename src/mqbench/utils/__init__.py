"""Utilities: quantizer switches (:mod:`mqbench.utils.state`) and shared helpers."""

__all__: list[str] = []
