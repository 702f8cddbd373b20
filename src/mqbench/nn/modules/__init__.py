"""Float modules MQBench defines (``mqbench.nn.modules``): :class:`FrozenBatchNorm2d`."""

from mqbench.nn.modules.frozen_batchnorm import FrozenBatchNorm2d

__all__ = ["FrozenBatchNorm2d"]
