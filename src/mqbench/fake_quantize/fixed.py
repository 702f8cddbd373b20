"""FixedFakeQuantize: qparams taken from the observer, straight-through gradient."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from mqbench.fake_quantize.quantize_base import QuantizeBase
from mqbench.functional import fake_quantize, folded_learnable_fake_quantize
from mqbench.observer import MinMaxObserver
from mqbench.scheme import rounded_scale

__all__ = ["FixedFakeQuantize", "ObserverQParamsQuantizer"]


class ObserverQParamsQuantizer(QuantizeBase):
    """A quantizer whose ``scale`` / ``zero_point`` buffers are copied from its observer.

    Subclasses implement ``quantize``; the buffers resize to per-channel shapes on first use.
    """

    scale: Tensor
    zero_point: Tensor
    observer_scales = True  # the scale is the observer's (scale_dtype may round it)

    def __init__(self, observer: Any = MinMaxObserver, **observer_kwargs: Any) -> None:
        super().__init__(observer, **observer_kwargs)
        self.register_buffer("scale", torch.tensor([1.0]))
        self.register_buffer("zero_point", torch.tensor([0], dtype=torch.int32))

    def update_qparams(self) -> None:
        scale, zero_point = self.calculate_qparams()
        if self.scale_dtype is not None:  # the 16-bit scale a format stores (the zero point stays the observer's)
            scale = rounded_scale(scale, self.scale_dtype)
        if self.scale.shape != scale.shape:
            self.scale = torch.empty_like(scale)
            self.zero_point = torch.empty_like(zero_point)
        self.scale.copy_(scale)
        self.zero_point.copy_(zero_point)

    def export_qparams(self) -> tuple[Tensor, Tensor]:
        return self.scale, self.zero_point


class FixedFakeQuantize(ObserverQParamsQuantizer):
    """Fake quantization with the observer's scale and zero point (no learned parameters).

    Example:
        >>> import torch
        >>> from mqbench.fake_quantize import FixedFakeQuantize
        >>> fq = FixedFakeQuantize(quant_min=0, quant_max=255)
        >>> _ = fq(torch.linspace(0, 2.55, 10))
        >>> fq.scale, fq.zero_point
        (tensor([0.0100]), tensor([0], dtype=torch.int32))
    """

    def quantize(self, x: Tensor) -> Tensor:
        return fake_quantize(x, self.scale, self.zero_point, self.quant_min, self.quant_max, self.axis)

    def _quantize_folded(self, weight: Tensor, factor: Tensor) -> Tensor:
        # the learned-scale kernel with a scale and zero point that take no gradient: the same
        # values and the same straight-through gradient to the weight as quantize
        scale, zero_point = self.scale.detach(), self.zero_point.detach()
        return folded_learnable_fake_quantize(
            weight, factor, scale, zero_point, self.quant_min, self.quant_max, self.axis, 1.0, scale_floor=None
        )
