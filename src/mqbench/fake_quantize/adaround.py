"""AdaRoundFakeQuantize: learned rounding of weights (Nagel et al., 2020), as MQBench's reconstruction uses it.

Until :meth:`AdaRoundFakeQuantize.init` is called it is a fixed-qparams weight quantizer
(round to nearest). ``init(weight, "learned_hard_sigmoid")`` creates the rounding variable
``alpha`` (one per weight element) with the rectified sigmoid

    h(alpha) = clamp(sigmoid(alpha) * (zeta - gamma) + gamma, 0, 1),  zeta = 1.1, gamma = -0.1,

initialised so that ``h(alpha)`` equals the fractional part of ``w / s``: the soft weight
``(clamp(floor(w / s) + h(alpha) + z, qmin, qmax) - z) * s`` starts at ``w`` itself (inside the
grid). Reconstruction trains ``alpha`` with the regulariser :meth:`rounding_loss`, which pushes
each ``h`` to 0 or 1. With ``soft_targets`` off the quantizer rounds up exactly where
``alpha >= 0`` (``h >= 0.5``): the hard rounding that deploys.

Example:
    >>> import torch
    >>> from mqbench.fake_quantize import AdaRoundFakeQuantize
    >>> fq = AdaRoundFakeQuantize(quant_min=-8, quant_max=7, qscheme=torch.per_tensor_symmetric)
    >>> w = torch.tensor([0.26, -0.74, 0.5])
    >>> _ = fq(w)  # calibration: scale = 0.74 / 7.5 ... from the observer
    >>> fq.init(w, "learned_hard_sigmoid")
    >>> torch.allclose(fq.rectified_sigmoid(), w / fq.scale - torch.floor(w / fq.scale), atol=1e-6)
    True
    >>> fq.disable_observer(); fq.soft_targets = True
    >>> torch.allclose(fq(w), w, atol=1e-6)
    True
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from mqbench.fake_quantize.fixed import ObserverQParamsQuantizer
from mqbench.functional import fake_quantize, from_groups, to_groups
from mqbench.observer import MinMaxObserver

__all__ = ["ROUND_MODES", "AdaRoundFakeQuantize"]

ROUND_MODES = ("learned_hard_sigmoid",)
ZETA, GAMMA = 1.1, -0.1


class AdaRoundFakeQuantize(ObserverQParamsQuantizer):
    """Weight fake quantization with a learned rounding variable (see the module docstring)."""

    def __init__(self, observer: Any = MinMaxObserver, **observer_kwargs: Any) -> None:
        super().__init__(observer, **observer_kwargs)
        self.adaround = False
        self.soft_targets = False
        self.round_mode = "nearest"
        self.alpha: nn.Parameter | None = None
        self._floor: Tensor | None = None

    def _view(self, t: Tensor, like: Tensor) -> Tensor:
        if self.axis is None or like.dim() == 0:
            return t
        shape = [1] * like.dim()
        shape[self.axis % like.dim()] = -1
        return t.reshape(shape)

    def init(self, weight_tensor: Tensor, round_mode: str = "learned_hard_sigmoid") -> None:
        """Start learned rounding of ``weight_tensor`` (the layer's weight) with the current scale."""
        if round_mode not in ROUND_MODES:
            raise ValueError(f"unknown round_mode {round_mode!r}; choose one of {', '.join(ROUND_MODES)}")
        if self.group_size is not None:  # learned per element of the rows the grouped forward quantizes
            weight_tensor = to_groups(weight_tensor.detach(), self.group_size)
        scale = self._view(self.scale, weight_tensor)
        scaled = weight_tensor.detach() / scale
        rest = (scaled - torch.floor(scaled)).clamp(1e-6, 1 - 1e-6)
        # h(alpha) = rest  <=>  sigmoid(alpha) = (rest - gamma) / (zeta - gamma)
        alpha = -torch.log((ZETA - GAMMA) / (rest - GAMMA) - 1)
        self.alpha = nn.Parameter(alpha.contiguous())
        self._floor = torch.floor(scaled)  # fixed while the rounding is learned (weight and scale are)
        self.adaround = True
        self.round_mode = round_mode
        self.soft_targets = True

    def rectified_sigmoid(self) -> Tensor:
        if self.alpha is None:
            raise RuntimeError("AdaRoundFakeQuantize.init(weight, round_mode) has not been called")
        return torch.clamp(torch.sigmoid(self.alpha) * (ZETA - GAMMA) + GAMMA, 0, 1)

    def rounding_loss(self, b: float) -> Tensor:
        """``sum(1 - |2 h(alpha) - 1| ** b)``: 0 exactly when every ``h`` is 0 or 1."""
        return (1 - (2 * self.rectified_sigmoid() - 1).abs().pow(b)).sum()

    def get_hard_value(self, x: Tensor) -> Tensor:
        """``x`` (the weight ``init`` saw) on the grid with the learned rounding made hard."""
        if self.group_size is not None:
            return from_groups(self._adaround(to_groups(x, self.group_size), hard=True), x.shape, self.group_size)
        return self._adaround(x, hard=True)

    def _adaround(self, x: Tensor, hard: bool) -> Tensor:
        if self.alpha is None or x.shape != self.alpha.shape:
            raise RuntimeError("learned rounding applies to the weight tensor AdaRoundFakeQuantize.init saw")
        scale = self._view(self.scale, x)
        zero_point = self._view(self.zero_point, x).to(x.dtype)
        floor = self._floor if self._floor is not None and not hard else torch.floor(x / scale).detach()
        up = (self.alpha >= 0).to(x.dtype) if hard else self.rectified_sigmoid()
        q = torch.clamp(floor + up + zero_point, self.quant_min, self.quant_max)
        return (q - zero_point) * scale

    def quantize(self, x: Tensor) -> Tensor:
        if not self.adaround:
            return fake_quantize(x, self.scale, self.zero_point, self.quant_min, self.quant_max, self.axis)
        return self._adaround(x, hard=not self.soft_targets)

    def finish(self) -> None:
        """Back to round to nearest (call after the weight holds its hard-rounded values)."""
        self.adaround = False
        self.soft_targets = False
        self.alpha = None
        self._floor = None

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, adaround={self.adaround}, soft_targets={self.soft_targets}"
