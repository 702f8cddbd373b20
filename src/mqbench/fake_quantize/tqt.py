"""TqtFakeQuantize: Trained Quantization Thresholds (Jain et al., MLSys 2020)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from mqbench.fake_quantize.quantize_base import QuantizeBase
from mqbench.functional import EPS, ceil_ste, folded_learnable_fake_quantize, learnable_fake_quantize
from mqbench.observer import MinMaxObserver

__all__ = ["TqtFakeQuantize"]


class TqtFakeQuantize(QuantizeBase):
    """Power-of-two scale from a learned log2 threshold; symmetric grids only (zero point 0).

    ``log2_threshold`` (``log2 t``, a :class:`torch.nn.Parameter` of shape ``[1]`` or ``[C]``)
    gives ``scale = 2 ** ceil(log2 t) / 2 ** (bits - 1)`` on a signed grid and
    ``2 ** ceil(log2 t) / 2 ** bits`` on an unsigned one (``quant_min >= 0``). While the observer
    is enabled, ``log2 t`` is set to ``log2(max |range|)`` of the observer's clipping range.

    Gradient to ``log2 t`` (the ceil passes gradients straight through):
    ``s ln2 (round(x/s) - x/s)`` inside the grid, ``s ln2 quant_min`` below and
    ``s ln2 quant_max`` above; to ``x``: 1 inside, 0 outside. ``scale`` and ``zero_point`` are
    read-only properties derived from ``log2_threshold``. ONNX export uses the fixed equivalent.

    Example:
        >>> import torch
        >>> from mqbench.fake_quantize import TqtFakeQuantize
        >>> fq = TqtFakeQuantize(quant_min=-128, quant_max=127, qscheme=torch.per_tensor_symmetric)
        >>> _ = fq(torch.tensor([-3.0, 1.0]))   # threshold 3 -> 4 = 2**2, scale 4 / 128
        >>> fq.scale, fq.zero_point
        (tensor([0.0312]), tensor([0], dtype=torch.int32))
        >>> fq.disable_observer()
        >>> fq(torch.tensor([0.1, 5.0])).sum().backward()
        >>> round(fq.log2_threshold.grad.item(), 4)   # s ln2 ((3 - 3.2) + 127)
        2.7466
    """

    log2_threshold: nn.Parameter

    def __init__(self, observer: Any = MinMaxObserver, **observer_kwargs: Any) -> None:
        super().__init__(observer, **observer_kwargs)
        if not self.symmetric:
            raise ValueError(
                f"TQT uses power-of-two scales with zero point 0; use a symmetric qscheme, not {self.qscheme}"
            )
        self.log2_threshold = nn.Parameter(torch.zeros(1))

    @property
    def _levels_per_threshold(self) -> float:
        return 2.0 ** (self.bitwidth - 1) if self.quant_min < 0 else 2.0**self.bitwidth

    def _scale(self) -> Tensor:
        return torch.pow(2.0, ceil_ste(self.log2_threshold)) / self._levels_per_threshold

    @property
    def scale(self) -> Tensor:
        """``2 ** ceil(log2_threshold)`` divided by the number of levels per threshold (read-only)."""
        return self._scale().detach()

    @property
    def zero_point(self) -> Tensor:
        """Always 0 (int32, one per scale)."""
        return torch.zeros(self.log2_threshold.shape, dtype=torch.int32, device=self.log2_threshold.device)

    def update_qparams(self) -> None:
        observer = self.activation_post_process
        if not observer.calibrated:
            return
        low, high = observer.clip_range()
        amax = torch.maximum(-low, high).clamp(min=0).reshape(-1)
        with torch.no_grad():
            if self.log2_threshold.shape != amax.shape:
                self.log2_threshold.data = torch.empty_like(amax)
            # an all-zero range is taken as [0, 1] (qparams_from_range's convention)
            amax = torch.where(amax == 0, torch.ones_like(amax), amax.clamp(min=EPS))
            self.log2_threshold.copy_(torch.log2(amax))

    def quantize(self, x: Tensor) -> Tensor:
        scale = self._scale()
        zero_point = torch.zeros_like(scale, dtype=x.dtype)
        return learnable_fake_quantize(x, scale, zero_point, self.quant_min, self.quant_max, self.axis, 1.0)

    def _quantize_folded(self, weight: Tensor, factor: Tensor) -> Tensor:
        scale = self._scale()
        zero_point = torch.zeros_like(scale, dtype=weight.dtype)
        return folded_learnable_fake_quantize(
            weight, factor, scale, zero_point, self.quant_min, self.quant_max, self.axis, 1.0, scale_floor=None
        )

    def export_qparams(self) -> tuple[Tensor, Tensor]:
        return self.scale, self.zero_point
