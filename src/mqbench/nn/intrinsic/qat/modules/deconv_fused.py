"""QAT fused transposed convolutions: ConvTranspose2d + ReLU, + BatchNorm2d (folded), + both.

The weight has shape ``[in, out / groups, kH, kW]``; BatchNorm folding scales its output
channels (axis 1, per group), and a per-channel weight quantizer uses ``ch_axis=1``.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from mqbench.fake_quantize import FixedFakeQuantize
    >>> from mqbench.nn import intrinsic as nni
    >>> from mqbench.nn.intrinsic import qat as nniqat
    >>> factory = FixedFakeQuantize.with_args(
    ...     quant_min=-127, quant_max=127, qscheme=torch.per_channel_symmetric, ch_axis=1
    ... )
    >>> deconv = nn.ConvTranspose2d(4, 6, 2, stride=2, groups=2)
    >>> qat = nniqat.ConvTransposeBn2d.from_float(nni.ConvTransposeBn2d(deconv, nn.BatchNorm2d(6)), factory)
    >>> qat(torch.randn(2, 4, 3, 3)).shape
    torch.Size([2, 6, 6, 6])
"""

from __future__ import annotations

from typing import Any, ClassVar, cast

import torch.nn.functional as F
from torch import Tensor, nn

from mqbench.nn.intrinsic.modules import fused as nni
from mqbench.nn.intrinsic.qat.modules.bn_folding import BnFoldingModule, ReLUMixin
from mqbench.nn.qat.modules import deconv as nnqat
from mqbench.nn.qat.modules.base import QATModule
from mqbench.nn.qat.modules.deconv import conv_transpose_output_padding

__all__ = ["ConvTransposeBn2d", "ConvTransposeBnReLU2d", "ConvTransposeReLU2d"]


class ConvTransposeReLU2d(ReLUMixin, nnqat.ConvTranspose2d):
    """QAT ConvTranspose2d + ReLU/ReLU6 (from :class:`mqbench.nn.intrinsic.ConvTransposeReLU2d`)."""

    _FLOAT_MODULE = nni.ConvTransposeReLU2d
    _FLOAT_RELU_MODULE = nni.ConvTransposeReLU2d


class ConvTransposeBn2d(BnFoldingModule, nn.ConvTranspose2d):
    """QAT ConvTranspose2d + BatchNorm2d with the BatchNorm folded into the quantized weight.

    Arguments as nn.ConvTranspose2d plus ``weight_fake_quant_factory`` (keyword), ``eps``,
    ``momentum`` and ``freeze_bn``.
    """

    _FLOAT_MODULE: ClassVar[type[nn.Module]] = nni.ConvTransposeBn2d
    _FLOAT_LAYER = nn.ConvTranspose2d
    _BN = nn.BatchNorm2d
    _MERGED_QAT: ClassVar[type[QATModule]] = nnqat.ConvTranspose2d
    _TRANSPOSED = True

    def _apply_weight(self, x: Tensor, weight: Tensor, bias: Tensor | None, **options: Any) -> Tensor:
        return F.conv_transpose2d(
            x,
            weight,
            bias,
            self.stride,
            cast(tuple[int, ...], self.padding),
            options["output_padding"],
            self.groups,
            self.dilation,
        )

    def forward(self, input: Tensor, output_size: list[int] | None = None) -> Tensor:
        if self.padding_mode != "zeros":
            raise ValueError("ConvTranspose2d supports only padding_mode='zeros'")
        return self._folded_forward(input, output_padding=conv_transpose_output_padding(self, input, output_size))


class ConvTransposeBnReLU2d(ReLUMixin, ConvTransposeBn2d):
    """QAT ConvTranspose2d + BatchNorm2d (folded) + ReLU/ReLU6."""

    _FLOAT_MODULE = nni.ConvTransposeBnReLU2d
    _FLOAT_RELU_MODULE = nni.ConvTransposeReLU2d
    _MERGED_QAT = ConvTransposeReLU2d
