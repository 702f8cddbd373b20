"""QAT transposed convolution: the float ConvTranspose2d with its weight fake-quantized.

The weight has shape ``[in, out / groups, kH, kW]``: a per-channel weight quantizer for
output channels uses ``ch_axis=1``.
"""

from __future__ import annotations

from typing import Any, ClassVar, cast

import torch.nn.functional as F
from torch import Tensor, nn

from mqbench.nn.qat.modules.base import QATModule, WeightFakeQuantFactory, build_weight_fake_quant

__all__ = ["ConvTranspose2d", "conv_transpose_output_padding"]


def conv_transpose_output_padding(module: nn.Module, input: Tensor, output_size: list[int] | None) -> list[int]:
    """The output padding a ConvTranspose2d uses for ``input`` and an optional ``output_size``."""
    layer = cast(Any, module)
    return layer._output_padding(input, output_size, layer.stride, layer.padding, layer.kernel_size, 2, layer.dilation)


class ConvTranspose2d(QATModule, nn.ConvTranspose2d):
    """QAT ConvTranspose2d: ``conv_transpose2d(x, weight_fake_quant(weight), bias)``; arguments as the float one.

    Example:
        >>> import torch
        >>> from mqbench.fake_quantize import FixedFakeQuantize
        >>> factory = FixedFakeQuantize.with_args(quant_min=-127, quant_max=127, qscheme=torch.per_tensor_symmetric)
        >>> qat = ConvTranspose2d(4, 2, 2, stride=2, weight_fake_quant_factory=factory)
        >>> qat(torch.randn(1, 4, 3, 3)).shape
        torch.Size([1, 2, 6, 6])
    """

    _FLOAT_MODULE: ClassVar[type[nn.Module]] = nn.ConvTranspose2d
    _FLOAT_LAYER = nn.ConvTranspose2d

    def __init__(self, *args: Any, weight_fake_quant_factory: WeightFakeQuantFactory, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.weight_fake_quant = build_weight_fake_quant(weight_fake_quant_factory, self.weight)

    def forward(self, input: Tensor, output_size: list[int] | None = None) -> Tensor:
        if self.padding_mode != "zeros":
            raise ValueError("ConvTranspose2d supports only padding_mode='zeros'")
        return F.conv_transpose2d(
            input,
            self.weight_fake_quant(self.weight),
            self.bias,
            self.stride,
            cast(tuple[int, ...], self.padding),
            conv_transpose_output_padding(self, input, output_size),
            self.groups,
            self.dilation,
        )
