"""The grid of least squared error over a histogram of the signed values (``AffineHistogramObserver``).

``HistogramObserver`` models ``|x|`` and searches one threshold: right for symmetric grids, but an affine (uint8
with a zero point) grid places its two ends independently, and on a skewed activation (GELU's output, a softmax's
input) the best lower end has nothing to do with the best upper one. ``AffineHistogramObserver`` keeps a histogram
of ``x`` itself over ``[-R, R]`` (``R`` a power of two that doubles as data arrives, merging bin pairs, so the
histogram is the same whatever the batch order) and searches the grid, a scale ``s`` and a zero point ``z``, whose
expected squared error over all the data seen is least: rounding error between the grid's ends
``(quant_min - z) * s`` and ``(quant_max - z) * s``, clipping error beyond them, with the values taken as uniform
within each bin. For one scale, prefix sums over the bins (counts, sums, sums of squares, and the rounding error's
integral) give every zero point's error in constant time; the scales are 64 fractions of the widest useful one,
then finer ones around the best, twice. A symmetric scheme searches its scale alone (its zero point is fixed), a
``pot_scale`` one powers of two. The cost depends on the number of bins and levels, not on the number of values.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from mqbench.functional import qparams_from_range, round_pot
from mqbench.observer.histogram import DoublingHistogram

__all__ = ["AffineHistogramObserver"]

_COARSE = 64  # scales in the first stage: fractions k / 64 of the widest useful one
_REFINE = 8  # each later stage: this many scales either side of the best, at an eighth of the previous step
_STAGES = 3


class AffineHistogramObserver(DoublingHistogram):
    """The grid (scale and zero point) of least expected squared quantization error under a signed histogram.

    ``bins`` bins on each side of zero (``2 * bins`` in all; a power of two). ``clip_range`` returns the range
    that ``qparams_from_range`` maps back to that grid. Made for per-tensor activations on affine grids; per
    channel and symmetric schemes work too.

    Example:
        >>> import torch
        >>> _ = torch.manual_seed(0)
        >>> x = torch.nn.functional.gelu(torch.randn(20000) * 2)  # skewed: down to -0.17, up to about 8
        >>> obs = AffineHistogramObserver(quant_min=0, quant_max=255)
        >>> _ = obs(x)
        >>> lo, hi = obs.clip_range()
        >>> bool(-0.18 < lo < -0.1), bool(6.0 < hi < 8.3)  # both ends near the data's: 8 bits are fine enough
        (True, True)
        >>> obs = AffineHistogramObserver(quant_min=0, quant_max=15)
        >>> _ = obs(x)
        >>> lo, hi = obs.clip_range()
        >>> float(lo), bool(3.0 < hi < 8.0)  # at 4 bits the negative side is worth no level, the tail is clipped
        (0.0, True)
    """

    SIDES = 2

    def __init__(self, *args: Any, bins: int = 2048, **kwargs: Any) -> None:
        if int(bins) != bins or bins < 2 or int(bins) & (int(bins) - 1):
            raise ValueError(f"bins must be a power of two of at least 2, got {bins}")
        super().__init__(*args, bins=bins, **kwargs)

    # -- recording -------------------------------------------------------------------------
    def _bin_index(self, rows: Tensor, hist_range: Tensor, exponent: Tensor) -> Tensor:
        # x * (bins / R) is exact (bins and R are powers of two): bin indices agree across range doublings
        per_unit = torch.ldexp(torch.full_like(hist_range, float(self.bins)), -exponent).unsqueeze(1)
        return rows.float().mul(per_unit).floor_().long().add_(self.bins).clamp_(0, 2 * self.bins - 1)

    def _merged(self, histogram: Tensor, doublings: Tensor) -> Tensor:
        """Each row's histogram after doubling its range ``d = doublings[c]`` times: bin ``j`` goes to
        ``(j + bins * (2**d - 1)) >> d`` (its left edge measured from the new ``-R``)."""
        if not bool((doublings > 0).any()):
            return histogram
        # past 2**d > 2 * bins every bin lands in bin bins - 1 (negative) or bins: the same as at that d
        d = doublings.clamp(0, self.bins.bit_length() + 1).long().unsqueeze(1)
        j = torch.arange(2 * self.bins, device=histogram.device).unsqueeze(0)
        target = ((j + self.bins * ((1 << d) - 1)) >> d).clamp_(max=2 * self.bins - 1)
        return torch.zeros_like(histogram).scatter_add_(1, target, histogram)

    # -- the search ----------------------------------------------------------------------------
    def _search(self) -> tuple[Tensor, Tensor]:
        """``[C]`` ends of the best grid (see the module), as the range ``qparams_from_range`` maps back to it."""
        histogram = self.histogram.double()
        channels, device = histogram.shape[0], histogram.device
        index = torch.arange(histogram.shape[1], device=device)
        occupied = histogram > 0
        # each row's outermost data edges (the left one of its first bin, the right one of its last), zero between
        first = torch.where(occupied, index, histogram.shape[1]).amin(dim=1).clamp(max=self.bins)
        last = torch.where(occupied, index + 1, 0).amax(dim=1).clamp(min=self.bins)
        start, stop = int(first.min()), int(last.max())
        width = (self.hist_range.double() / self.bins).unsqueeze(1)  # [C, 1]
        edges = (torch.arange(start, stop + 1, device=device, dtype=torch.float64) - self.bins) * width
        stats = _Stats(histogram[:, start:stop], edges, width)
        # the widest grid useful covers the data's outermost edges; candidates are fractions of its scale
        lowest, highest = (first - self.bins) * width.squeeze(1), (last - self.bins) * width.squeeze(1)
        widest = qparams_from_range(lowest, highest, self.quant_min, self.quant_max, self.symmetric, False, self.eps)[0]
        widest = widest.double().unsqueeze(1)  # [C, 1]
        if self.symmetric:
            zero_points = torch.zeros(1, device=device, dtype=torch.float64)
        else:
            zero_points = torch.arange(self.quant_min, self.quant_max + 1, device=device, dtype=torch.float64)
        # a coarse grid of fractions, then finer grids around the best; the largest scale first (ties go to it)
        fractions = (torch.arange(_COARSE, 0, -1, device=device, dtype=torch.float64) / _COARSE).expand(channels, -1)
        step = 1.0 / _COARSE
        scale = widest
        best_zero = torch.zeros(channels, 1, device=device, dtype=torch.float64)
        for _ in range(_STAGES):
            scales = (widest * fractions).clamp(min=self.eps)  # [C, S]
            if self.pot_scale:
                scales = round_pot(scales)
            errors = stats.errors(scales, zero_points, self.quant_min, self.quant_max)  # [C, S, Z]
            flat = errors.flatten(1).argmin(dim=1, keepdim=True)
            scale = scales.gather(1, flat // zero_points.numel())
            best_zero = zero_points[(flat % zero_points.numel()).squeeze(1)].unsqueeze(1)
            best_fraction = fractions.gather(1, flat // zero_points.numel())
            offsets = torch.arange(_REFINE, -_REFINE - 1, -1, device=device, dtype=torch.float64) * (step / _REFINE)
            fractions = (best_fraction + offsets).clamp(min=step / _REFINE / 8, max=1.0)
            step /= _REFINE
        scale, zero = scale.squeeze(1), best_zero.squeeze(1)
        if not self.symmetric:
            return (self.quant_min - zero) * scale, (self.quant_max - zero) * scale
        if self.quant_min < 0:  # a signed symmetric grid's scale is its larger end over half its levels
            half = scale * ((self.quant_max - self.quant_min) / 2)
            return -half, half
        return torch.zeros_like(scale), scale * self.quant_max

    def clip_range(self) -> tuple[Tensor, Tensor]:
        """The ends of the searched grid (``qparams_from_range`` of them gives its scale and zero point back)."""
        if self.num_batches == 0:
            return super().clip_range()
        lo, hi = self._search()
        return self._shaped(lo.float()), self._shaped(hi.float())


def _cube(x: Tensor) -> Tensor:
    return x * x * x


class _Stats:
    """Prefix sums over a histogram's bins (values uniform within each) that give, for a grid of scale ``s`` and
    zero point ``z``, the squared error of all values in ``O(1)`` per zero point after ``O(bins)`` per scale."""

    def __init__(self, counts: Tensor, edges: Tensor, width: Tensor) -> None:
        self.counts, self.edges, self.width = counts, edges, width  # [C, n], [C, n + 1], [C, 1]
        centres = (edges[:, 1:] + edges[:, :-1]) / 2
        moments = [counts, counts * centres, counts * (centres * centres + width * width / 12)]
        # moments of the values below each edge: count, sum, sum of squares
        self.prefix = [F.pad(m.cumsum(dim=1), (1, 0)) for m in moments]

    @staticmethod
    def _rounding(v: Tensor, s: Tensor) -> Tensor:
        """The integral from 0 to ``v`` of the squared distance to the nearest multiple of ``s``."""
        nearest = torch.round(v / s)
        return nearest * (_cube(s) / 12) + _cube(v - nearest * s) / 3

    def errors(self, scales: Tensor, zero_points: Tensor, quant_min: int, quant_max: int) -> Tensor:
        """``[C, S, Z]`` total squared error of the grids of ``scales`` (``[C, S]``) and ``zero_points`` (``[Z]``)."""
        n = self.counts.shape[1]
        s = scales.unsqueeze(2)  # [C, S, 1]
        bottom = (quant_min - zero_points) * s  # [C, S, Z]
        top = (quant_max - zero_points) * s
        origin = self.edges[:, :1].unsqueeze(2)
        w = self.width.unsqueeze(2)
        # the bins holding each end (-1 below the first bin, n above the last)
        k_bottom = torch.floor((bottom - origin) / w).clamp_(-1, n).long()
        k_top = torch.floor((top - origin) / w).clamp_(-1, n).long()
        flat = lambda t: t.flatten(1)  # noqa: E731
        shape = bottom.shape

        def at(table: Tensor, k: Tensor) -> Tensor:  # table [C, m] or [C, S, m] gathered at k [C, S, Z]
            if table.dim() == 2:
                return table.gather(1, flat(k)).view(shape)
            return table.gather(2, k)

        def bin_count(k: Tensor) -> Tensor:  # the count of bin k (0 outside the bins), over its width
            inside = (k >= 0) & (k < n)
            return torch.where(inside, at(self.counts, k.clamp(0, n - 1)), 0.0) / w

        def lower_edge(k: Tensor) -> Tensor:
            return at(self.edges, k.clamp(0, n))

        def moments(first: Tensor, last: Tensor, anchor: Tensor) -> Tensor:  # sum of (x - anchor)^2, bins [first, last)
            first, last = first.clamp(0, n), last.clamp(0, n)
            m0, m1, m2 = (at(p, last) - at(p, first) for p in self.prefix)
            return (m2 - 2 * anchor * m1 + anchor * anchor * m0).clamp_(min=0)

        # clipping: whole bins beyond each end, and the part of each end's own bin beyond it
        zero = torch.zeros_like(k_bottom)
        error = moments(zero, k_bottom, bottom) + moments(k_top + 1, zero + n, top)
        error += bin_count(k_bottom) * _cube((bottom - lower_edge(k_bottom)).clamp(min=0)) / 3
        error += bin_count(k_top) * _cube((lower_edge(k_top + 1) - top).clamp(min=0)) / 3
        # rounding: whole bins between the ends from a prefix sum per scale, the ends' own bins in part
        g = self._rounding(self.edges.unsqueeze(1), s)  # [C, S, n + 1]
        rounding = F.pad((self.counts.unsqueeze(1) * g.diff(dim=2)).cumsum(dim=2), (1, 0)) / w
        whole_first, whole_last = (k_bottom + 1).clamp(0, n), k_top.clamp(0, n)
        error += torch.where(whole_last > whole_first, at(rounding, whole_last) - at(rounding, whole_first), 0.0)
        g_bottom, g_top = self._rounding(bottom, s), self._rounding(top, s)
        same = k_bottom == k_top
        upper = torch.where(same, g_top, at(g, (k_bottom + 1).clamp(0, n)))
        error += bin_count(k_bottom) * (upper - g_bottom)
        error += torch.where(same, 0.0, bin_count(k_top) * (g_top - at(g, k_top.clamp(0, n))))
        return error
