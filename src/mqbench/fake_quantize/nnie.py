"""NNIEFakeQuantize: the 8-bit log-domain quantization of HiSilicon's NNIE accelerator."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from mqbench import kernels
from mqbench.fake_quantize.quantize_base import QuantizeBase
from mqbench.grids import exponent_offset, nnie_quantize, nnie_quantize_fused
from mqbench.observer import MinMaxObserver

__all__ = ["NNIEFakeQuantize", "exponent_offset", "nnie_quantize"]


class _NNIEQuantizeSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, data_max: Tensor) -> Tensor:  # type: ignore[override]
        return nnie_quantize_fused(x, data_max)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        return grad, None


class _FoldedNNIEQuantizeSTE(torch.autograd.Function):
    """``nnie_quantize(w * f, data_max) * (1 / f)`` with ``f`` per output channel (axis 0).

    The same values as the three ops. Gradients, with the identity through the grid:
    ``g`` to ``w`` and ``sum(g * (w - out)) / f`` to each ``f`` (from ``w * f`` and from ``1 / f``).
    """

    @staticmethod
    def forward(ctx, w: Tensor, factor: Tensor, data_max: Tensor) -> Tensor:  # type: ignore[override]
        out = nnie_quantize_fused(w, data_max, factor)
        ctx.save_for_backward(w, factor, out)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        w, factor, out = ctx.saved_tensors
        if kernels.usable(grad, w, out, factor):
            grad_factor = kernels.module().folded_identity_factor_grad(grad, w, out, factor)
        else:
            rows = factor.numel()
            grad_factor = torch.linalg.vecdot(grad.reshape(rows, -1), (w - out).reshape(rows, -1)) / factor
        return grad, grad_factor, None


class NNIEFakeQuantize(QuantizeBase):
    """HiSilicon NNIE's 8-bit logarithmic quantization (see :func:`nnie_quantize`).

    The only statistic is the buffer ``data_max``, the running maximum of ``max(-min, max)``
    of the observer's clipping range while the observer is enabled (with the default
    :class:`~mqbench.observer.MinMaxObserver`, the running max ``|x|``). The grid is NNIE's
    fixed 8-bit log grid, per tensor; the observer's ``quant_min`` / ``quant_max`` are not used,
    and per-channel schemes are rejected. Gradient: straight through (identity).

    The grid is not linear, so there is no Q/DQ form: ONNX export writes the same formula with
    elementwise ops (Log, Div, Round, Max, Min, Pow, Where, in float64), which onnxruntime
    evaluates to the same numbers. The read-only ``scale`` is ``2 ** (z / 16)``, the smallest
    positive level (the level spacing is a factor ``2 ** (1/16)``), and ``zero_point`` is 0;
    both are informative only, and :meth:`export_qparams` raises.

    Example:
        >>> import torch
        >>> from mqbench.fake_quantize import NNIEFakeQuantize
        >>> fq = NNIEFakeQuantize()
        >>> y = fq(torch.tensor([-8.0, -1.1, 0.001, 0.0, 3.0, 8.0]))
        >>> y.tolist()
        [-8.0, -1.0905077457427979, 0.0, 0.0, 2.9536523818969727, 8.0]
        >>> fq.data_max, fq.scale
        (tensor([8.]), tensor([0.0326]))
    """

    data_max: Tensor
    deploy_grid = "log"

    def __init__(self, observer: Any = MinMaxObserver, **observer_kwargs: Any) -> None:
        super().__init__(observer, **observer_kwargs)
        if self.is_per_channel:
            raise ValueError(f"NNIE quantizes per tensor; use a per-tensor qscheme, not {self.qscheme}")
        self.register_buffer("data_max", torch.zeros(1))

    @property
    def scale(self) -> Tensor:
        """``2 ** (z / 16)``: the smallest positive level (informative; the grid is logarithmic)."""
        return torch.pow(2.0, exponent_offset(self.data_max) / 16.0).float()

    @property
    def zero_point(self) -> Tensor:
        """Always 0 (informative)."""
        return torch.zeros(1, dtype=torch.int32, device=self.data_max.device)

    def update_qparams(self) -> None:
        observer = self.activation_post_process
        if not observer.calibrated:
            return
        low, high = observer.clip_range()
        amax = torch.maximum(-low, high).amax().clamp(min=0.0).reshape(1).to(self.data_max)
        self.data_max.copy_(torch.maximum(self.data_max, amax))

    def quantize(self, x: Tensor) -> Tensor:
        return _NNIEQuantizeSTE.apply(x, self.data_max)

    def _quantize_folded(self, weight: Tensor, factor: Tensor) -> Tensor | None:
        if weight.dim() < 1 or factor.dim() != 1 or factor.numel() != weight.shape[0]:
            return None
        return _FoldedNNIEQuantizeSTE.apply(weight, factor, self.data_max)

    def export_qparams(self) -> tuple[Tensor, Tensor]:
        raise NotImplementedError(
            "NNIE's grid is logarithmic and has no (scale, zero point) equivalent; it exports through export_forward"
        )

    def export_forward(self, x: Tensor) -> Tensor:
        return nnie_quantize(x, self.data_max)
