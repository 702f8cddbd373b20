"""Observers that search the clipping range minimising the Lp quantization error of each batch."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from mqbench.functional import qparams_from_range
from mqbench.observer.base import EMARange, ObserverBase, row_min_max
from mqbench.observer.search import quantization_error

__all__ = ["EMAMSEObserver", "MSEObserver"]

_MIN_RATIO = 1e-4  # smallest clipping ratio the fine search may reach


class _RangeSearchObserver(ObserverBase):
    """Per batch, the range ``alpha · [min, max]`` minimising mean ``|x - fake_quant(x)| ** p``.

    ``num_candidates`` ratios are evaluated per row: half on a uniform coarse grid
    over ``(0, 1]``, half on a fine grid spanning one coarse step either side of
    the best coarse ratio. All rows and candidates are evaluated at once with
    :func:`~mqbench.observer.search.quantization_error`, on the exact qparams
    (``pot_scale`` included) that :func:`~mqbench.functional.qparams_from_range`
    gives each candidate range. Ties go to the wider range.
    """

    def __init__(self, *args: Any, p: float = 2.0, num_candidates: int = 100, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not p > 0:
            raise ValueError(f"p must be positive, got {p}")
        if num_candidates < 2:
            raise ValueError(f"num_candidates must be at least 2, got {num_candidates}")
        self.p = float(p)
        self.num_candidates = int(num_candidates)

    def _errors(self, rows: Tensor, lo: Tensor, hi: Tensor, ratios: Tensor) -> Tensor:
        """``[C, K]`` errors of the ranges ``ratios[c, k] · [lo[c], hi[c]]``."""
        scale, zero_point = qparams_from_range(
            lo.unsqueeze(1) * ratios,
            hi.unsqueeze(1) * ratios,
            self.quant_min,
            self.quant_max,
            self.symmetric,
            self.pot_scale,
            self.eps,
        )
        return quantization_error(rows, scale, zero_point, self.quant_min, self.quant_max, self.p)

    def best_range(self, rows: Tensor) -> tuple[Tensor, Tensor]:
        """The error-minimising range of each row of ``rows`` (``[C]`` each); checks the data is finite."""
        lo, hi = row_min_max(rows)
        self.check_finite(lo, hi)
        coarse_count = self.num_candidates // 2
        fine_count = self.num_candidates - coarse_count
        step = 1.0 / coarse_count
        # Descending, so that argmin's first-minimum rule prefers the wider range on ties.
        coarse = torch.linspace(1.0, step, coarse_count, device=rows.device).expand(rows.shape[0], -1)
        coarse_errors = self._errors(rows, lo, hi, coarse)
        best = coarse.gather(1, coarse_errors.argmin(dim=1, keepdim=True))
        offsets = torch.linspace(step, -step, fine_count + 2, device=rows.device)[1:-1]
        fine = (best + offsets).clamp_(_MIN_RATIO, 1.0)
        ratios = torch.cat([coarse, fine], dim=1)
        errors = torch.cat([coarse_errors, self._errors(rows, lo, hi, fine)], dim=1)
        ratio = ratios.gather(1, errors.argmin(dim=1, keepdim=True)).squeeze(1)
        return lo * ratio, hi * ratio


class MSEObserver(_RangeSearchObserver):
    """Lp-error-optimal clipping per batch; the running min of the chosen minima and max of the chosen maxima.

    Each batch's range is searched as ``alpha · [min, max]`` (see
    ``num_candidates``; ``p=2`` is the mean squared error). Across batches the
    widest chosen range is kept (MQBench's semantics).

    Example:
        >>> import torch
        >>> obs = MSEObserver(quant_min=-8, quant_max=7, qscheme=torch.per_tensor_symmetric)
        >>> _ = obs(torch.cat([torch.linspace(-1, 1, 9999), torch.tensor([10.0])]))
        >>> lo, hi = obs.clip_range()
        >>> bool(hi < 2.0)   # the outlier is clipped
        True
    """

    def _observe(self, rows: Tensor) -> None:
        self._update_min_max(*self.best_range(rows))


class EMAMSEObserver(EMARange, _RangeSearchObserver):
    """Lp-error-optimal clipping per batch, averaged over batches with ``ema_ratio`` weighting the past.

    Example:
        >>> import torch
        >>> obs = EMAMSEObserver(ema_ratio=0.5, quant_min=0, quant_max=255)
        >>> _ = obs(torch.linspace(0, 1, 1001)); _ = obs(torch.linspace(0, 3, 1001))
        >>> round(obs.max_val.item(), 2)   # (1 + 3) / 2: uniform data is never clipped
        2.0
    """

    def _batch_range(self, rows: Tensor) -> tuple[Tensor, Tensor]:
        return self.best_range(rows)
