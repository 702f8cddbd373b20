"""Histogram, KLD and Percentile observers against NumPy references."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mqbench.observer import HistogramObserver, KLDObserver, PercentileObserver
from observer_helpers import EPS, np_fake_quant, observe


def np_qparams(lo: float, hi: float, qmin: int, qmax: int, symmetric: bool) -> tuple[float, int]:
    """Scale and zero point of a range, written independently of mqbench.functional.

    In float32 like the real qparams: a zero point at an exact half (e.g. [-t, t] on 0..15) rounds as they do.
    """
    f32 = np.float32
    lo, hi = min(f32(lo), f32(0.0)), max(f32(hi), f32(0.0))
    if symmetric:
        scale = (max(-lo, hi) / f32((qmax - qmin) / 2)) if qmin < 0 else hi / f32(qmax)
        return float(max(scale, f32(EPS))), 0
    scale = max((hi - lo) / f32(qmax - qmin), f32(EPS))
    return float(scale), int(np.clip(qmin - np.round(lo / scale), qmin, qmax))


def gaussian_with_outliers(n: int, seed: int) -> torch.Tensor:
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    return torch.cat([x, torch.tensor([-40.0, 35.0, 60.0])])


# -- the shared histogram -------------------------------------------------------------------------------


@pytest.mark.parametrize("bins", [2048, 100])
def test_histogram_grows_exactly_in_constant_memory(bins: int) -> None:
    gen = torch.Generator().manual_seed(0)
    data = [torch.randn(3000, generator=gen) * s for s in (0.3, 1.0, 5.0, 0.1, 40.0, 2.0, 700.0)]
    obs = PercentileObserver(bins=bins)
    sizes, seen = set(), 0
    for x in data:
        obs(x)
        seen += x.numel()
        assert int(obs.histogram.sum()) == seen
        sizes.add(tuple((name, tuple(b.shape)) for name, b in obs.named_buffers()))
    assert len(sizes) == 1  # memory never grows
    values = np.abs(np.concatenate([x.numpy() for x in data]).astype(np.float64))
    top = float(obs.hist_range[0])
    assert math.log2(top).is_integer() and top >= values.max() > top / 2
    if bins == 2048:  # power-of-two bins: the edges are exactly NumPy's
        expected, _ = np.histogram(values, bins=bins, range=(0.0, top))
        np.testing.assert_array_equal(obs.histogram[0].numpy(), expected)
    # Whatever the bins, batch order does not matter: merging is exact.
    reverse = observe(PercentileObserver(bins=bins), data[::-1])
    assert torch.equal(reverse.histogram, obs.histogram)
    assert torch.equal(reverse.hist_range, obs.hist_range)


def test_a_histogram_counts_values_on_every_bin_edge_and_more_of_one_value_than_float32_counts() -> None:
    """Values exactly on each bin edge, just below each, both zeros, subnormals, and 2**24 + 3 zeros (past the
    integers float32 holds exactly) in one batch: the counts of ``floor(|x| * bins / R)`` computed here."""
    bins, top = 2048, np.float32(4.0)
    edges = np.arange(bins + 1, dtype=np.float32) * (top / np.float32(bins))
    below = np.nextafter(edges[1:], np.float32(0.0))
    tiny = np.array([1e-40, -1e-45, 0.0, -0.0], dtype=np.float32)
    values = np.concatenate([edges, -edges, below, -below, tiny, np.zeros((1 << 24) + 3, dtype=np.float32)])
    obs = observe(PercentileObserver(bins=bins), [torch.from_numpy(values)])
    assert float(obs.hist_range[0]) == top
    index = np.minimum(np.floor(np.abs(values.astype(np.float64)) * bins / float(top)), bins - 1).astype(np.int64)
    np.testing.assert_array_equal(obs.histogram[0].numpy(), np.bincount(index, minlength=bins))


def test_per_channel_histograms_have_own_ranges() -> None:
    gen = torch.Generator().manual_seed(1)
    data = [
        torch.randn(4, 7, 5, generator=gen)
        * torch.tensor([0.01, 1.0, 3.0, 100.0, 0.5, 2.0, 9.0]).view(1, 7, 1)
        * (i + 1)
        for i in range(3)
    ]
    obs = observe(HistogramObserver(qscheme=torch.per_channel_symmetric, ch_axis=1, bins=256), data)
    assert obs.histogram.shape == (7, 256) and obs.hist_range.shape == (7,)
    for c in range(7):
        values = np.abs(np.concatenate([x[:, c].numpy().ravel() for x in data]).astype(np.float64))
        top = float(obs.hist_range[c])
        assert top >= values.max() > top / 2
        expected, _ = np.histogram(values, bins=256, range=(0.0, top))
        np.testing.assert_array_equal(obs.histogram[c].numpy(), expected)


def test_all_zero_input_has_smallest_range() -> None:
    obs = observe(PercentileObserver(), [torch.zeros(10)])
    assert obs.hist_range.item() == 2.0**-126
    assert obs.histogram[0, 0].item() == 10


# -- HistogramObserver --------------------------------------------------------------------------------


def model_errors(hist: np.ndarray, width: float, qmin: int, qmax: int, symmetric: bool, one_sided: bool, sub=64):
    """Expected squared error of every bin-edge threshold, integrating each bin numerically (midpoint rule)."""
    bins = len(hist)
    points = (np.arange(bins)[:, None] + (np.arange(sub) + 0.5) / sub) * width  # [B, sub]
    errors = []
    for k in range(1, bins + 1):
        t = k * width
        scale, zp = np_qparams(0.0 if one_sided else -t, t, qmin, qmax, symmetric)
        err = (points - np_fake_quant(points, scale, zp, qmin, qmax)) ** 2
        errors.append(float(np.sum(hist * err.mean(axis=1))))
    return np.array(errors)


@pytest.mark.parametrize(
    ("qmin", "qmax", "qscheme", "kind"),
    [
        (-128, 127, torch.per_tensor_symmetric, "mixed"),
        (-8, 7, torch.per_tensor_symmetric, "mixed"),
        (0, 15, torch.per_tensor_affine, "mixed"),
        (0, 15, torch.per_tensor_affine, "relu"),
        (0, 15, torch.per_tensor_symmetric, "relu"),
    ],
)
def test_histogram_threshold_minimises_model_error(qmin: int, qmax: int, qscheme, kind: str) -> None:
    x = gaussian_with_outliers(20000, seed=qmax)
    if kind == "relu":
        x = x.relu()
    obs = observe(HistogramObserver(quant_min=qmin, quant_max=qmax, qscheme=qscheme, bins=256), [x])
    lo, hi = (float(v) for v in obs.clip_range())
    hist = obs.histogram[0].numpy().astype(np.float64)
    width = float(obs.hist_range[0]) / 256
    symmetric = qscheme == torch.per_tensor_symmetric
    one_sided = kind == "relu" or (symmetric and qmin >= 0)
    errors = model_errors(hist, width, qmin, qmax, symmetric, one_sided)
    k = round(hi / width)
    assert hi == pytest.approx(k * width, rel=1e-6)
    assert errors[k - 1] <= errors.min() * 1.01
    assert lo == (0.0 if one_sided else -hi)
    if qmax < 127:
        assert hi < 20  # 4-bit: the outliers are clipped


@pytest.mark.parametrize(("qmin", "qmax"), [(-128, 127), (-8, 7)])
def test_histogram_threshold_near_data_optimum(qmin: int, qmax: int) -> None:
    x = gaussian_with_outliers(50000, seed=3)
    obs = observe(HistogramObserver(quant_min=qmin, quant_max=qmax, qscheme=torch.per_tensor_symmetric), [x])
    xs = x.numpy().astype(np.float64)

    def data_mse(t: float) -> float:
        scale, zp = np_qparams(-t, t, qmin, qmax, True)
        return float(np.mean((xs - np_fake_quant(xs, scale, zp, qmin, qmax)) ** 2))

    best = min(data_mse(t) for t in np.linspace(0.5, 60.0, 600))
    assert data_mse(float(obs.clip_range()[1])) <= best * 1.03


# -- KLDObserver --------------------------------------------------------------------------------------


def np_kl_divergences(hist: np.ndarray, levels: int, stride: int, smoothing: float = 1e-4) -> dict[int, float]:
    """TensorRT-style KL divergence of every candidate bin count, written directly."""
    bins = len(hist)
    result = {}
    for i in range(bins, levels - 1, -stride):
        p = hist[:i].copy()
        p[-1] += hist[i:].sum()
        group = np.arange(i) * levels // i
        support = p > 0
        mass = np.bincount(group, weights=hist[:i], minlength=levels)
        members = np.bincount(group, weights=support.astype(np.float64), minlength=levels)
        q = np.where(support, mass[group] / np.maximum(members[group], 1), 0.0)
        p = p / p.sum()
        q = q / q.sum() if q.sum() > 0 else q
        empty = q == 0
        q = (q + smoothing * empty) / (1 + smoothing * empty.sum())
        result[i] = float(np.sum(p[support] * np.log(p[support] / q[support])))
    return result


def check_kld(obs: KLDObserver, levels: int, stride: int) -> float:
    hist = obs.histogram[0].numpy().astype(np.float64)
    width = float(obs.hist_range[0]) / obs.bins
    divergences = np_kl_divergences(hist, levels, stride)
    hi = float(obs.clip_range()[1])
    amax = max(-float(obs.min_val), float(obs.max_val))
    chosen = round(hi / width)
    if hi < amax:
        assert hi == pytest.approx(chosen * width, rel=1e-6)
    assert chosen in divergences
    best = min(divergences.values())
    assert divergences[chosen] <= best + 1e-9 * max(1.0, abs(best))
    return hi


@pytest.mark.parametrize("seed", [0, 1])
def test_kld_gaussian_with_outliers(seed: int) -> None:
    x = gaussian_with_outliers(100000, seed=seed)
    obs = observe(KLDObserver(quant_min=-128, quant_max=127, qscheme=torch.per_tensor_symmetric), [x])
    hi = check_kld(obs, levels=128, stride=1)
    assert 2.0 < hi < 6.0  # well below the max of 60
    assert float(obs.clip_range()[0]) == -hi


@pytest.mark.parametrize(
    ("qmin", "qmax", "qscheme", "relu", "levels", "bins", "stride"),
    [
        (-8, 7, torch.per_tensor_symmetric, False, 8, 128, 1),
        (-8, 7, torch.per_tensor_symmetric, False, 8, 128, 3),
        (0, 255, torch.per_tensor_affine, False, 128, 512, 1),
        (0, 255, torch.per_tensor_affine, True, 256, 1024, 2),
        (0, 15, torch.per_tensor_symmetric, True, 16, 200, 1),
    ],
)
def test_kld_matches_brute_force(qmin, qmax, qscheme, relu, levels, bins, stride) -> None:
    gen = torch.Generator().manual_seed(bins)
    x = torch.randn(30000, generator=gen) ** 3
    if relu:
        x = x.relu()
    obs = observe(KLDObserver(quant_min=qmin, quant_max=qmax, qscheme=qscheme, bins=bins, stride=stride), [x])
    check_kld(obs, levels, stride)
    if relu:
        assert float(obs.clip_range()[0]) == 0.0


def test_kld_with_more_levels_than_bins_does_not_clip() -> None:
    x = gaussian_with_outliers(1000, seed=2)
    obs = observe(KLDObserver(quant_min=-128, quant_max=127, qscheme=torch.per_tensor_symmetric, bins=64), [x])
    assert float(obs.clip_range()[1]) == 60.0


def test_kld_per_tensor_2048_bins_is_fast() -> None:
    import time

    obs = observe(KLDObserver(quant_min=-128, quant_max=127), [gaussian_with_outliers(100000, seed=4)])
    start = time.perf_counter()
    obs.calculate_qparams()
    assert time.perf_counter() - start < 1.0


# -- PercentileObserver -------------------------------------------------------------------------------


@pytest.mark.parametrize("percentile", [50.0, 90.0, 99.0, 99.9])
def test_percentile_matches_numpy_within_a_bin(percentile: float) -> None:
    x = torch.randn(200000, generator=torch.Generator().manual_seed(4))
    obs = observe(PercentileObserver(percentile=percentile, dtype=torch.qint8), [x])
    width = float(obs.hist_range[0]) / obs.bins
    expected = np.percentile(np.abs(x.numpy().astype(np.float64)), percentile)
    assert abs(float(obs.clip_range()[1]) - expected) <= width


@given(
    percentile=st.floats(1.0, 100.0),
    seed=st.integers(0, 2**16),
    n=st.integers(1, 3000),
    bins=st.sampled_from([64, 2048]),
)
@settings(max_examples=30, deadline=None)
def test_percentile_within_a_rank_and_a_bin(percentile: float, seed: int, n: int, bins: int) -> None:
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) ** 3
    obs = observe(
        PercentileObserver(percentile=percentile, bins=bins, qscheme=torch.per_tensor_symmetric, dtype=torch.qint8), [x]
    )
    lo, hi = (float(v) for v in obs.clip_range())
    values = np.sort(np.abs(x.numpy().astype(np.float64)))
    width = float(obs.hist_range[0]) / bins
    # NumPy interpolates between order statistics at rank q (n - 1); the histogram's ECDF crosses q n.
    rank = percentile / 100 * (n - 1)
    below, above = values[max(0, math.floor(rank) - 1)], values[min(n - 1, math.ceil(rank) + 1)]
    assert below - width <= hi <= above + width
    assert hi <= values[-1]
    assert lo == -hi


def test_percentile_affine_non_negative_is_one_sided() -> None:
    x = torch.rand(10000, generator=torch.Generator().manual_seed(5)) * 4
    obs = observe(PercentileObserver(percentile=99.0, quant_min=0, quant_max=255), [x])
    lo, hi = (float(v) for v in obs.clip_range())
    assert lo == 0.0 and hi == pytest.approx(3.96, abs=4.0 / 2048 + 0.02)
    assert obs.calculate_qparams()[1].tolist() == [0]


# -- edge cases -------------------------------------------------------------------------------------


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="bins"):
        HistogramObserver(bins=1)
    with pytest.raises(ValueError, match="percentile"):
        PercentileObserver(percentile=0.0)
    with pytest.raises(ValueError, match="stride"):
        KLDObserver(stride=0)


@pytest.mark.parametrize("cls", [PercentileObserver, KLDObserver])
def test_an_affine_grid_keeps_the_observed_side_of_a_mostly_positive_range(cls):
    """Values in [-0.1, 10] with a few outliers: on an affine grid the clip is [max(min, -t), min(max, t)]
    (not [-t, t], which would spend half the levels on negative values never seen); a symmetric grid
    keeps [-t, t]."""
    torch.manual_seed(0)
    x = torch.rand(200_000) * 10.0 - 0.1
    x[:3] = 400.0
    affine = cls(dtype=torch.quint8, qscheme=torch.per_tensor_affine, quant_min=0, quant_max=255)
    symmetric = cls(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric, quant_min=-128, quant_max=127)
    affine(x)
    symmetric(x)
    lo, hi = affine.clip_range()
    s_lo, s_hi = symmetric.clip_range()
    assert float(lo) == pytest.approx(float(x.min()), abs=1e-6)  # the observed minimum, not -t
    assert 9.0 < float(hi) < 400.0  # clipped below the outliers
    assert float(s_lo) == -float(s_hi) and float(s_hi) == pytest.approx(float(hi), rel=1e-6)
