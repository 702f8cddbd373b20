"""DSQFakeQuantize: Differentiable Soft Quantization (Gong et al., ICCV 2019)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from mqbench import kernels
from mqbench.fake_quantize.fixed import FixedFakeQuantize
from mqbench.functional import broadcast_to_axis, fake_quantize
from mqbench.observer import MinMaxObserver

__all__ = ["DSQFakeQuantize", "soft_quantize"]

# alpha is used clamped to this interval (0 and 1 are the limits hard rounding and identity).
ALPHA_RANGE = (1e-4, 1.0 - 1e-4)


def soft_quantize(
    x: Tensor,
    scale: Tensor,
    zero_point: Tensor,
    alpha: Tensor,
    quant_min: int,
    quant_max: int,
    ch_axis: int | None = None,
) -> Tensor:
    """DSQ's soft quantizer: a differentiable approximation of fake quantization.

    With ``v = clamp(x / scale + zero_point, quant_min, quant_max)``, ``i = floor(v)`` and
    ``f = v - i``, the soft grid value is ``i + (1 + tanh(k (f - 1/2)) / (1 - alpha)) / 2`` with
    ``k = log(2 / alpha - 1)``, so that ``tanh(k / 2) = 1 - alpha`` and the curve meets the grid
    at every integer; the result is mapped back as ``(soft - zero_point) * scale``. Small
    ``alpha`` approaches rounding, ``alpha`` near 1 the identity. Differentiable in ``x`` and
    ``alpha`` (no gradient outside the grid).
    """
    s = broadcast_to_axis(scale, x, ch_axis)
    z = broadcast_to_axis(zero_point, x, ch_axis).to(x.dtype)
    v = torch.clamp(x / s + z, quant_min, quant_max)
    lower = torch.floor(v).detach()
    k = torch.log(2.0 / alpha - 1.0)
    phi = torch.tanh(k * (v - lower - 0.5)) / (1.0 - alpha)
    return (lower + 0.5 * (1.0 + phi) - z) * s


class _DSQFunction(torch.autograd.Function):
    """Hard fake quantization forward; the gradient of :func:`soft_quantize` backward."""

    @staticmethod
    def forward(ctx, x, scale, zero_point, alpha, quant_min, quant_max, ch_axis):  # type: ignore[override]
        ctx.save_for_backward(x, scale, zero_point, alpha)
        ctx.settings = (quant_min, quant_max, ch_axis)
        return fake_quantize(x, scale, zero_point, quant_min, quant_max, ch_axis)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x, scale, zero_point, alpha = ctx.saved_tensors
        quant_min, quant_max, ch_axis = ctx.settings
        if kernels.usable(x, grad):
            axis = -1 if ch_axis is None else ch_axis % x.dim()
            grad_x, grad_alpha = kernels.module().dsq_backward(
                grad, x, scale, zero_point, float(alpha), quant_min, quant_max, axis
            )
            return grad_x, None, None, grad_alpha.to(alpha.dtype), None, None, None
        with torch.enable_grad():
            x_, alpha_ = x.detach().requires_grad_(), alpha.detach().requires_grad_()
            soft = soft_quantize(x_, scale, zero_point, alpha_, quant_min, quant_max, ch_axis)
            grad_x, grad_alpha = torch.autograd.grad(soft, (x_, alpha_), grad)
        return grad_x, None, None, grad_alpha, None, None, None


class DSQFakeQuantize(FixedFakeQuantize):
    """Fake quantization whose gradient is that of DSQ's soft tanh staircase.

    Scale and zero point come from the observer (buffers, as in
    :class:`~mqbench.fake_quantize.FixedFakeQuantize`). In training mode the forward value is
    the hard fake-quantized value, while gradients flow through :func:`soft_quantize`, reaching
    ``x`` and the learnable temperature ``alpha`` (a :class:`torch.nn.Parameter`, used clamped to
    ``ALPHA_RANGE`` inside ``(0, 1)`` with a straight-through gradient, so it can move back). In
    eval mode and in ONNX export it is plain fixed fake quantization.

    Example:
        >>> import torch
        >>> from mqbench.fake_quantize import DSQFakeQuantize
        >>> fq = DSQFakeQuantize(alpha=0.2, quant_min=0, quant_max=15)
        >>> _ = fq(torch.tensor([0.0, 1.5]))   # calibrate: scale 0.1
        >>> x = torch.tensor([0.4, 0.44, 0.449], requires_grad=True)
        >>> y = fq(x); y.tolist()   # the hard values
        [0.4000000059604645, 0.4000000059604645, 0.4000000059604645]
        >>> y.sum().backward(); x.grad   # the soft slope, steepest at the rounding boundary 0.45
        tensor([0.4944, 1.3090, 1.3726])
    """

    alpha: nn.Parameter

    def __init__(self, observer: Any = MinMaxObserver, alpha: float = 0.4, **observer_kwargs: Any) -> None:
        super().__init__(observer, **observer_kwargs)
        if not 0.0 < alpha < 1.0:
            raise ValueError(f"alpha must lie in (0, 1), got {alpha}")
        self.alpha = nn.Parameter(torch.tensor([float(alpha)]))

    def effective_alpha(self) -> Tensor:
        """``alpha`` clamped to ``ALPHA_RANGE`` (value), with an identity gradient."""
        low, high = ALPHA_RANGE
        moved = self.alpha - self.alpha.detach()
        return torch.where(self.alpha < low, moved + low, torch.where(self.alpha > high, moved + high, self.alpha))

    def soft_quantize(self, x: Tensor) -> Tensor:
        """The differentiable surrogate used for gradients in training mode."""
        return soft_quantize(
            x, self.scale, self.zero_point, self.effective_alpha(), self.quant_min, self.quant_max, self.axis
        )

    def quantize(self, x: Tensor) -> Tensor:
        if not self.training or not torch.is_grad_enabled():
            return super().quantize(x)
        return _DSQFunction.apply(
            x, self.scale, self.zero_point, self.effective_alpha(), self.quant_min, self.quant_max, self.axis
        )

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, alpha={self.alpha.detach().tolist()}"
