"""What the integer reference modules share: the output grid, the float <-> integer boundary, weights.

Every module of :mod:`mqbench.nn.quantized` takes float tensors and returns float tensors
(the dequantized result), so a converted graph stays an ordinary float graph. Inside, the
input is quantized with its own parameters (float32 true division, round half to even,
clamp), the arithmetic runs on integers with the shared kernels of
:mod:`mqbench.nn.quantized.functional`, the result is requantized to the output grid with a
fixed-point multiplier and shift and dequantized. ``forward_integer`` runs the integer part
alone. The arithmetic runs in NumPy on the CPU (results come back on the input's device);
nothing is differentiable.

Quantization parameters are :class:`~mqbench.qparams.TensorQParams`;
:func:`qparams_from_quantizer` reads them from an mqbench fake quantizer
(``export_qparams()``).

Example:
    >>> import torch
    >>> from mqbench.fake_quantize import FixedFakeQuantize
    >>> from mqbench.nn.quantized.base import qparams_from_quantizer
    >>> fq = FixedFakeQuantize(quant_min=0, quant_max=255)
    >>> _ = fq(torch.linspace(0.0, 2.55, 10))
    >>> qparams = qparams_from_quantizer(fq)
    >>> round(float(qparams.scale[0]), 6), int(qparams.zero_point[0]), qparams.quant_max
    (0.01, 0, 255)
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor, nn

from mqbench.nn.quantized import functional as QF
from mqbench.qparams import TensorQParams

__all__ = ["QuantizedModule", "check_qparams", "qparams_from_quantizer"]


def qparams_from_quantizer(quantizer: nn.Module, kind: str = "activation") -> TensorQParams:
    """The :class:`TensorQParams` of an mqbench fake quantizer (its ``export_qparams()`` and integer range).

    Raises ``ValueError`` for objects that are not fake quantizers, for logarithmic grids and,
    with ``kind="activation"``, for quantizers whose parameters depend on each input.
    """
    export = getattr(quantizer, "export_qparams", None)
    if not callable(export) or not hasattr(quantizer, "quant_min"):
        raise ValueError(f"expected an mqbench fake quantizer (with export_qparams()), got {type(quantizer).__name__}")
    name = type(quantizer).__name__
    if getattr(quantizer, "deploy_grid", "linear") != "linear":
        raise ValueError(f"{name} quantizes on a {quantizer.deploy_grid!r} grid; integer modules need a linear one")
    if kind == "activation" and not getattr(quantizer, "deploys_activations", True):
        raise ValueError(f"{name} derives its parameters from each input; it has no fixed activation grid")
    scale, zero_point = export()
    return TensorQParams(
        scale.detach().cpu().float().numpy(),
        zero_point.detach().cpu().numpy(),
        int(quantizer.quant_min),  # type: ignore[arg-type]
        int(quantizer.quant_max),  # type: ignore[arg-type]
        getattr(quantizer, "axis", None),
        kind=kind,
    )


def check_qparams(qparams: Any, role: str, per_tensor: bool = True) -> TensorQParams:
    """``qparams`` if it is a linear-grid :class:`TensorQParams` (per tensor unless ``per_tensor=False``)."""
    if not isinstance(qparams, TensorQParams):
        raise ValueError(f"the {role} parameters must be a TensorQParams, got {type(qparams).__name__}")
    if qparams.grid != "linear":
        raise ValueError(f"the {role} parameters describe a {qparams.grid!r} grid; integer modules need a linear one")
    if per_tensor and (qparams.axis is not None or qparams.scale.size != 1):
        raise ValueError(
            f"the {role} must be quantized per tensor, got {qparams.scale.size} scales along axis {qparams.axis}"
        )
    return qparams


def to_numpy(x: Tensor) -> np.ndarray:
    return x.detach().cpu().numpy()


class QuantizedModule(nn.Module):
    """Base of the integer reference modules: the output grid and the integer <-> float helpers.

    Buffers ``scale`` (float32 ``[1]``) and ``zero_point`` (int32 ``[1]``) hold the output grid,
    ``quant_min`` / ``quant_max`` its integer range. With ``relu`` the output is clamped below
    at the output zero point (a ReLU on the integers), with ``relu_max`` also above at the
    quantized ``relu_max`` (ReLU6). ``rounding`` is the requantization's tie rule
    (:data:`~mqbench.nn.quantized.functional.ROUNDINGS`).
    """

    is_quantization_leaf: ClassVar[bool] = True  # traced as one call
    scale: Tensor
    zero_point: Tensor
    quant_min: int
    quant_max: int

    def __init__(
        self,
        output_qparams: TensorQParams,
        relu: bool = False,
        relu_max: float | None = None,
        rounding: str = "half_up",
    ) -> None:
        super().__init__()
        if rounding not in QF.ROUNDINGS:
            raise ValueError(f"rounding must be one of {QF.ROUNDINGS}, got {rounding!r}")
        if relu_max is not None and (not relu or not relu_max > 0):
            raise ValueError(
                f"relu_max (the upper clamp of a ReLU6) needs relu=True and a positive value, got {relu_max}"
            )
        self._register_grid("", check_qparams(output_qparams, "output"))
        self.rounding = rounding
        self.relu = bool(relu)
        self.relu_max = None if relu_max is None else float(relu_max)

    # -- grids ---------------------------------------------------------------------------------
    def _register_grid(self, prefix: str, qparams: TensorQParams) -> None:
        """Buffers ``<prefix>scale`` / ``<prefix>zero_point`` and attributes ``<prefix>quant_min`` / ``_max``."""
        self.register_buffer(f"{prefix}scale", torch.from_numpy(qparams.scale.copy()))
        self.register_buffer(f"{prefix}zero_point", torch.from_numpy(qparams.zero_point.copy()))
        setattr(self, f"{prefix}quant_min", int(qparams.quant_min))
        setattr(self, f"{prefix}quant_max", int(qparams.quant_max))

    def _grid(self, prefix: str) -> tuple[np.ndarray, np.ndarray, int, int]:
        """(scale float32, zero point int64, quant_min, quant_max) of a per-tensor grid, as NumPy scalars."""
        scale = to_numpy(getattr(self, f"{prefix}scale")).astype(np.float32).reshape(())
        zero_point = to_numpy(getattr(self, f"{prefix}zero_point")).astype(np.int64).reshape(())
        return scale, zero_point, getattr(self, f"{prefix}quant_min"), getattr(self, f"{prefix}quant_max")

    def _quantize(self, prefix: str, x: Tensor) -> Tensor:
        """``x`` quantized on the grid ``prefix`` (int64, on ``x``'s device)."""
        if not torch.is_floating_point(x):
            raise ValueError(f"{type(self).__name__} takes float tensors, got {x.dtype}; use forward_integer")
        return torch.from_numpy(QF.quantize(to_numpy(x.float()), *self._grid(prefix))).to(x.device)

    def _integers(self, prefix: str, q: Tensor) -> np.ndarray:
        """Integer input ``q`` as int64 NumPy, checked against the range of the grid ``prefix``."""
        if torch.is_floating_point(q) or torch.is_complex(q) or q.dtype == torch.bool:
            raise ValueError(f"forward_integer takes integer tensors, got {q.dtype}; use forward for floats")
        values = to_numpy(q).astype(np.int64)
        low, high = getattr(self, f"{prefix}quant_min"), getattr(self, f"{prefix}quant_max")
        if values.size and (values.min() < low or values.max() > high):
            raise ValueError(f"integer inputs {values.min()}..{values.max()} lie outside [{low}, {high}]")
        return values

    @property
    def output_qparams(self) -> TensorQParams:
        scale, zero_point, low, high = self._grid("")
        return TensorQParams(scale.reshape(1), zero_point.reshape(1), low, high)

    def output_bounds(self) -> tuple[int, int]:
        """The integer output range after the ReLU clamps: ``[zero_point, Q(relu_max)]`` within the grid."""
        scale, zero_point, low, high = self._grid("")
        if self.relu:
            low = min(max(int(zero_point), low), high)
        if self.relu_max is not None:
            high = int(QF.quantize(np.float32(self.relu_max), scale, zero_point, low, high))
        return low, high

    def _requantize(self, acc: np.ndarray, m0: Any, shift: Any) -> np.ndarray:
        """Accumulators to the output grid (fixed point, output zero point, ReLU clamps, saturation)."""
        low, high = self.output_bounds()
        return QF.requantize(acc, m0, shift, self._grid("")[1], low, high, self.rounding)

    def dequantize_output(self, y: Tensor) -> Tensor:
        """``(y - zero_point) * scale`` in float32 for output integers ``y``."""
        scale, zero_point = self._grid("")[:2]
        return torch.from_numpy(QF.dequantize(to_numpy(y), scale, zero_point)).to(y.device)

    def _float_output(self, y: np.ndarray, like: Tensor) -> Tensor:
        scale, zero_point = self._grid("")[:2]
        out = torch.from_numpy(QF.dequantize(y, scale, zero_point)).to(like.device)
        return out.to(like.dtype) if torch.is_floating_point(like) else out

    def _output_repr(self) -> str:
        text = f"scale={float(self.scale[0])}, zero_point={int(self.zero_point[0])}"
        if self.relu_max is not None:
            text += f", relu_max={self.relu_max}"
        if self.rounding != "half_up":
            text += f", rounding={self.rounding!r}"
        return text
