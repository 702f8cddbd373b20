"""PACTFakeQuantize: a learned clipping level (Choi et al., 2018, "PACT: Parameterized Clipping Activation")."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from mqbench import kernels
from mqbench.fake_quantize.quantize_base import QuantizeBase
from mqbench.functional import fake_quantize, fake_quantize_for_export, qparams_from_range
from mqbench.observer import MinMaxObserver

__all__ = ["PACTFakeQuantize"]


class _PACTFunction(torch.autograd.Function):
    """``fake_quant(clip(x, lower, alpha))`` with PACT's straight-through gradients."""

    @staticmethod
    def forward(ctx, x, alpha, scale, zero_point, quant_min, quant_max, signed):  # type: ignore[override]
        top = alpha.to(x.dtype)
        clipped = torch.clamp(x, -top if signed else torch.zeros_like(top), top)
        ctx.save_for_backward(x, alpha)
        ctx.signed = signed
        return fake_quantize(clipped, scale, zero_point, quant_min, quant_max)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x, alpha = ctx.saved_tensors
        if kernels.usable(x, grad):
            grad_x, grad_alpha = kernels.module().pact_backward(grad, x, float(alpha), ctx.signed)
            return grad_x, grad_alpha.to(alpha.dtype), None, None, None, None, None
        above = x >= alpha
        below = x <= -alpha if ctx.signed else x < 0
        grad_x = grad.masked_fill(above | below, 0.0)
        grad_alpha = grad[above].sum() - (grad[below].sum() if ctx.signed else 0.0)
        return grad_x, grad_alpha.reshape(1).to(alpha.dtype), None, None, None, None, None


class PACTFakeQuantize(QuantizeBase):
    """Clip to a learned level ``alpha``, then fake-quantize the clipped range.

    ``y = fake_quant(clip(x, lower, alpha))`` with ``lower = -alpha`` on a signed grid
    (``quant_min < 0``) and ``lower = 0`` otherwise. The scale and zero point are those of
    :func:`mqbench.functional.qparams_from_range` on ``[lower, alpha]`` for the quantizer's
    scheme; they are derived from ``alpha`` on every use (read-only ``scale`` / ``zero_point``
    properties), never stored.

    Gradients (the paper's straight-through estimator): to ``x`` 1 inside ``[lower, alpha]``,
    0 outside; to ``alpha`` 1 where ``x >= alpha``, -1 where ``x <= -alpha`` on a signed grid,
    0 elsewhere. The rounding passes gradients straight through and the scale's dependence on
    ``alpha`` is not differentiated.

    The observer only records (its statistics can guide the choice of ``alpha``). PACT learns
    one clipping level per tensor, so per-channel schemes are rejected.
    ONNX export: the clip followed by the fixed QuantizeLinear/DequantizeLinear.

    Example:
        >>> import torch
        >>> from mqbench.fake_quantize import PACTFakeQuantize
        >>> fq = PACTFakeQuantize(alpha=2.55, quant_min=0, quant_max=255)
        >>> fq.scale, fq.zero_point
        (tensor([0.0100]), tensor([0], dtype=torch.int32))
        >>> y = fq(torch.tensor([-1.0, 0.333, 3.0, 4.0]))
        >>> y.tolist()
        [0.0, 0.32999998331069946, 2.549999952316284, 2.549999952316284]
        >>> y.sum().backward(); fq.alpha.grad
        tensor([2.])
    """

    alpha: nn.Parameter

    def __init__(self, observer: Any = MinMaxObserver, alpha: float = 6.0, **observer_kwargs: Any) -> None:
        super().__init__(observer, **observer_kwargs)
        if self.is_per_channel:
            raise ValueError(f"PACT learns one clipping level per tensor; use a per-tensor qscheme, not {self.qscheme}")
        if not alpha > 0:
            raise ValueError(f"alpha must be positive, got {alpha}")
        self.alpha = nn.Parameter(torch.tensor([float(alpha)]))

    @property
    def signed(self) -> bool:
        """Whether the grid is signed, so that the clip is ``[-alpha, alpha]`` rather than ``[0, alpha]``."""
        return self.quant_min < 0

    def _qparams(self) -> tuple[Tensor, Tensor]:
        alpha = self.alpha.detach()
        lower = -alpha if self.signed else torch.zeros_like(alpha)
        return qparams_from_range(lower, alpha, self.quant_min, self.quant_max, self.symmetric, self.pot_scale)

    @property
    def scale(self) -> Tensor:
        """The scale of the grid on ``[lower, alpha]`` (derived, read-only)."""
        return self._qparams()[0]

    @property
    def zero_point(self) -> Tensor:
        """The integer zero point of the grid on ``[lower, alpha]`` (derived, read-only)."""
        return self._qparams()[1]

    def update_qparams(self) -> None:
        """Nothing to update: the qparams follow ``alpha``; the observer only records."""

    def quantize(self, x: Tensor) -> Tensor:
        scale, zero_point = self._qparams()
        return _PACTFunction.apply(x, self.alpha, scale, zero_point, self.quant_min, self.quant_max, self.signed)

    def export_qparams(self) -> tuple[Tensor, Tensor]:
        return self._qparams()

    def export_forward(self, x: Tensor) -> Tensor:
        alpha = self.alpha.detach().to(x.dtype)
        x = torch.minimum(x, alpha)
        x = torch.maximum(x, -alpha) if self.signed else torch.clamp(x, min=0.0)
        scale, zero_point = self._qparams()
        return fake_quantize_for_export(x, scale, zero_point, self.quant_min, self.quant_max)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, alpha={self.alpha.detach().tolist()}"
