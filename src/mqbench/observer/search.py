"""Quantization error of candidate qparams, vectorised over channels and candidates."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["quantization_error"]

# Elements processed at once (rows x candidates x columns); bounds the search's memory.
_CHUNK_ELEMENTS = 1 << 23


def quantization_error(
    rows: Tensor, scales: Tensor, zero_points: Tensor, quant_min: int, quant_max: int, p: float = 2.0
) -> Tensor:
    """Mean |x - fake_quant(x)|**p per row and candidate.

    Args:
        rows: ``[C, N]`` data.
        scales, zero_points: ``[C, K]`` candidate qparams (K candidates per row).
    Returns:
        ``[C, K]`` errors.
    """
    channels, count = rows.shape
    candidates = scales.shape[1]
    errors = torch.empty(channels, candidates, dtype=torch.float32, device=rows.device)
    step = max(1, _CHUNK_ELEMENTS // max(1, channels * count))
    data = rows.unsqueeze(1)
    zero_points = zero_points.float()
    for start in range(0, candidates, step):
        s = scales[:, start : start + step].unsqueeze(2)
        z = zero_points[:, start : start + step].unsqueeze(2)
        q = torch.div(data, s).round_().add_(z).clamp_(quant_min, quant_max).sub_(z).mul_(s)
        diff = q.sub_(data).abs_()
        errors[:, start : start + step] = (diff.square_() if p == 2.0 else diff.pow_(p)).mean(dim=2)
    return errors
