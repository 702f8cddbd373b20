"""Small reference models defined in the project (no downloads needed)."""

from mqbench.models.small import DigitsCNN

__all__ = ["DigitsCNN"]
