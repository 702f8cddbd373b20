"""Integer reference convolutions: Conv1d/2d/3d, their ReLU variants, ConvTranspose2d (+ ReLU).

The accumulation is the exact integer convolution of ``x - x_zp`` and ``w - w_zp``
(:func:`~mqbench.nn.quantized.functional.conv_accumulate`); zero padding pads with the input
zero point (the integer of 0.0). Weights are per tensor or per output channel: axis 0 of a
convolution weight, axis 1 (``out_channels / groups`` values, shared by the groups) of a
transposed one. Only ``padding_mode="zeros"`` is supported.

Example:
    >>> import numpy as np
    >>> import torch
    >>> from torch import nn
    >>> from mqbench.qparams import TensorQParams
    >>> from mqbench.nn.quantized import Conv2d
    >>> _ = torch.manual_seed(0)
    >>> act = TensorQParams(np.array([0.05]), np.array([0]), -128, 127)
    >>> weight = TensorQParams(np.array([0.01]), np.array([0]), -127, 127, kind="weight")
    >>> q = Conv2d.from_float(nn.Conv2d(3, 4, 3, padding=1), act, weight, act)
    >>> q
    Conv2d(3, 4, kernel_size=(3, 3), stride=(1, 1), padding=(1, 1), scale=0.05000000074505806, zero_point=0)
    >>> x = torch.randn(1, 3, 5, 5)
    >>> q(x).shape, q.forward_integer(q.quantize_input(x)).dtype
    (torch.Size([1, 4, 5, 5]), torch.int64)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import numpy as np
from torch import nn

from mqbench.nn.quantized import functional as QF
from mqbench.nn.quantized.weighted import WeightedQuantizedModule
from mqbench.qparams import TensorQParams

__all__ = [
    "Conv1d",
    "Conv2d",
    "Conv3d",
    "ConvReLU1d",
    "ConvReLU2d",
    "ConvReLU3d",
    "ConvTranspose2d",
    "ConvTransposeReLU2d",
]

_Size = int | Sequence[int]


def _tuple(value: _Size, dims: int, what: str) -> tuple[int, ...]:
    values = (int(value),) * dims if isinstance(value, int) else tuple(int(v) for v in value)
    if len(values) != dims:
        raise ValueError(f"{what} {value!r} does not fit {dims} spatial dimensions")
    return values


class _ConvBase(WeightedQuantizedModule):
    """Geometry shared by convolutions and transposed convolutions."""

    def _geometry(
        self, in_channels: int, out_channels: int, kernel_size: _Size, stride: _Size, dilation: _Size, groups: int
    ) -> None:
        dims = self._SPATIAL
        self.in_channels, self.groups = int(in_channels), int(groups)
        self.kernel_size = _tuple(kernel_size, dims, "kernel_size")
        self.stride = _tuple(stride, dims, "stride")
        self.dilation = _tuple(dilation, dims, "dilation")
        if min(self.kernel_size + self.stride + self.dilation) < 1:
            raise ValueError("kernel_size, stride and dilation must be positive")

    @staticmethod
    def _check(in_channels: int, out_channels: int, groups: int, padding_mode: str) -> None:
        if groups < 1 or in_channels % groups or out_channels % groups:
            raise ValueError(f"{in_channels} input and {out_channels} output channels do not fit groups={groups}")
        if padding_mode != "zeros":
            raise ValueError(f"only padding_mode='zeros' is supported, got {padding_mode!r}")

    def _check_input(self, x: np.ndarray) -> None:
        if x.shape[1] != self.in_channels:
            raise ValueError(f"{type(self).__name__} expects {self.in_channels} input channels, got shape {x.shape}")

    def _repr_parts(self, padding: object, extra: dict[str, object]) -> list[str]:
        parts = [f"{self.in_channels}", f"{self.out_channels}", f"kernel_size={self.kernel_size}"]
        parts.append(f"stride={self.stride}")
        if padding != (0,) * self._SPATIAL:
            parts.append(f"padding={padding}" if not isinstance(padding, str) else f"padding={padding!r}")
        if self.dilation != (1,) * self._SPATIAL:
            parts.append(f"dilation={self.dilation}")
        parts += [f"{name}={value}" for name, value in extra.items()]
        if self.groups != 1:
            parts.append(f"groups={self.groups}")
        if self.bias_int is None:
            parts.append("bias=False")
        return parts

    def extra_repr(self) -> str:
        return ", ".join([*self._layer_repr(), self._output_repr()]) + self._weight_repr()

    def _layer_repr(self) -> list[str]:
        raise NotImplementedError


class _ConvNd(_ConvBase):
    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: _Size,
        input_qparams: TensorQParams,
        weight_qparams: TensorQParams,
        output_qparams: TensorQParams,
        stride: _Size = 1,
        padding: _Size | str = 0,
        dilation: _Size = 1,
        groups: int = 1,
        bias: bool = True,
        padding_mode: str = "zeros",
        rounding: str = "half_up",
        relu_max: float | None = None,
    ) -> None:
        self._check(int(in_channels), int(out_channels), int(groups), padding_mode)
        kernel = _tuple(kernel_size, self._SPATIAL, "kernel_size")
        shape = (int(out_channels), int(in_channels) // int(groups), *kernel)
        super().__init__(
            out_channels, shape, int(groups), input_qparams, weight_qparams, output_qparams, bias, relu_max, rounding
        )
        self._geometry(in_channels, out_channels, kernel_size, stride, dilation, groups)
        if isinstance(padding, str):
            if padding not in ("same", "valid"):
                raise ValueError(f"padding must be 'same', 'valid' or sizes, got {padding!r}")
            if padding == "same" and self.stride != (1,) * self._SPATIAL:
                raise ValueError("padding='same' needs stride 1")
            self.padding: tuple[int, ...] | str = padding
        else:
            self.padding = _tuple(padding, self._SPATIAL, "padding")
            if min(self.padding) < 0:
                raise ValueError(f"padding must not be negative, got {padding!r}")

    def _pads(self) -> list[tuple[int, int]]:
        """(begin, end) zero padding per spatial dimension ('same': the extra one at the end)."""
        padding = self.padding
        if padding == "valid":
            return [(0, 0)] * self._SPATIAL
        if isinstance(padding, str):  # "same"
            totals = [d * (k - 1) for k, d in zip(self.kernel_size, self.dilation, strict=True)]
            return [(t // 2, t - t // 2) for t in totals]
        return [(p, p) for p in padding]

    def _accumulate(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        self._check_input(x)
        return QF.conv_accumulate(x, weight, self.stride, self._pads(), self.dilation, self.groups)

    def _layer_repr(self) -> list[str]:
        return self._repr_parts(self.padding, {})


class _ConvTransposeNd(_ConvBase):
    _WEIGHT_AXIS: ClassVar[int] = 1

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: _Size,
        input_qparams: TensorQParams,
        weight_qparams: TensorQParams,
        output_qparams: TensorQParams,
        stride: _Size = 1,
        padding: _Size = 0,
        output_padding: _Size = 0,
        groups: int = 1,
        bias: bool = True,
        dilation: _Size = 1,
        padding_mode: str = "zeros",
        rounding: str = "half_up",
        relu_max: float | None = None,
    ) -> None:
        self._check(int(in_channels), int(out_channels), int(groups), padding_mode)
        kernel = _tuple(kernel_size, self._SPATIAL, "kernel_size")
        shape = (int(in_channels), int(out_channels) // int(groups), *kernel)
        super().__init__(
            out_channels, shape, int(groups), input_qparams, weight_qparams, output_qparams, bias, relu_max, rounding
        )
        self._geometry(in_channels, out_channels, kernel_size, stride, dilation, groups)
        self.padding = _tuple(padding, self._SPATIAL, "padding")
        self.output_padding = _tuple(output_padding, self._SPATIAL, "output_padding")
        if min(self.padding) < 0:
            raise ValueError(f"padding must not be negative, got {padding!r}")
        for extra, s, d in zip(self.output_padding, self.stride, self.dilation, strict=True):
            if not 0 <= extra < max(s, d):
                raise ValueError(f"output_padding {self.output_padding} must be below the stride or the dilation")

    def _accumulate(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        self._check_input(x)
        return QF.conv_transpose_accumulate(
            x, weight, self.stride, self.padding, self.output_padding, self.dilation, self.groups
        )

    def _layer_repr(self) -> list[str]:
        extra: dict[str, object] = {}
        if self.output_padding != (0,) * self._SPATIAL:
            extra["output_padding"] = self.output_padding
        return self._repr_parts(self.padding, extra)


class Conv1d(_ConvNd):
    """Integer reference ``nn.Conv1d``."""

    _FLOAT_LAYER: ClassVar[type[nn.Module]] = nn.Conv1d
    _SPATIAL: ClassVar[int] = 1


class Conv2d(_ConvNd):
    """Integer reference ``nn.Conv2d``."""

    _FLOAT_LAYER: ClassVar[type[nn.Module]] = nn.Conv2d
    _SPATIAL: ClassVar[int] = 2


class Conv3d(_ConvNd):
    """Integer reference ``nn.Conv3d``."""

    _FLOAT_LAYER: ClassVar[type[nn.Module]] = nn.Conv3d
    _SPATIAL: ClassVar[int] = 3


class ConvReLU1d(Conv1d):
    """Integer reference Conv1d + ReLU (``relu_max=6.0``: ReLU6)."""

    _RELU: ClassVar[bool] = True


class ConvReLU2d(Conv2d):
    """Integer reference Conv2d + ReLU (``relu_max=6.0``: ReLU6)."""

    _RELU: ClassVar[bool] = True


class ConvReLU3d(Conv3d):
    """Integer reference Conv3d + ReLU (``relu_max=6.0``: ReLU6)."""

    _RELU: ClassVar[bool] = True


class ConvTranspose2d(_ConvTransposeNd):
    """Integer reference ``nn.ConvTranspose2d`` (no ``output_size`` argument: set ``output_padding``)."""

    _FLOAT_LAYER: ClassVar[type[nn.Module]] = nn.ConvTranspose2d
    _SPATIAL: ClassVar[int] = 2


class ConvTransposeReLU2d(ConvTranspose2d):
    """Integer reference ConvTranspose2d + ReLU (``relu_max=6.0``: ReLU6)."""

    _RELU: ClassVar[bool] = True
