"""MQBench's module path of AdaRound (``mqbench.fake_quantize.adaround_quantizer``).

Example:
    >>> import torch
    >>> from mqbench.fake_quantize.adaround_quantizer import adaround_forward
    >>> x, scale = torch.tensor([0.26, -0.74]), torch.tensor(0.1)
    >>> alpha = torch.tensor([10.0, -10.0])  # round 2.6 up, -7.4 down
    >>> adaround_forward(x, scale, torch.tensor(0), -8, 7, -1, alpha, 1.1, -0.1, hard_value=True).tolist()
    [0.30000001192092896, -0.800000011920929]
"""

from __future__ import annotations

import torch
from torch import Tensor

from mqbench.fake_quantize.adaround import AdaRoundFakeQuantize

__all__ = ["AdaRoundFakeQuantize", "adaround_forward"]


def adaround_forward(
    x: Tensor,
    scale: Tensor,
    zero_point: Tensor,
    quant_min: int,
    quant_max: int,
    ch_axis: int,
    alpha: Tensor,
    zeta: float,
    gamma: float,
    hard_value: bool = False,
) -> Tensor:
    """``(clamp(floor(x / s) + h + z, qmin, qmax) - z) * s`` with ``h`` AdaRound's rounding of ``alpha``.

    ``h`` is the rectified sigmoid ``clamp(sigmoid(alpha) * (zeta - gamma) + gamma, 0, 1)``, or with
    ``hard_value`` its hard form (1 where ``alpha >= 0``). ``ch_axis`` (-1 per tensor) is the axis
    of per-channel ``scale`` and ``zero_point``.
    """
    if ch_axis != -1:
        shape = [1] * x.dim()
        shape[ch_axis] = -1
        scale, zero_point = scale.reshape(shape), zero_point.reshape(shape)
    up = (alpha >= 0).to(x.dtype) if hard_value else torch.clamp(torch.sigmoid(alpha) * (zeta - gamma) + gamma, 0, 1)
    q = torch.clamp(torch.floor(x / scale) + up + zero_point, quant_min, quant_max)
    return (q - zero_point) * scale
