"""NNIEFakeQuantize: the 8-bit log-domain quantization of HiSilicon's NNIE accelerator."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from mqbench.fake_quantize.quantize_base import QuantizeBase
from mqbench.observer import MinMaxObserver

__all__ = ["NNIEFakeQuantize", "exponent_offset", "nnie_quantize"]

_LN2 = math.log(2.0)
_TINY = torch.finfo(torch.float32).tiny  # data_max is floored here, so log(data_max) is finite


def _log2_times_16(x: Tensor) -> Tensor:
    # log2 as log(x) / ln 2 in float64: PyTorch and onnxruntime give the same values this way.
    # ln 2 is a float64 tensor: torch.onnx.export(dynamo=True) stores Python float constants in
    # float32 precision, which moved the result by up to one level.
    return 16.0 * (torch.log(x) / torch.tensor(_LN2, dtype=torch.float64, device=x.device))


def exponent_offset(data_max: Tensor) -> Tensor:
    """``z = round(16 log2(data_max)) - 127`` in float64: the exponent offset of NNIE's log grid.

    The one place the grid's offset is computed; the Q/DQ model and the NNIE parameter file read it here.
    """
    return torch.round(_log2_times_16(data_max.double().clamp(min=_TINY))) - 127.0


def nnie_quantize(x: Tensor, data_max: Tensor) -> Tensor:
    """NNIE's log-domain fake quantization (ONNX-exportable ops only; computed in float64).

    With ``z = round(16 log2(data_max)) - 127`` and ``n = round(16 log2|x|)``, a positive ``x``
    becomes ``2 ** ((k + z) / 16)`` with ``k = clamp(n - z, 0, 127)`` and a negative one
    ``-2 ** ((k + z) / 16)`` with ``k = clamp(n - z, 1, 127)``. Magnitudes below the threshold
    ``2 ** ((z - 16) / 16)`` (positive) or ``2 ** ((z - 15) / 16)`` (negative) become 0.

    Levels and thresholds are powers ``2 ** (m / 16)`` with integer ``m``, computed in float64
    and rounded to float32; the comparison with the threshold is made in float64 against that
    float32 value. PyTorch's and onnxruntime's float64 ``pow`` and ``log`` differ in the last
    bit for some arguments, but these float32 roundings, and ``round`` of the float64 log of a
    float32 input, come out identical (tests/fake_quantize/test_onnx_export.py checks every
    level and the float32 neighbours of every rounding boundary), so the exported graph
    reproduces PyTorch bit for bit. The result has the dtype of ``x``.
    """
    xd = x.double()
    z = exponent_offset(data_max)
    magnitude = xd.abs()
    positive = xd > 0
    low = (~positive).to(xd.dtype)  # the smallest code: 0 for positive x, 1 for negative x
    k = torch.clamp(torch.maximum(torch.round(_log2_times_16(magnitude)) - z, low), max=127.0)
    level = _power_of_2_sixteenths(k + z)
    keep = magnitude >= _power_of_2_sixteenths(z - 16.0 + low)
    value = torch.where(keep, torch.where(positive, level, -level), torch.zeros_like(level))
    return value.to(x.dtype)


def _power_of_2_sixteenths(m: Tensor) -> Tensor:
    """``2 ** (m / 16)`` for integer-valued float64 ``m``, rounded to float32 (returned as float64)."""
    return torch.pow(2.0, m / 16.0).float().double()


class _NNIEQuantizeSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, data_max: Tensor) -> Tensor:  # type: ignore[override]
        return nnie_quantize(x, data_max)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        return grad, None


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

    def export_qparams(self) -> tuple[Tensor, Tensor]:
        raise NotImplementedError(
            "NNIE's grid is logarithmic and has no (scale, zero point) equivalent; it exports through export_forward"
        )

    def export_forward(self, x: Tensor) -> Tensor:
        return nnie_quantize(x, self.data_max)
