"""Observers driven by summary statistics: EMA quantiles, mean ± k·std clipping, LSQ and LSQ+ initialisation.

Every statistic is kept per row (``[C]`` per-channel, 0-d per-tensor) in
constant memory: EMAs, or running moments merged batch by batch.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from mqbench.functional import bits_of_range, qparams_from_range, round_pot
from mqbench.observer.base import ObserverBase, row_min_max

__all__ = ["ClipStdObserver", "EMAQuantileObserver", "LSQObserver", "LSQPlusObserver"]


def _row_quantile(rows: Tensor, q: float) -> Tensor:
    """The ``q`` quantile of each row, with NumPy's default linear interpolation.

    Uses ``torch.kthvalue`` (no size limit, unlike ``torch.quantile``).
    """
    count = rows.shape[1]
    position = q * (count - 1)
    below = min(math.floor(position), count - 1)
    frac = position - below
    value = rows.kthvalue(below + 1, dim=1).values
    if frac > 0 and below + 1 < count:
        upper = rows.kthvalue(below + 2, dim=1).values
        value = value + frac * (upper - value)
    return value


class EMAQuantileObserver(ObserverBase):
    """EMA of each batch's ``1 - threshold`` and ``threshold`` quantiles (outliers beyond them are clipped).

    Per batch, the two quantiles of each row are taken exactly (linear
    interpolation between order statistics, like ``numpy.quantile``); across
    batches they are averaged with weight ``ema_ratio`` on the past (the first
    batch replaces). The running min/max are kept too, and the clipping range is
    the quantile EMAs intersected with them.

    Example:
        >>> import torch
        >>> obs = EMAQuantileObserver(threshold=0.9)
        >>> _ = obs(torch.arange(11.0))
        >>> [v.item() for v in obs.clip_range()]
        [1.0, 9.0]
    """

    quantile_min: Tensor
    quantile_max: Tensor

    def __init__(self, *args: Any, ema_ratio: float = 0.9, threshold: float = 0.99999, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not 0.0 <= ema_ratio < 1.0:
            raise ValueError(f"ema_ratio must be in [0, 1), got {ema_ratio}")
        if not 0.5 <= threshold <= 1.0:
            raise ValueError(f"threshold must be in [0.5, 1] (the upper quantile to keep), got {threshold}")
        self.ema_ratio = ema_ratio
        self.threshold = threshold
        self.register_buffer("quantile_min", torch.tensor(float("inf")))
        self.register_buffer("quantile_max", torch.tensor(float("-inf")))

    def _observe(self, rows: Tensor) -> None:
        lo, hi = row_min_max(rows)
        self.check_finite(lo, hi)
        q_lo = self._shaped(_row_quantile(rows, 1.0 - self.threshold))
        q_hi = self._shaped(_row_quantile(rows, self.threshold))
        self.check_finite(q_lo, q_hi)
        if self.num_batches == 0 or self.quantile_min.shape != q_lo.shape:
            self.quantile_min, self.quantile_max = q_lo.clone(), q_hi.clone()
        else:
            r = self.ema_ratio
            self.quantile_min = self.quantile_min * r + q_lo * (1 - r)
            self.quantile_max = self.quantile_max * r + q_hi * (1 - r)
        self._update_min_max(lo, hi)

    def clip_range(self) -> tuple[Tensor, Tensor]:
        return torch.maximum(self.quantile_min, self.min_val), torch.minimum(self.quantile_max, self.max_val)


class _RunningMomentsObserver(ObserverBase):
    """Running per-row mean and sum of squared deviations (Chan et al.'s merge, float64), plus min/max.

    Equivalent to accumulating the sum and the sum of squares, but free of their
    cancellation when the mean is large relative to the spread.
    """

    mean: Tensor
    m2: Tensor
    count: Tensor

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.register_buffer("mean", torch.tensor(0.0, dtype=torch.float64))
        self.register_buffer("m2", torch.tensor(0.0, dtype=torch.float64))
        self.register_buffer("count", torch.tensor(0, dtype=torch.int64))

    def _observe(self, rows: Tensor) -> None:
        lo, hi = row_min_max(rows)
        self.check_finite(lo, hi)
        var_b, mean_b = torch.var_mean(rows, dim=1, correction=0)
        n_b = rows.shape[1]
        mean_b, m2_b = self._shaped(mean_b.double()), self._shaped(var_b.double() * n_b)
        if self.num_batches == 0 or self.mean.shape != mean_b.shape:
            self.mean, self.m2, self.count = mean_b, m2_b, torch.tensor(n_b, device=rows.device)
        else:
            n_a = float(self.count)
            total = n_a + n_b
            delta = mean_b - self.mean
            self.mean = self.mean + delta * (n_b / total)
            self.m2 = self.m2 + m2_b + delta.square() * (n_a * n_b / total)
            self.count = self.count + n_b
        self._update_min_max(lo, hi)

    @property
    def std(self) -> Tensor:
        """Population standard deviation (ddof 0) of everything observed, per row."""
        return torch.sqrt(self.m2.clamp(min=0) / self.count.clamp(min=1))


class ClipStdObserver(_RunningMomentsObserver):
    """Clip to ``mean ± std_num · std`` of all observed data (never beyond its min/max).

    Mean and (population) standard deviation accumulate over batches in float64
    with constant memory.

    Example:
        >>> import torch
        >>> obs = ClipStdObserver(std_num=1.0)
        >>> _ = obs(torch.tensor([1.0] * 9 + [11.0]))   # mean 2, std 3
        >>> [v.item() for v in obs.clip_range()]          # [max(1, 2 - 3), min(11, 2 + 3)]
        [1.0, 5.0]
    """

    def __init__(self, *args: Any, std_num: float = 3.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not std_num > 0:
            raise ValueError(f"std_num must be positive, got {std_num}")
        self.std_num = std_num

    def clip_range(self) -> tuple[Tensor, Tensor]:
        spread = self.std_num * self.std
        lo = torch.maximum(self.min_val, (self.mean - spread).float())
        hi = torch.minimum(self.max_val, (self.mean + spread).float())
        return lo, hi


class _ScaleInitObserver(ObserverBase):
    """Observers that produce a scale directly (LSQ-style initialisation) rather than a range."""

    def _initial_scale(self) -> Tensor:
        raise NotImplementedError

    def calculate_qparams(self) -> tuple[Tensor, Tensor]:
        if not self.calibrated:
            return super().calculate_qparams()
        scale = self._initial_scale().float()
        # qparams_from_range's convention: an all-zero tensor is taken as [0, 1], other scales are floored at eps
        unit, _ = qparams_from_range(
            torch.zeros_like(scale), torch.ones_like(scale), self.quant_min, self.quant_max, self.symmetric
        )
        scale = torch.where(scale == 0, unit.reshape(scale.shape), scale.clamp(min=self.eps))
        if self.pot_scale:
            scale = round_pot(scale)
        scale = scale.reshape(-1)
        if self.symmetric:
            zero_point = torch.zeros_like(scale, dtype=torch.int32)
        else:
            # qparams_from_range's convention: zero stays representable, the zero point comes from min(min, 0).
            min_neg = torch.clamp(self.min_val.float().reshape(-1), max=0.0)
            zero_point = torch.clamp(self.quant_min - torch.round(min_neg / scale), self.quant_min, self.quant_max)
            zero_point = zero_point.to(torch.int32)
        return scale, zero_point


class LSQObserver(_ScaleInitObserver):
    """LSQ's initial scale ``2 · mean(|x|) / sqrt(quant_max)`` (Esser et al., 2020).

    ``mean(|x|)`` is a running mean over every observed element of a row
    (float64). Symmetric schemes get zero point 0; affine ones get the zero point
    of the running minimum (as :func:`~mqbench.functional.qparams_from_range`
    would give it for this scale).

    Example:
        >>> import torch
        >>> obs = LSQObserver(quant_min=-128, quant_max=127, qscheme=torch.per_tensor_symmetric)
        >>> _ = obs(torch.tensor([-1.0, 1.0])); _ = obs(torch.tensor([3.0, -3.0]))
        >>> scale, zero_point = obs.calculate_qparams()
        >>> round(scale.item(), 6), zero_point.tolist()   # 2 * 2 / sqrt(127)
        (0.354943, [0])
    """

    abs_sum: Tensor
    count: Tensor

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.register_buffer("abs_sum", torch.tensor(0.0, dtype=torch.float64))
        self.register_buffer("count", torch.tensor(0, dtype=torch.int64))

    def _observe(self, rows: Tensor) -> None:
        lo, hi = row_min_max(rows)
        self.check_finite(lo, hi)
        abs_sum = self._shaped(rows.abs().sum(dim=1, dtype=torch.float64))
        if self.num_batches == 0 or self.abs_sum.shape != abs_sum.shape:
            self.abs_sum, self.count = abs_sum, torch.tensor(rows.shape[1], device=rows.device)
        else:
            self.abs_sum = self.abs_sum + abs_sum
            self.count = self.count + rows.shape[1]
        self._update_min_max(lo, hi)

    def _initial_scale(self) -> Tensor:
        return 2.0 * (self.abs_sum / self.count) / math.sqrt(max(self.quant_max, 1))


class LSQPlusObserver(_RunningMomentsObserver, _ScaleInitObserver):
    """LSQ+'s initial scale ``max(|mean - 3·std|, |mean + 3·std|) / 2**(bits-1)`` (Bhalgat et al., 2020).

    Mean and (population) standard deviation are running statistics over all
    observed data (float64); ``bits`` is the width of the integer range. Zero
    point: 0 for symmetric schemes, from the running minimum for affine ones.

    Example:
        >>> import torch
        >>> obs = LSQPlusObserver(quant_min=-128, quant_max=127, qscheme=torch.per_tensor_symmetric)
        >>> _ = obs(torch.tensor([-1.0, 1.0]))
        >>> obs.calculate_qparams()[0].item() == 3.0 / 128
        True
    """

    def _initial_scale(self) -> Tensor:
        spread = 3.0 * self.std
        bound = torch.maximum((self.mean - spread).abs(), (self.mean + spread).abs())
        return bound / 2 ** (bits_of_range(self.quant_min, self.quant_max) - 1)
