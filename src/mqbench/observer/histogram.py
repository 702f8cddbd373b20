"""Histogram-based observers: squared-error-optimal, KL-divergence (entropy) and percentile clipping.

All three keep one fixed-size histogram of ``|x|`` per row over ``[0, R]``,
where ``R`` is a power of two. When a batch exceeds ``R`` the range doubles as
often as needed, each doubling merging adjacent bin pairs (exact). Since every
bin boundary is then a power-of-two multiple of the original ones, the
histogram equals one built in a single pass over all data on the final range,
whatever the batch order, and its memory never grows.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from mqbench.functional import qparams_from_range
from mqbench.observer.base import ObserverBase, row_min_max

__all__ = ["HistogramObserver", "KLDObserver", "PercentileObserver"]

# Elements per chunk of the vectorised searches over candidate thresholds.
_CHUNK_ELEMENTS = 1 << 21
_COARSE_CANDIDATES = 32  # HistogramObserver's first search stage; each later stage refines the stride by _REFINE
_REFINE = 8
_HISTC_EXACT = 1 << 24  # values per torch.histc call: its float32 counts are exact up to this
_TINY_EXPONENT = -126  # smallest normal float32 power of two; the range never goes below it
_HUGE_EXPONENT = 127  # largest float32 power of two


def _pow2_exponent(value: Tensor) -> Tensor:
    """Smallest ``e`` with ``2**e >= value`` (exact, via frexp), clamped to float32's normal range."""
    mantissa, exponent = torch.frexp(value.float().clamp(min=2.0**_TINY_EXPONENT))
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)
    return exponent.clamp(_TINY_EXPONENT, _HUGE_EXPONENT)


