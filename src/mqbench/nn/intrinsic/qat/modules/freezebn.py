"""QAT modules of a conv / deconv with a FrozenBatchNorm2d: BatchNorm folded, its statistics never updated.

Each is the BatchNorm-folding QAT module of its family with ``freeze_bn`` set for good: training
normalises with the running statistics and leaves them as they are (what a FrozenBatchNorm2d
does in float), while the folded weight is fake-quantized as usual.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from mqbench import nn as qnn
    >>> from mqbench.fake_quantize import FixedFakeQuantize
    >>> from mqbench.nn.modules import FrozenBatchNorm2d
    >>> fused = qnn.intrinsic.ConvFreezebn2d(nn.Conv2d(3, 4, 3), FrozenBatchNorm2d(4))
    >>> qat = ConvFreezebn2d.from_float(fused, FixedFakeQuantize.with_args(quant_min=-128, quant_max=127))
    >>> qat.freeze_bn
    True
"""

from __future__ import annotations

from typing import Any, ClassVar

from torch import nn

from mqbench.nn import intrinsic as nni
from mqbench.nn.intrinsic.qat.modules.conv_fused import ConvBn2d, ConvBnReLU2d
from mqbench.nn.intrinsic.qat.modules.deconv_fused import ConvTransposeBn2d, ConvTransposeBnReLU2d

__all__ = ["ConvFreezebn2d", "ConvFreezebnReLU2d", "ConvTransposeFreezebn2d", "ConvTransposeFreezebnReLU2d"]


class _Frozen:
    """Keeps ``freeze_bn`` set: built frozen, and ``update_bn_stats`` leaves it frozen."""

    freeze_bn: bool

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["freeze_bn"] = True
        super().__init__(*args, **kwargs)
        self.freeze_bn = True

    def update_bn_stats(self) -> Any:
        return self


class ConvFreezebn2d(_Frozen, ConvBn2d):
    """QAT Conv2d + FrozenBatchNorm2d (folded, statistics fixed)."""

    _FLOAT_MODULE: ClassVar[type[nn.Module]] = nni.ConvFreezebn2d


class ConvFreezebnReLU2d(_Frozen, ConvBnReLU2d):
    """QAT Conv2d + FrozenBatchNorm2d (folded, statistics fixed) + ReLU/ReLU6."""

    _FLOAT_MODULE = nni.ConvFreezebnReLU2d


class ConvTransposeFreezebn2d(_Frozen, ConvTransposeBn2d):
    """QAT ConvTranspose2d + FrozenBatchNorm2d (folded, statistics fixed)."""

    _FLOAT_MODULE: ClassVar[type[nn.Module]] = nni.ConvTransposeFreezebn2d


class ConvTransposeFreezebnReLU2d(_Frozen, ConvTransposeBnReLU2d):
    """QAT ConvTranspose2d + FrozenBatchNorm2d (folded, statistics fixed) + ReLU/ReLU6."""

    _FLOAT_MODULE = nni.ConvTransposeFreezebnReLU2d
