"""QAT linear layer: the float Linear with its weight fake-quantized on every forward."""

from __future__ import annotations

from typing import Any, ClassVar

import torch.nn.functional as F
from torch import Tensor, nn

from mqbench.nn.qat.modules.base import QATModule, WeightFakeQuantFactory, build_weight_fake_quant

__all__ = ["Linear"]


class Linear(QATModule, nn.Linear):
    """QAT Linear: ``linear(x, weight_fake_quant(weight), bias)``; arguments as nn.Linear.

    Example:
        >>> import torch
        >>> from mqbench.fake_quantize import FixedFakeQuantize
        >>> factory = FixedFakeQuantize.with_args(quant_min=-127, quant_max=127, qscheme=torch.per_tensor_symmetric)
        >>> qat = Linear.from_float(torch.nn.Linear(4, 2), factory)
        >>> type(qat.to_float()).__name__, qat(torch.randn(3, 4)).shape
        ('Linear', torch.Size([3, 2]))
    """

    _FLOAT_MODULE: ClassVar[type[nn.Module]] = nn.Linear
    _FLOAT_LAYER = nn.Linear

    def __init__(self, *args: Any, weight_fake_quant_factory: WeightFakeQuantFactory, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.weight_fake_quant = build_weight_fake_quant(weight_fake_quant_factory, self.weight)

    def forward(self, input: Tensor) -> Tensor:
        return F.linear(input, self.weight_fake_quant(self.weight), self.bias)
