"""An observer whose quantization parameters are fixed in advance (ops with a known output range).

Ops such as sigmoid or tanh have a known output range, so backends often
require exact quantization parameters for them (``scale_exact_match`` and
``zero_point_exact_match`` in :class:`~mqbench.backend_config.DTypeWithConstraints`).
A qconfig meets such a constraint with this observer, or with a fake quantizer
built on it (``FixedFakeQuantize.with_args(observer=FixedQParamsObserver, ...)``).

Any observer can declare fixed parameters the same way: a ``fixed_qparams``
attribute holding ``(scale, zero_point)``.

Example:
    >>> import torch
    >>> from mqbench.backend_config import FixedQParamsObserver
    >>> obs = FixedQParamsObserver(scale=1.0 / 256.0, zero_point=0)
    >>> obs.fixed_qparams
    (0.00390625, 0)
    >>> _ = obs(torch.randn(8))
    >>> obs.calculate_qparams()
    (tensor([0.0039]), tensor([0], dtype=torch.int32))
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from mqbench.observer.base import ObserverBase

__all__ = ["FixedQParamsObserver"]


class FixedQParamsObserver(ObserverBase):
    """Always reports ``(scale, zero_point)``, whatever it sees (PyTorch's ``FixedQParamsObserver``).

    Per-tensor only. ``eps`` equals ``scale``: the smallest scale it produces is its only one.
    """

    def __init__(
        self,
        scale: float,
        zero_point: int,
        dtype: torch.dtype = torch.quint8,
        qscheme: torch.qscheme = torch.per_tensor_affine,
        quant_min: int | None = None,
        quant_max: int | None = None,
        **kwargs: Any,
    ) -> None:
        if qscheme not in (torch.per_tensor_affine, torch.per_tensor_symmetric):
            raise ValueError(f"FixedQParamsObserver is per-tensor only, got qscheme {qscheme}")
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
            raise ValueError(f"FixedQParamsObserver: scale must be a positive number, got {scale!r}")
        if isinstance(zero_point, bool) or not isinstance(zero_point, int):
            raise ValueError(f"FixedQParamsObserver: zero_point must be an int, got {zero_point!r}")
        if "eps" in kwargs:
            raise ValueError("FixedQParamsObserver takes no eps: its smallest scale is its fixed scale")
        super().__init__(dtype, qscheme, False, quant_min, quant_max, eps=float(scale), **kwargs)
        if not self.quant_min <= zero_point <= self.quant_max:
            raise ValueError(
                f"FixedQParamsObserver: zero_point {zero_point} is outside [{self.quant_min}, {self.quant_max}]"
            )
        self.scale = float(scale)
        self.zero_point = int(zero_point)

    @property
    def fixed_qparams(self) -> tuple[float, int]:
        """The ``(scale, zero_point)`` this observer always reports."""
        return self.scale, self.zero_point

    def forward(self, x: Tensor) -> Tensor:
        return x

    def calculate_qparams(self) -> tuple[Tensor, Tensor]:
        return torch.tensor([self.scale]), torch.tensor([self.zero_point], dtype=torch.int32)

    def extra_repr(self) -> str:
        return f"scale={self.scale}, zero_point={self.zero_point}, {super().extra_repr()}"