class DoublingHistogram(ObserverBase):
    """Maintains ``histogram`` (``[C, SIDES * bins]`` int64 counts) over a range ``hist_range`` (``[C]``) that is a
    power of two, doubled as often as a batch needs, each doubling merging bins exactly. A subclass says where a
    value falls (``_bin_index``) and where a bin goes when the range doubles (``_merged``); ``SIDES`` is 1 for a
    histogram of ``|x|``, 2 for one of ``x`` over ``[-R, R]``."""

    histogram: Tensor
    hist_range: Tensor
    SIDES = 1
    defers_qparams = True  # each threshold or grid is a search over the bins

    def __init__(self, *args: Any, bins: int = 2048, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if int(bins) != bins or bins < 2:
            raise ValueError(f"bins must be an integer of at least 2, got {bins}")
        self.bins = int(bins)
        self.register_buffer("histogram", torch.zeros(1, self.SIDES * self.bins, dtype=torch.int64))
        self.register_buffer("hist_range", torch.zeros(1))

    # -- recording -------------------------------------------------------------------------
    def _bin_index(self, rows: Tensor, hist_range: Tensor, exponent: Tensor) -> Tensor:
        """``[C, N]`` column of each value of ``rows`` on the range ``hist_range = 2 ** exponent``."""
        raise NotImplementedError

    def _merged(self, histogram: Tensor, doublings: Tensor) -> Tensor:
        """Each row's histogram after doubling its range ``doublings[c]`` times."""
        raise NotImplementedError

    def _observe(self, rows: Tensor) -> None:
        lo, hi = row_min_max(rows)
        self.check_finite(lo, hi)
        exponent = _pow2_exponent(torch.maximum(-lo, hi))
        channels, columns = rows.shape[0], self.SIDES * self.bins
        if self.num_batches == 0 or self.histogram.shape[0] != channels:
            if self.num_batches > 0:
                raise ValueError(
                    f"{self._where()} saw {channels} channels after {self.histogram.shape[0]}; "
                    "a histogram observer needs the same number of channels in every batch"
                )
            histogram = torch.zeros(channels, columns, dtype=torch.int64, device=rows.device)
        else:
            old = torch.frexp(self.hist_range)[1] - 1  # hist_range is exactly 2**old
            exponent = torch.maximum(exponent, old)
            histogram = self._merged(self.histogram, exponent - old)
        hist_range = torch.ldexp(torch.ones(channels, device=rows.device), exponent)
        self.histogram, self.hist_range = histogram + self._counts(rows, hist_range, exponent), hist_range
        self._update_min_max(lo, hi)

    def _counts(self, rows: Tensor, hist_range: Tensor, exponent: Tensor) -> Tensor:
        """``[C, SIDES * bins]`` int64: how many values of each row of ``rows`` fall in each bin."""
        channels, columns = rows.shape[0], self.SIDES * self.bins
        index = self._bin_index(rows, hist_range, exponent)
        index += torch.arange(channels, device=rows.device).unsqueeze(1) * columns
        return torch.bincount(index.reshape(-1), minlength=channels * columns).view(channels, columns)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # type: ignore[no-untyped-def]
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self.bins = self.histogram.shape[1] // self.SIDES


class _AbsHistogramObserver(DoublingHistogram):
    """A histogram of ``|x|`` over ``[0, R]`` (``[C, bins]``) and the clipping threshold a subclass finds on it."""

    def _bin_index(self, rows: Tensor, hist_range: Tensor, exponent: Tensor) -> Tensor:
        # |x| / R is exact (R is a power of two), so bin indices agree across range doublings.
        return torch.div(rows.abs(), hist_range.unsqueeze(1)).mul_(self.bins).floor_().long().clamp_(0, self.bins - 1)

    def _counts(self, rows: Tensor, hist_range: Tensor, exponent: Tensor) -> Tensor:
        # One row of float32 on the CPU: torch.histc counts the same bins in one pass. Its bin of v is
        # floor(v * bins / R), every edge k * R / bins, all exact where bins and R are powers of two and
        # R * bins is finite; it counts in float32, exact up to 2**24 per bin: at most that many values a call.
        exact = self.bins & (self.bins - 1) == 0 and int(exponent.max()) + self.bins.bit_length() < _HUGE_EXPONENT
        if rows.shape[0] != 1 or rows.dtype != torch.float32 or rows.device.type != "cpu" or not exact:
            return super()._counts(rows, hist_range, exponent)
        top = float(hist_range[0])
        counts = torch.zeros(self.bins, dtype=torch.int64)
        for chunk in rows.reshape(-1).split(_HISTC_EXACT):
            counts += torch.histc(chunk.abs(), self.bins, 0.0, top).long()
        return counts.unsqueeze(0)

    def _merged(self, histogram: Tensor, doublings: Tensor) -> Tensor:
        """Each row's histogram after doubling its range ``doublings[c]`` times (bin j goes to j >> d)."""
        if not bool((doublings > 0).any()):
            return histogram
        shift = doublings.clamp(0, 62).long().unsqueeze(1)
        target = torch.arange(self.bins, device=histogram.device).unsqueeze(0) >> shift
        return torch.zeros_like(histogram).scatter_add_(1, target, histogram)

    # -- clipping range ----------------------------------------------------------------------
    @property
    def bin_width(self) -> Tensor:
        """``[C]`` width of a histogram bin."""
        return self.hist_range / self.bins

    def _one_sided(self) -> Tensor:
        """``[C]`` rows whose grid is ``[0, t]``: affine with non-negative data, or an unsigned symmetric grid."""
        min_val = self.min_val.reshape(-1)
        if self.symmetric:
            return torch.full_like(min_val, self.quant_min >= 0, dtype=torch.bool)
        return min_val >= 0

    def _threshold(self) -> Tensor:
        """``[C]`` clipping threshold on ``|x|``."""
        raise NotImplementedError

    def clip_range(self) -> tuple[Tensor, Tensor]:
        """``[-t, t]`` for the threshold ``t`` on ``|x|``, intersected with the observed ``[min, max]`` (on an
        affine grid a range of mostly one sign then keeps its levels on that side; symmetric grids are
        unchanged, their scale coming from the larger magnitude)."""
        amax = torch.maximum(-self.min_val, self.max_val).clamp(min=0).reshape(-1)
        t = torch.minimum(self._threshold().float(), amax)
        lo = torch.maximum(-t, self.min_val.reshape(-1).clamp(max=0))
        hi = torch.minimum(t, self.max_val.reshape(-1).clamp(min=0))
        if self.symmetric:
            hi = torch.maximum(hi, -lo)
        lo = torch.where(self._one_sided(), torch.zeros_like(t), -hi if self.symmetric else lo)
        return self._shaped(lo), self._shaped(hi)


class HistogramObserver(_AbsHistogramObserver):
    """Clipping threshold that minimises the expected squared quantization error under the histogram.

    Values are taken as uniform within each bin. For a candidate threshold
    ``t`` (a bin edge), the grid is the one
    :func:`~mqbench.functional.qparams_from_range` gives ``[-t, t]`` (``[0, t]``
    for affine schemes on non-negative data); ``|x|`` is modelled on the grid's
    positive side, and each bin's expected error is integrated in closed form:
    rounding error up to the top level, clipping error beyond it. The search
    evaluates every 64th edge (for 2048 bins), then every 8th around the best,
    then every edge around that; each stage is vectorised over rows and
    candidates.

    Example:
        >>> import torch
        >>> _ = torch.manual_seed(0)
        >>> obs = HistogramObserver(quant_min=-8, quant_max=7, qscheme=torch.per_tensor_symmetric)
        >>> _ = obs(torch.cat([torch.randn(10000), torch.tensor([50.0])]))
        >>> lo, hi = obs.clip_range()
        >>> bool(2.0 < hi < 4.0), bool(lo == -hi)
        (True, True)
    """

    def _expected_errors(self, histogram: Tensor, width: Tensor, edges: Tensor, one_sided: Tensor) -> Tensor:
        """``[C, K]`` expected total squared error of ``histogram`` (bins of ``width``) clipped at ``edges · width``."""
        t = (edges * width.unsqueeze(1)).float()
        lo = torch.where(one_sided.unsqueeze(1), torch.zeros_like(t), -t)
        scale, zero_point = qparams_from_range(
            lo, t, self.quant_min, self.quant_max, self.symmetric, self.pot_scale, self.eps
        )
        s = scale.double().unsqueeze(2)  # [C, K, 1]
        top = (self.quant_max - zero_point).clamp(min=0).double().unsqueeze(2) * s
        bounds = torch.arange(histogram.shape[1] + 1, device=histogram.device, dtype=torch.float64)
        v = (bounds * width.unsqueeze(1)).unsqueeze(1)  # [C, 1, B + 1]
        # Antiderivative of the squared error: rounding error up to the top level, clipping error beyond it.
        inside = torch.minimum(v, top)
        nearest = torch.round(inside / s)
        offset = inside - nearest * s
        clipped = (v - top).clamp_(min=0)
        antiderivative = nearest * (s.pow(3) / 12) + (offset.pow(3) + clipped.pow(3)) / 3
        per_bin = antiderivative.diff(dim=2)
        return (per_bin * histogram.unsqueeze(1)).sum(dim=2) / width.unsqueeze(1)

    def _search(self, histogram: Tensor, width: Tensor, edges: Tensor, one_sided: Tensor) -> Tensor:
        """The ``[C, K]`` errors of every candidate in ``edges``, a chunk of candidates at a time."""
        chunk = max(1, _CHUNK_ELEMENTS // (histogram.shape[0] * (histogram.shape[1] + 1)))
        return torch.cat(
            [
                self._expected_errors(histogram, width, edges[:, start : start + chunk], one_sided)
                for start in range(0, edges.shape[1], chunk)
            ],
            dim=1,
        )

    def _threshold(self) -> Tensor:
        histogram = self.histogram.double()
        width = self.bin_width.double()
        one_sided = self._one_sided()
        channels = histogram.shape[0]
        device = histogram.device
        # Coarse to fine over bin edges: every `stride`-th edge, then a finer stride around the best, down to 1.
        # Candidates run from the widest range down, so that argmin's first minimum is the widest of ties.
        stride = max(1, self.bins // _COARSE_CANDIDATES)
        edges = torch.arange(self.bins, 0, -stride, device=device, dtype=torch.float64).expand(channels, -1)
        while True:
            errors = self._search(histogram, width, edges, one_sided)
            best = edges.gather(1, errors.argmin(dim=1, keepdim=True))
            if stride == 1:
                return best.squeeze(1) * width
            finer = max(1, stride // _REFINE)
            offsets = torch.arange(stride - finer, -stride, -finer, device=device, dtype=torch.float64)
            edges, stride = (best + offsets).clamp_(1, self.bins), finer


def _kl_divergence_search(histogram: Tensor, levels: int, stride: int, smoothing: float = 1e-4) -> Tensor:
    """``[C]`` number of leading bins ``i`` whose TensorRT-style KL divergence is least.

    For each candidate ``i`` (``bins``, ``bins - stride``, ... down to no fewer
    than ``levels``), with ``h`` the histogram: ``P`` is ``h[:i]`` with
    the mass beyond added to its last bin; ``Q`` merges ``h[:i]`` into
    ``levels`` groups (bin ``k`` into group ``k * levels // i``) and spreads each
    group's mass evenly over the group's bins where ``P`` is non-zero. Both are
    normalised; ``Q``'s zero bins among the first ``i`` get ``smoothing`` (then
    ``Q`` is renormalised), and ``KL(P || Q)`` is summed over ``P``'s support.
    Ties go to the larger ``i``.

    ``Q`` is constant within a group, so the divergence is computed per group
    from prefix sums of ``h``, ``h > 0`` and ``h log h``: ``O(levels)`` per
    candidate instead of ``O(bins)``.
    """
    channels, bins = histogram.shape
    device = histogram.device
    if levels >= bins:
        return torch.full((channels,), bins, device=device, dtype=torch.long)
    candidates = torch.arange(bins, levels - 1, -stride, device=device)
    zero = torch.zeros(channels, 1, dtype=torch.float64, device=device)
    mass_before = torch.cat([zero, histogram.cumsum(dim=1)], dim=1)  # [C, B + 1]
    support_before = torch.cat([zero, (histogram > 0).double().cumsum(dim=1)], dim=1)
    entropy_before = torch.cat([zero, torch.special.xlogy(histogram, histogram).cumsum(dim=1)], dim=1)
    total = mass_before[:, -1:].clamp(min=1e-300)  # [C, 1]
    group = torch.arange(levels + 1, device=device)
    chunk = max(1, _CHUNK_ELEMENTS // (channels * (levels + 1)))
    divergences = []
    for i in candidates.split(chunk):
        count = i.shape[0]
        # Group g holds bins [ceil(g i / levels), ceil((g + 1) i / levels)); prefix sums there give group totals.
        starts = (group.unsqueeze(0) * i.unsqueeze(1) + levels - 1) // levels  # [K, levels + 1]
        flat = starts.reshape(1, -1).expand(channels, -1)
        mass = mass_before.gather(1, flat).view(channels, count, levels + 1).diff(dim=2)  # [C, K, levels]
        members = support_before.gather(1, flat).view(channels, count, levels + 1).diff(dim=2)
        head = mass_before[:, i]  # [C, K]: mass of h[:i]
        outliers = mass_before[:, -1:] - head
        last = histogram[:, i - 1]
        # The last bin joins P's support when only outliers make it non-zero.
        members[:, :, -1] += ((last == 0) & (outliers > 0)).double()
        p_mass = mass.clone()
        p_mass[:, :, -1] += outliers
        # sum over P's support of P log P, with P = h / total except the last bin (h[i-1] + outliers) / total.
        p_last = last + outliers
        plogp = entropy_before[:, i - 1] + torch.special.xlogy(p_last, p_last)
        plogp = plogp / total - torch.log(total)
        # Q: mass / members / head on the group's support bins (zero where a group has no mass).
        q = mass / members.clamp(min=1) / head.unsqueeze(2).clamp(min=1e-300)
        nonzero_q = (mass > 0).double() * members
        empty = i.unsqueeze(0) - nonzero_q.sum(dim=2)  # Q's zero bins among the first i
        log_q = torch.where(mass > 0, torch.log(q.clamp(min=1e-300)), torch.full_like(q, smoothing).log())
        cross = (p_mass * log_q).sum(dim=2) / total - torch.log1p(smoothing * empty)
        divergences.append(plogp - cross)
    best = torch.cat(divergences, dim=1).argmin(dim=1)
    return candidates[best]


class KLDObserver(_AbsHistogramObserver):
    """Entropy calibration (TensorRT style): the threshold whose clipped, requantized histogram stays closest in KL.

    The number of quantized levels is the grid's size, halved when the grid is
    two-sided (``[-t, t]``): 128 for 8-bit signed or affine-on-mixed-sign data,
    256 for affine on non-negative data. Candidates are every ``stride``-th
    bin count from ``bins`` down to that number of levels; the threshold is the
    upper edge of the best candidate's last bin. See :func:`_kl_divergence_search`.

    Example:
        >>> import torch
        >>> _ = torch.manual_seed(0)
        >>> obs = KLDObserver(quant_min=-128, quant_max=127, qscheme=torch.per_tensor_symmetric)
        >>> _ = obs(torch.cat([torch.randn(100000), torch.tensor([-60.0, 60.0])]))
        >>> lo, hi = obs.clip_range()
        >>> bool(2.0 < hi < 10.0), bool(lo == -hi)
        (True, True)
    """

    def __init__(self, *args: Any, stride: int = 1, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if stride < 1:
            raise ValueError(f"stride must be at least 1, got {stride}")
        self.stride = int(stride)

    def _threshold(self) -> Tensor:
        histogram = self.histogram.double()
        one_sided = self._one_sided()
        size = self.quant_max - self.quant_min + 1
        bins = torch.empty(histogram.shape[0], dtype=torch.long, device=histogram.device)
        for flag in (False, True):
            selected = one_sided == flag
            if bool(selected.any()):
                levels = size if flag else size // 2
                bins[selected] = _kl_divergence_search(histogram[selected], levels, self.stride)
        return bins * self.bin_width


class PercentileObserver(_AbsHistogramObserver):
    """Clip ``|x|`` at its ``percentile`` (interpolated linearly within the histogram bin).

    Example:
        >>> import torch
        >>> obs = PercentileObserver(percentile=90.0, bins=1024, dtype=torch.qint8, qscheme=torch.per_tensor_symmetric)
        >>> _ = obs(torch.linspace(-1.0, 1.0, 2001))
        >>> lo, hi = obs.clip_range()
        >>> round(hi.item(), 3), bool(lo == -hi)
        (0.9, True)
    """

    def __init__(self, *args: Any, percentile: float = 99.99, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not 0.0 < percentile <= 100.0:
            raise ValueError(f"percentile must be in (0, 100], got {percentile}")
        self.percentile = float(percentile)

    def _threshold(self) -> Tensor:
        histogram = self.histogram.double()
        cumulative = histogram.cumsum(dim=1)
        target = cumulative[:, -1:] * (self.percentile / 100.0)
        index = torch.searchsorted(cumulative, target).clamp_(max=self.bins - 1)
        before = torch.where(index > 0, cumulative.gather(1, (index - 1).clamp(min=0)), torch.zeros_like(target))
        within = histogram.gather(1, index)
        fraction = ((target - before) / within.clamp(min=1)).clamp(0, 1)
        return ((index + fraction) * self.bin_width.double().unsqueeze(1)).squeeze(1)
