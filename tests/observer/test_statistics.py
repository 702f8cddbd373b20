"""EMAQuantile, ClipStd, LSQ and LSQ+ observers against NumPy references."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mqbench.observer import (
    ClipStdObserver,
    EMAQuantileObserver,
    LSQObserver,
    LSQPlusObserver,
)
from observer_helpers import batches, observe


def flat(data) -> np.ndarray:
    return np.concatenate([x.numpy().ravel() for x in data]).astype(np.float64)


# -- EMAQuantile ----------------------------------------------------------------------------------


@given(n=st.integers(1, 3000), threshold=st.floats(0.5, 1.0), seed=st.integers(0, 2**16))
@settings(max_examples=30, deadline=None)
def test_ema_quantile_single_batch_matches_numpy(n: int, threshold: float, seed: int) -> None:
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    obs = EMAQuantileObserver(threshold=threshold)
    obs(x)
    values = np.sort(x.numpy().astype(np.float64))
    lo, hi = (v.item() for v in obs.clip_range())
    for got, q in ((hi, threshold), (lo, 1 - threshold)):
        expected = np.quantile(values, q)
        assert got == pytest.approx(expected, rel=1e-5, abs=1e-6)
        # Within one element's rank of the exact quantile.
        rank = q * (n - 1)
        assert values[max(0, math.floor(rank) - 1)] - 1e-6 <= got <= values[min(n - 1, math.ceil(rank) + 1)] + 1e-6


def test_ema_quantile_clips_outliers_and_averages() -> None:
    gen = torch.Generator().manual_seed(0)
    data = [torch.cat([torch.randn(20000, generator=gen) * s, torch.tensor([100.0, -100.0])]) for s in (1, 2, 3)]
    obs = observe(EMAQuantileObserver(ema_ratio=0.8, threshold=0.999), data)
    lo_ref = hi_ref = None
    for x in data:
        xs = x.numpy().astype(np.float64)
        lo, hi = np.quantile(xs, 0.001), np.quantile(xs, 0.999)
        lo_ref = lo if lo_ref is None else 0.8 * lo_ref + 0.2 * lo
        hi_ref = hi if hi_ref is None else 0.8 * hi_ref + 0.2 * hi
    lo, hi = obs.clip_range()
    assert lo.item() == pytest.approx(lo_ref, rel=1e-4)
    assert hi.item() == pytest.approx(hi_ref, rel=1e-4)
    assert hi.item() < 20  # the outliers are clipped
    assert obs.min_val.item() == -100 and obs.max_val.item() == 100


def test_ema_quantile_rejects_bad_threshold() -> None:
    with pytest.raises(ValueError, match="threshold"):
        EMAQuantileObserver(threshold=0.2)


# -- ClipStd --------------------------------------------------------------------------------------


@pytest.mark.parametrize("std_num", [0.5, 1.0, 3.0])
def test_clip_std_matches_numpy_over_all_batches(std_num: float) -> None:
    gen = torch.Generator().manual_seed(1)
    data = [torch.randn(500, generator=gen) * (i + 1) + 5.0 * i for i in range(4)]
    data.append(torch.tensor([80.0]))
    obs = observe(ClipStdObserver(std_num=std_num), data)
    xs = flat(data)
    lo_ref = max(xs.min(), xs.mean() - std_num * xs.std())
    hi_ref = min(xs.max(), xs.mean() + std_num * xs.std())
    lo, hi = obs.clip_range()
    assert lo.item() == pytest.approx(lo_ref, rel=1e-5)
    assert hi.item() == pytest.approx(hi_ref, rel=1e-5)
    assert hi.item() < 80  # it actually clips
    scale, _ = obs.calculate_qparams()
    assert scale.item() == pytest.approx((hi_ref - min(lo_ref, 0)) / 255, rel=1e-5)


def test_clip_std_never_exceeds_min_max() -> None:
    obs = observe(ClipStdObserver(std_num=3.0), [torch.tensor([0.0, 1.0])])
    lo, hi = obs.clip_range()
    assert (lo.item(), hi.item()) == (0.0, 1.0)


def test_clip_std_is_stable_with_large_mean() -> None:
    gen = torch.Generator().manual_seed(2)
    data = [1000.0 + 0.01 * torch.randn(4000, generator=gen) for _ in range(5)]
    obs = observe(ClipStdObserver(std_num=1.0), data)
    xs = flat(data)
    assert obs.std.item() == pytest.approx(xs.std(), rel=1e-3)


# -- LSQ / LSQ+ -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("qmin", "qmax"), [(-128, 127), (0, 255), (-8, 7)])
def test_lsq_scale_is_paper_formula(qmin: int, qmax: int) -> None:
    data = batches(3, (300,), 4)
    obs = observe(LSQObserver(quant_min=qmin, quant_max=qmax, qscheme=torch.per_tensor_symmetric), data)
    scale, zero_point = obs.calculate_qparams()
    xs = flat(data)
    assert scale.shape == (1,) and scale.dtype == torch.float32
    assert scale.item() == pytest.approx(2 * np.abs(xs).mean() / math.sqrt(qmax), rel=1e-6)
    assert zero_point.tolist() == [0] and zero_point.dtype == torch.int32


@pytest.mark.parametrize(("qmin", "qmax"), [(-128, 127), (0, 255), (-8, 7), (0, 15)])
def test_lsq_plus_scale_is_paper_formula(qmin: int, qmax: int) -> None:
    data = batches(4, (300,), 4)
    obs = observe(LSQPlusObserver(quant_min=qmin, quant_max=qmax, qscheme=torch.per_tensor_symmetric), data)
    scale, zero_point = obs.calculate_qparams()
    xs = flat(data)
    bits = round(math.log2(qmax - qmin + 1))
    mean, std = xs.mean(), xs.std()
    expected = max(abs(mean - 3 * std), abs(mean + 3 * std)) / 2 ** (bits - 1)
    assert scale.item() == pytest.approx(expected, rel=1e-6)
    assert zero_point.tolist() == [0]


@pytest.mark.parametrize("cls", [LSQObserver, LSQPlusObserver])
@pytest.mark.parametrize("shift", [-1.0, 0.0, 2.0])
def test_lsq_affine_zero_point_from_running_min(cls, shift: float) -> None:
    data = [x.abs() + shift for x in batches(5, (200,), 3)]
    obs = observe(cls(quant_min=0, quant_max=255, qscheme=torch.per_tensor_affine), data)
    scale, zero_point = obs.calculate_qparams()
    min_neg = min(flat(data).min(), 0.0)
    expected = int(np.clip(0 - np.round(min_neg / scale.item()), 0, 255))
    assert zero_point.tolist() == [expected]
    if shift >= 0:
        assert expected == 0


def test_lsq_pot_scale() -> None:
    data = batches(6, (100,), 2)
    obs = observe(LSQObserver(quant_min=-128, quant_max=127, qscheme=torch.per_tensor_symmetric, pot_scale=True), data)
    scale = obs.calculate_qparams()[0].item()
    raw = 2 * np.abs(flat(data)).mean() / math.sqrt(127)
    assert scale == 2.0 ** round(math.log2(raw))


# -- per-channel ------------------------------------------------------------------------------------


def test_per_channel_statistics_have_channel_shape() -> None:
    obs = observe(ClipStdObserver(qscheme=torch.per_channel_affine, ch_axis=1), batches(8, (2, 5, 3), 2))
    assert obs.mean.shape == (5,) and obs.m2.shape == (5,) and obs.count.shape == ()
    lo, hi = obs.clip_range()
    assert lo.shape == hi.shape == (5,)
