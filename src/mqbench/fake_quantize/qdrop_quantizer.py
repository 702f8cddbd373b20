"""MQBench's module path of QDrop (``mqbench.fake_quantize.qdrop_quantizer``)."""

from mqbench.fake_quantize.qdrop import QDropFakeQuantize
from mqbench.functional import round_ste

__all__ = ["QDropFakeQuantize", "round_ste"]
