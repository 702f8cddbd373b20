"""LearnableFakeQuantize: LSQ (Esser et al., 2020) with the LSQ+ learnable zero point (Bhalgat et al., 2020)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from mqbench.fake_quantize.quantize_base import QuantizeBase
from mqbench.functional import EPS, folded_learnable_fake_quantize, learnable_fake_quantize
from mqbench.observer import MinMaxObserver

__all__ = ["LearnableFakeQuantize", "grad_scale"]


def grad_scale(t: Tensor, scale: float | Tensor) -> Tensor:
    """``t`` forward, its gradient multiplied by ``scale`` backward (LSQ's gradient scaling)."""
    return (t - t * scale).detach() + t * scale


def _clamp_straight_through(t: Tensor, low: float, high: float) -> Tensor:
    """``clamp(t, low, high)`` in value, identity gradient (a clamped parameter can still move back)."""
    moved = t - t.detach()  # exactly 0 in value, identity in gradient
    return torch.where(t < low, moved + low, torch.where(t > high, moved + high, t))


class LearnableFakeQuantize(QuantizeBase):
    """Fake quantization with a learned step size (LSQ) and, for affine schemes, a learned zero point (LSQ+).

    ``scale`` and ``zero_point`` are :class:`torch.nn.Parameter` of shape ``[1]`` (per-tensor)
    or ``[C]`` (per-channel). While the observer is enabled, each forward overwrites them with
    the observer's qparams (calibration initialises the learned values); with the observer
    off they are trained. The zero point is a float parameter that always acts as an integer
    (rounded with a straight-through estimator, kept in ``[quant_min, quant_max]``); for
    symmetric schemes it stays 0 and receives no gradient.

    Gradients (``v = x / s``, integer zero point ``z``): to ``x`` 1 inside the grid, 0 outside;
    to ``s`` ``round(v) - v`` inside and ``quant_min - z`` / ``quant_max - z`` below / above;
    to ``z`` 0 inside and ``-s`` outside. With ``use_grad_scaling`` the scale and zero-point
    gradients are multiplied by ``g = 1 / sqrt(N * quant_max)``, ``N`` the number of elements
    per scale (LSQ section 2.2). The scale is used as ``max(|scale|, eps)``, whose gradient
    is that of ``|scale|`` everywhere, so a scale that reached the floor can still grow.

    ONNX export uses the fixed equivalent: ``max(|scale|, eps)`` and the rounded zero point.

    Example:
        >>> import torch
        >>> from mqbench.fake_quantize import LearnableFakeQuantize
        >>> fq = LearnableFakeQuantize(quant_min=-127, quant_max=127, qscheme=torch.per_tensor_symmetric)
        >>> _ = fq(torch.tensor([-1.27, 1.27]))   # calibration copies the observer's scale
        >>> fq.scale
        Parameter containing:
        tensor([0.0100], requires_grad=True)
        >>> fq.disable_observer()
        >>> fq(torch.tensor([0.333, 2.0])).sum().backward()
        >>> round(fq.scale.grad.item(), 4)   # ((33 - 33.3) + 127) / sqrt(2 * 127)
        7.9499
    """

    scale: nn.Parameter
    zero_point: nn.Parameter

    def __init__(
        self,
        observer: Any = MinMaxObserver,
        scale: float = 1.0,
        zero_point: float = 0.0,
        use_grad_scaling: bool = True,
        **observer_kwargs: Any,
    ) -> None:
        super().__init__(observer, **observer_kwargs)
        if not scale > 0:
            raise ValueError(f"scale must be positive, got {scale}")
        if self.symmetric and zero_point != 0:
            raise ValueError(f"a symmetric qscheme ({self.qscheme}) has zero point 0, got zero_point={zero_point}")
        self.use_grad_scaling = bool(use_grad_scaling)
        # Copies of the batch this quantizer's input is one part of (data-parallel training sets it to the
        # number of processes, so that N counts the global batch as one process with it would).
        self.batch_replicas = 1
        self.scale = nn.Parameter(torch.tensor([float(scale)]))
        self.zero_point = nn.Parameter(torch.tensor([float(zero_point)]), requires_grad=not self.symmetric)

    def update_qparams(self) -> None:
        scale, zero_point = self.calculate_qparams()
        with torch.no_grad():
            if self.scale.shape != scale.shape:
                self.scale.data = torch.empty_like(scale)
                self.zero_point.data = torch.empty_like(scale)
            self.scale.copy_(scale)
            self.zero_point.copy_(zero_point)

    def grad_factor(self, x: Tensor) -> float:
        """The LSQ gradient scale ``1 / sqrt(N * quant_max)`` for input ``x`` (1.0 without grad scaling)."""
        if not self.use_grad_scaling:
            return 1.0
        per_scale = x.numel() // x.shape[self.ch_axis] if self.is_per_channel and x.dim() > 0 else x.numel()
        return 1.0 / math.sqrt(max(per_scale * self.batch_replicas, 1) * max(self.quant_max, 1))

    def _effective_zero_point(self) -> Tensor:
        if self.symmetric:
            return self.zero_point.detach()  # fixed at 0
        return _clamp_straight_through(self.zero_point, self.quant_min, self.quant_max)

    def quantize(self, x: Tensor) -> Tensor:
        return self._learnable_quantize(x)

    def _learnable_quantize(self, x: Tensor, drop: Tensor | None = None, threshold: int = 256) -> Tensor:
        return learnable_fake_quantize(
            x,
            self.scale,
            self._effective_zero_point(),
            self.quant_min,
            self.quant_max,
            self.axis,
            self.grad_factor(x),
            scale_floor=EPS,
            drop=drop,
            threshold=threshold,
        )

    def _quantize_folded(self, weight: Tensor, factor: Tensor) -> Tensor:
        return folded_learnable_fake_quantize(
            weight,
            factor,
            self.scale,
            self._effective_zero_point(),
            self.quant_min,
            self.quant_max,
            self.axis,
            self.grad_factor(weight),
            scale_floor=EPS,
        )

    def export_qparams(self) -> tuple[Tensor, Tensor]:
        scale = self.scale.detach().abs().clamp(min=EPS)
        zero_point = self.zero_point.detach().clamp(self.quant_min, self.quant_max).round().to(torch.int32)
        return scale, zero_point

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, use_grad_scaling={self.use_grad_scaling}"
