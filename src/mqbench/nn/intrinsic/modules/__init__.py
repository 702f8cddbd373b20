"""Fused float modules (MQBench's ``mqbench.nn.intrinsic.modules``); see :mod:`.fused`."""

from mqbench.nn.intrinsic.modules import fused as _source
from mqbench.nn.intrinsic.modules.fused import *  # noqa: F403 (re-export; the names are _source.__all__)

__all__ = list(_source.__all__)
