"""QAT fused linear layers: Linear + ReLU, Linear + BatchNorm1d (folded) and Linear + BatchNorm1d + ReLU.

The BatchNorm variants take ``[N, C]`` input (the channel is the last axis).

Example:
    >>> import torch
    >>> from torch import nn
    >>> from mqbench.fake_quantize import FixedFakeQuantize
    >>> from mqbench.nn import intrinsic as nni
    >>> from mqbench.nn.intrinsic import qat as nniqat
    >>> factory = FixedFakeQuantize.with_args(quant_min=-127, quant_max=127, qscheme=torch.per_tensor_symmetric)
    >>> float_module = nni.LinearBnReLU1d(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.ReLU())
    >>> qat = nniqat.LinearBnReLU1d.from_float(float_module, factory)
    >>> qat(torch.randn(5, 4)).shape, type(qat.to_float()).__name__
    (torch.Size([5, 3]), 'LinearReLU')
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch.nn.functional as F
from torch import Tensor, nn

from mqbench.nn.intrinsic.modules import fused as nni
from mqbench.nn.intrinsic.qat.modules.bn_folding import BnFoldingModule, ReLUMixin
from mqbench.nn.qat.modules import linear as nnqat
from mqbench.nn.qat.modules.base import QATModule

__all__ = ["LinearBn1d", "LinearBnReLU1d", "LinearReLU"]


class LinearReLU(ReLUMixin, nnqat.Linear):
    """QAT Linear + ReLU/ReLU6 (from :class:`mqbench.nn.intrinsic.LinearReLU`)."""

    _FLOAT_MODULE = nni.LinearReLU
    _FLOAT_RELU_MODULE = nni.LinearReLU


class LinearBn1d(BnFoldingModule, nn.Linear):
    """QAT Linear + BatchNorm1d with the BatchNorm folded into the quantized weight.

    Arguments as nn.Linear plus ``weight_fake_quant_factory`` (keyword), ``eps``,
    ``momentum`` and ``freeze_bn``.
    """

    _FLOAT_MODULE: ClassVar[type[nn.Module]] = nni.LinearBn1d
    _FLOAT_LAYER = nn.Linear
    _BN = nn.BatchNorm1d
    _MERGED_QAT: ClassVar[type[QATModule]] = nnqat.Linear
    _CHANNEL_AXIS = -1

    def _apply_weight(self, x: Tensor, weight: Tensor, bias: Tensor | None, **options: Any) -> Tensor:
        return F.linear(x, weight, bias)

    def forward(self, input: Tensor) -> Tensor:
        return self._folded_forward(input)


class LinearBnReLU1d(ReLUMixin, LinearBn1d):
    """QAT Linear + BatchNorm1d (folded) + ReLU/ReLU6."""

    _FLOAT_MODULE = nni.LinearBnReLU1d
    _FLOAT_RELU_MODULE = nni.LinearReLU
    _MERGED_QAT = LinearReLU
