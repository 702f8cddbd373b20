"""QAT transposed convolutions: the float ConvTranspose1d/2d/3d with the weight fake-quantized.

The weight has shape ``[in, out / groups, *kernel]``: a per-channel weight quantizer for
output channels uses ``ch_axis=1``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, cast

import torch.nn.functional as F
from torch import Tensor, nn

from mqbench.nn.qat.modules.base import QATModule, WeightFakeQuantFactory, build_weight_fake_quant

__all__ = ["ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d", "conv_transpose_output_padding"]


def conv_transpose_output_padding(
    module: nn.Module, input: Tensor, output_size: list[int] | None, spatial_dims: int = 2
) -> list[int]:
    """The output padding a ConvTranspose layer uses for ``input`` and an optional ``output_size``."""
    layer = cast(Any, module)
    return layer._output_padding(
        input, output_size, layer.stride, layer.padding, layer.kernel_size, spatial_dims, layer.dilation
    )


class _QATConvTranspose(QATModule):
    """``conv_transposeNd(x, weight_fake_quant(weight), bias)`` with the float layer's arguments."""

    _SPATIAL_DIMS: ClassVar[int]
    _FUNCTION: ClassVar[Callable[..., Tensor]]

    def __init__(self, *args: Any, weight_fake_quant_factory: WeightFakeQuantFactory, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.weight_fake_quant = build_weight_fake_quant(weight_fake_quant_factory, cast(Tensor, self.weight))

    def forward(self, input: Tensor, output_size: list[int] | None = None) -> Tensor:
        layer = cast(Any, self)
        if layer.padding_mode != "zeros":
            raise ValueError(f"{type(self).__name__} supports only padding_mode='zeros'")
        return type(self)._FUNCTION(
            input,
            self.weight_fake_quant(layer.weight),
            layer.bias,
            layer.stride,
            layer.padding,
            conv_transpose_output_padding(self, input, output_size, self._SPATIAL_DIMS),
            layer.groups,
            layer.dilation,
        )


class ConvTranspose1d(_QATConvTranspose, nn.ConvTranspose1d):
    """QAT ConvTranspose1d."""

    _FLOAT_MODULE: ClassVar[type[nn.Module]] = nn.ConvTranspose1d
    _FLOAT_LAYER = nn.ConvTranspose1d
    _SPATIAL_DIMS = 1
    _FUNCTION = F.conv_transpose1d


class ConvTranspose2d(_QATConvTranspose, nn.ConvTranspose2d):
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
    _SPATIAL_DIMS = 2
    _FUNCTION = F.conv_transpose2d


class ConvTranspose3d(_QATConvTranspose, nn.ConvTranspose3d):
    """QAT ConvTranspose3d."""

    _FLOAT_MODULE: ClassVar[type[nn.Module]] = nn.ConvTranspose3d
    _FLOAT_LAYER = nn.ConvTranspose3d
    _SPATIAL_DIMS = 3
    _FUNCTION = F.conv_transpose3d
