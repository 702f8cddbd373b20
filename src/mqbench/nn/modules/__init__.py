"""Float modules MQBench defines (``mqbench.nn.modules``): :class:`FrozenBatchNorm2d`, :class:`RMSNorm`."""

from mqbench.nn.modules.frozen_batchnorm import FrozenBatchNorm2d
from mqbench.nn.modules.rms_norm import RMSNorm

__all__ = ["FrozenBatchNorm2d", "RMSNorm"]
