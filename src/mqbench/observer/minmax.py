"""Min/max observers, including the power-of-two ones used for Vitis-style hardware."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from mqbench.observer.base import EMARange, ObserverBase, row_min_max
from mqbench.observer.search import quantization_error

__all__ = ["EMAMinMaxObserver", "MeanMinMaxObserver", "MinMaxFloorObserver", "MinMaxObserver", "PoTModeObserver"]


class MinMaxObserver(ObserverBase):
    """Running minimum and maximum over every observed batch.

    Example:
        >>> import torch
        >>> obs = MinMaxObserver()
        >>> _ = obs(torch.tensor([0.0, 2.55])); _ = obs(torch.tensor([-0.5]))
        >>> obs.min_val.item(), obs.max_val.item()
        (-0.5, 2.549999952316284)
    """


class EMAMinMaxObserver(EMARange):
    """Exponential moving average of each batch's min and max (``ema_ratio`` weights the past).

    Example:
        >>> import torch
        >>> obs = EMAMinMaxObserver(ema_ratio=0.5)
        >>> _ = obs(torch.tensor([0.0, 2.0])); _ = obs(torch.tensor([0.0, 4.0]))
        >>> obs.max_val.item()
        3.0
    """

    def _batch_range(self, rows: Tensor) -> tuple[Tensor, Tensor]:
        lo, hi = row_min_max(rows)
        self.check_finite(lo, hi)
        return lo, hi


class MeanMinMaxObserver(ObserverBase):
    """Per tensor, the mean over every observed sample of the sample's min and max; per channel, the running min/max.

    Each sample (an index of the tensor's first axis, the batch) gives its own minimum and maximum;
    the range is their running average over all samples seen, whatever the batching. One outlier
    image then widens the grid by its share of the data instead of setting it, as the running
    min/max lets it. A 0-d or 1-d tensor is one sample. A channel's extremes vary between samples far
    more than a whole tensor's (a channel of a ReLU output is zero in most images), so averaging them
    would clip most channels: per-channel schemes keep each channel's extremes over all samples, as
    :class:`MinMaxObserver`. Both are the defaults of OpenVINO's post-training tools.

    Example:
        >>> import torch
        >>> obs = MeanMinMaxObserver()
        >>> _ = obs(torch.tensor([[0.0, 2.0], [-1.0, 4.0]])); _ = obs(torch.tensor([[0.0, 6.0]]))
        >>> obs.min_val.item(), obs.max_val.item()
        (-0.3333333432674408, 4.0)
    """

    samples: Tensor

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.register_buffer("samples", torch.tensor(0, dtype=torch.int64))

    def forward(self, x: Tensor) -> Tensor:
        if x.numel() == 0 or self.is_per_channel:
            return super().forward(x)
        value = x.detach()
        per_sample = value.reshape(value.shape[0] if value.dim() > 1 else 1, -1).float()
        lo, hi = per_sample.amin(dim=1), per_sample.amax(dim=1)
        self.check_finite(lo, hi)
        seen = int(self.samples) if self.num_batches > 0 else 0  # a reset observer forgets its samples
        total = seen + lo.numel()
        if seen == 0:
            self.min_val, self.max_val = lo.mean(), hi.mean()
        else:
            self.min_val = (self.min_val * seen + lo.sum()) / total
            self.max_val = (self.max_val * seen + hi.sum()) / total
        self.samples.fill_(total)
        self.num_batches += 1
        return x


def _symmetric_pot_exponent(amax: Tensor, quant_max: int, eps: float) -> Tensor:
    """Smallest power-of-two exponent e with ``quant_max * 2**e >= amax`` (no clipping).

    In fixed-point terms this is ``-fix_pos`` with ``fix_pos = floor(log2(quant_max / amax))``.
    """
    amax = torch.where(amax == 0, torch.ones_like(amax), amax)  # an all-zero tensor: the range [0, 1]
    return torch.ceil(torch.log2(torch.clamp(amax, min=eps) / quant_max))


class MinMaxFloorObserver(ObserverBase):
    """Symmetric power-of-two scale from the running min/max, never clipping.

    The fixed-point position is ``floor(log2(quant_max / max|x|))`` (Vitis AI's
    min-max "floor" rule); the scale is ``2 ** -fix_pos``. Zero point 0.

    Example:
        >>> import torch
        >>> obs = MinMaxFloorObserver(quant_min=-128, quant_max=127)
        >>> _ = obs(torch.tensor([-3.0, 1.0]))
        >>> obs.calculate_qparams()[0].item()   # 127 * 2**-5 = 3.97 >= 3.0 > 127 * 2**-6
        0.03125
    """

    def calculate_qparams(self) -> tuple[Tensor, Tensor]:
        if not self.calibrated:
            return super().calculate_qparams()
        amax = torch.maximum(-self.min_val, self.max_val).clamp(min=0).reshape(-1)
        scale = torch.pow(2.0, _symmetric_pot_exponent(amax, self.quant_max, self.eps))
        return scale, torch.zeros_like(scale, dtype=torch.int32)


class PoTModeObserver(ObserverBase):
    """Power-of-two scale chosen per batch by least squared error, then the mode over batches.

    For each batch, the no-clipping exponent ``e0`` and the ``search_width``
    finer exponents below it are tried; the one with the least mean squared
    quantization error wins that batch. ``calculate_qparams`` returns the
    exponent that won most often (ties: the larger scale). Zero point 0.

    Example:
        >>> import torch
        >>> obs = PoTModeObserver(quant_min=-128, quant_max=127)
        >>> _ = obs(torch.randn(1000))
        >>> scale, _ = obs.calculate_qparams()
        >>> float(torch.log2(scale)).is_integer()
        True
    """

    EXPONENT_OFFSET = 64  # exponents -64 .. 63 are counted

    exponent_counts: Tensor

    def __init__(self, *args: Any, search_width: int = 2, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if search_width < 0:
            raise ValueError(f"search_width must be >= 0, got {search_width}")
        self.search_width = search_width
        self.register_buffer("exponent_counts", torch.zeros(1, 2 * self.EXPONENT_OFFSET, dtype=torch.int64))

    def _observe(self, rows: Tensor) -> None:
        lo, hi = row_min_max(rows)
        self.check_finite(lo, hi)
        self._update_min_max(lo, hi)
        amax = torch.maximum(-lo, hi).clamp(min=0)
        top = _symmetric_pot_exponent(amax, self.quant_max, self.eps)
        offsets = torch.arange(0, -self.search_width - 1, -1, dtype=top.dtype, device=top.device)
        exponents = (top.unsqueeze(1) + offsets).clamp(-self.EXPONENT_OFFSET, self.EXPONENT_OFFSET - 1)
        errors = quantization_error(
            rows, torch.pow(2.0, exponents), torch.zeros_like(exponents), self.quant_min, self.quant_max
        )
        best = exponents.gather(1, errors.argmin(dim=1, keepdim=True)).squeeze(1).long()
        if self.num_batches == 0:
            self.exponent_counts = torch.zeros(
                rows.shape[0], 2 * self.EXPONENT_OFFSET, dtype=torch.int64, device=rows.device
            )
        self.check_channels(self.exponent_counts[:, 0], best)
        self.exponent_counts[torch.arange(rows.shape[0], device=rows.device), best + self.EXPONENT_OFFSET] += 1

    def calculate_qparams(self) -> tuple[Tensor, Tensor]:
        if not self.calibrated:
            return super().calculate_qparams()
        # argmax returns the first maximum; flip so ties go to the larger exponent.
        flipped = self.exponent_counts.flip(1).argmax(dim=1)
        exponent = (2 * self.EXPONENT_OFFSET - 1 - flipped) - self.EXPONENT_OFFSET
        scale = torch.pow(2.0, exponent.float())
        return scale, torch.zeros_like(scale, dtype=torch.int32)
