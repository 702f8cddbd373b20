"""QAT fused convolutions: Conv + ReLU, Conv + BatchNorm (folded) and Conv + BatchNorm + ReLU.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from mqbench.fake_quantize import FixedFakeQuantize
    >>> from mqbench.nn import intrinsic as nni
    >>> from mqbench.nn.intrinsic import qat as nniqat
    >>> factory = FixedFakeQuantize.with_args(
    ...     quant_min=-127, quant_max=127, qscheme=torch.per_channel_symmetric, ch_axis=0
    ... )
    >>> qat = nniqat.ConvBn2d.from_float(nni.ConvBn2d(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)), factory)
    >>> _ = qat(torch.randn(8, 3, 6, 6))  # training: batch statistics, running statistics updated
    >>> int(qat.bn.num_batches_tracked)
    1
    >>> _ = qat.freeze_bn_stats().eval()
    >>> x = torch.randn(1, 3, 6, 6)
    >>> torch.allclose(qat(x), qat.merge_bn()(x))
    True
"""

from __future__ import annotations

from typing import Any, ClassVar, cast

from torch import Tensor, nn

from mqbench.nn.intrinsic.modules import fused as nni
from mqbench.nn.intrinsic.qat.modules.bn_folding import BnFoldingModule, ReLUMixin
from mqbench.nn.qat.modules import conv as nnqat
from mqbench.nn.qat.modules.base import QATModule

__all__ = [
    "ConvBn1d",
    "ConvBn2d",
    "ConvBn3d",
    "ConvBnReLU1d",
    "ConvBnReLU2d",
    "ConvBnReLU3d",
    "ConvReLU1d",
    "ConvReLU2d",
    "ConvReLU3d",
]


class ConvReLU1d(ReLUMixin, nnqat.Conv1d):
    """QAT Conv1d + ReLU/ReLU6 (from :class:`mqbench.nn.intrinsic.ConvReLU1d`)."""

    _FLOAT_MODULE = nni.ConvReLU1d
    _FLOAT_RELU_MODULE = nni.ConvReLU1d


class ConvReLU2d(ReLUMixin, nnqat.Conv2d):
    """QAT Conv2d + ReLU/ReLU6 (from :class:`mqbench.nn.intrinsic.ConvReLU2d`)."""

    _FLOAT_MODULE = nni.ConvReLU2d
    _FLOAT_RELU_MODULE = nni.ConvReLU2d


class ConvReLU3d(ReLUMixin, nnqat.Conv3d):
    """QAT Conv3d + ReLU/ReLU6 (from :class:`mqbench.nn.intrinsic.ConvReLU3d`)."""

    _FLOAT_MODULE = nni.ConvReLU3d
    _FLOAT_RELU_MODULE = nni.ConvReLU3d


class _ConvBnMixin(BnFoldingModule):
    def _apply_weight(self, x: Tensor, weight: Tensor, bias: Tensor | None, **options: Any) -> Tensor:
        return nnqat.conv_forward(cast(Any, self), x, weight, bias)

    def forward(self, input: Tensor) -> Tensor:
        return self._folded_forward(input)


class ConvBn1d(_ConvBnMixin, nn.Conv1d):
    """QAT Conv1d + BatchNorm1d with the BatchNorm folded into the quantized weight."""

    _FLOAT_MODULE: ClassVar[type[nn.Module]] = nni.ConvBn1d
    _FLOAT_LAYER = nn.Conv1d
    _BN = nn.BatchNorm1d
    _MERGED_QAT: ClassVar[type[QATModule]] = nnqat.Conv1d


class ConvBn2d(_ConvBnMixin, nn.Conv2d):
    """QAT Conv2d + BatchNorm2d with the BatchNorm folded into the quantized weight.

    Arguments as nn.Conv2d plus ``weight_fake_quant_factory`` (keyword), ``eps``,
    ``momentum`` and ``freeze_bn``; usually built with :meth:`from_float`. See the
    module docstring for an example.
    """

    _FLOAT_MODULE: ClassVar[type[nn.Module]] = nni.ConvBn2d
    _FLOAT_LAYER = nn.Conv2d
    _BN = nn.BatchNorm2d
    _MERGED_QAT: ClassVar[type[QATModule]] = nnqat.Conv2d


class ConvBn3d(_ConvBnMixin, nn.Conv3d):
    """QAT Conv3d + BatchNorm3d with the BatchNorm folded into the quantized weight."""

    _FLOAT_MODULE: ClassVar[type[nn.Module]] = nni.ConvBn3d
    _FLOAT_LAYER = nn.Conv3d
    _BN = nn.BatchNorm3d
    _MERGED_QAT: ClassVar[type[QATModule]] = nnqat.Conv3d


class ConvBnReLU1d(ReLUMixin, ConvBn1d):
    """QAT Conv1d + BatchNorm1d (folded) + ReLU/ReLU6."""

    _FLOAT_MODULE = nni.ConvBnReLU1d
    _FLOAT_RELU_MODULE = nni.ConvReLU1d
    _MERGED_QAT = ConvReLU1d


class ConvBnReLU2d(ReLUMixin, ConvBn2d):
    """QAT Conv2d + BatchNorm2d (folded) + ReLU/ReLU6."""

    _FLOAT_MODULE = nni.ConvBnReLU2d
    _FLOAT_RELU_MODULE = nni.ConvReLU2d
    _MERGED_QAT = ConvReLU2d


class ConvBnReLU3d(ReLUMixin, ConvBn3d):
    """QAT Conv3d + BatchNorm3d (folded) + ReLU/ReLU6."""

    _FLOAT_MODULE = nni.ConvBnReLU3d
    _FLOAT_RELU_MODULE = nni.ConvReLU3d
    _MERGED_QAT = ConvReLU3d
