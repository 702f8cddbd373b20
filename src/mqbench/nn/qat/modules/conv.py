"""QAT convolutions: the float conv with its weight fake-quantized on every forward.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from mqbench.fake_quantize import FixedFakeQuantize
    >>> from mqbench.nn.qat import Conv2d
    >>> factory = FixedFakeQuantize.with_args(quant_min=-127, quant_max=127, qscheme=torch.per_tensor_symmetric)
    >>> qat = Conv2d.from_float(nn.Conv2d(3, 4, 3), factory)
    >>> isinstance(qat, nn.Conv2d), qat(torch.randn(1, 3, 5, 5)).shape
    (True, torch.Size([1, 4, 3, 3]))
"""

from __future__ import annotations

from typing import Any, ClassVar

from torch import Tensor, nn

from mqbench.nn.qat.modules.base import QATModule, WeightFakeQuantFactory, build_weight_fake_quant

__all__ = ["Conv1d", "Conv2d", "Conv3d"]


class Conv1d(QATModule, nn.Conv1d):
    """QAT Conv1d: ``conv1d(x, weight_fake_quant(weight), bias)``; arguments as nn.Conv1d."""

    _FLOAT_MODULE: ClassVar[type[nn.Module]] = nn.Conv1d
    _FLOAT_LAYER = nn.Conv1d

    def __init__(self, *args: Any, weight_fake_quant_factory: WeightFakeQuantFactory, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.weight_fake_quant = build_weight_fake_quant(weight_fake_quant_factory, self.weight)

    def forward(self, input: Tensor) -> Tensor:
        return self._conv_forward(input, self.weight_fake_quant(self.weight), self.bias)


class Conv2d(QATModule, nn.Conv2d):
    """QAT Conv2d: ``conv2d(x, weight_fake_quant(weight), bias)``; arguments as nn.Conv2d.

    Example:
        >>> import torch
        >>> from mqbench.fake_quantize import FixedFakeQuantize
        >>> factory = FixedFakeQuantize.with_args(quant_min=0, quant_max=255)
        >>> conv = Conv2d(2, 2, 1, bias=False, weight_fake_quant_factory=factory)
        >>> conv.weight_fake_quant.disable_fake_quant()
        >>> x = torch.randn(1, 2, 3, 3)
        >>> torch.equal(conv(x), torch.nn.functional.conv2d(x, conv.weight))
        True
    """

    _FLOAT_MODULE: ClassVar[type[nn.Module]] = nn.Conv2d
    _FLOAT_LAYER = nn.Conv2d

    def __init__(self, *args: Any, weight_fake_quant_factory: WeightFakeQuantFactory, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.weight_fake_quant = build_weight_fake_quant(weight_fake_quant_factory, self.weight)

    def forward(self, input: Tensor) -> Tensor:
        return self._conv_forward(input, self.weight_fake_quant(self.weight), self.bias)


class Conv3d(QATModule, nn.Conv3d):
    """QAT Conv3d: ``conv3d(x, weight_fake_quant(weight), bias)``; arguments as nn.Conv3d."""

    _FLOAT_MODULE: ClassVar[type[nn.Module]] = nn.Conv3d
    _FLOAT_LAYER = nn.Conv3d

    def __init__(self, *args: Any, weight_fake_quant_factory: WeightFakeQuantFactory, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.weight_fake_quant = build_weight_fake_quant(weight_fake_quant_factory, self.weight)

    def forward(self, input: Tensor) -> Tensor:
        return self._conv_forward(input, self.weight_fake_quant(self.weight), self.bias)
