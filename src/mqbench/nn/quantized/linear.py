"""Integer reference Linear and Linear + ReLU: ``y = requantize((x - x_zp) @ (w - w_zp).T + bias_int)``.

Inputs ``[..., in_features]``; weights per tensor or per output channel (axis 0).

Example:
    >>> import numpy as np
    >>> import torch
    >>> from torch import nn
    >>> from mqbench.qparams import TensorQParams
    >>> from mqbench.nn.intrinsic import LinearReLU as FloatLinearReLU
    >>> from mqbench.nn.quantized import LinearReLU
    >>> _ = torch.manual_seed(0)
    >>> act = TensorQParams(np.array([0.25]), np.array([3]), 0, 255)
    >>> weight = TensorQParams(np.full(3, 0.01), np.zeros(3), -127, 127, axis=0, kind="weight")
    >>> q = LinearReLU.from_float(FloatLinearReLU(nn.Linear(4, 3), nn.ReLU()), act, weight, act)
    >>> q
    LinearReLU(in_features=4, out_features=3, bias=True, scale=0.25, zero_point=3, per_channel_weight=True)
    >>> y = q(torch.randn(2, 4))
    >>> y.shape, bool((y >= 0).all())
    (torch.Size([2, 3]), True)
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
from torch import nn

from mqbench.nn.quantized import functional as QF
from mqbench.nn.quantized.weighted import WeightedQuantizedModule
from mqbench.qparams import TensorQParams

__all__ = ["Linear", "LinearReLU"]


class Linear(WeightedQuantizedModule):
    """Integer reference ``nn.Linear``; see :mod:`mqbench.nn.quantized.weighted` for the buffers."""

    _FLOAT_LAYER: ClassVar[type[nn.Module]] = nn.Linear

    def __init__(
        self,
        in_features: int,
        out_features: int,
        input_qparams: TensorQParams,
        weight_qparams: TensorQParams,
        output_qparams: TensorQParams,
        bias: bool = True,
        rounding: str = "half_up",
        relu_max: float | None = None,
    ) -> None:
        super().__init__(
            out_features,
            (int(out_features), int(in_features)),
            1,
            input_qparams,
            weight_qparams,
            output_qparams,
            bias,
            relu_max,
            rounding,
        )
        self.in_features = int(in_features)

    @property
    def out_features(self) -> int:
        return self.out_channels

    def _accumulate(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        if x.ndim < 1 or x.shape[-1] != self.in_features:
            raise ValueError(f"{type(self).__name__} takes inputs [..., {self.in_features}], got shape {x.shape}")
        return QF.linear_accumulate(x, weight)

    def extra_repr(self) -> str:
        layer = f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias_int is not None}"
        return f"{layer}, {self._output_repr()}{self._weight_repr()}"


class LinearReLU(Linear):
    """Integer reference Linear + ReLU (``relu_max=6.0``: ReLU6), the ReLU a clamp at the output zero point."""

    _RELU: ClassVar[bool] = True
