"""MinMax, EMAMinMax, MeanMinMax, MinMaxFloor and PoTMode observers against NumPy references."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mqbench.observer import (
    EMAMinMaxObserver,
    MeanMinMaxObserver,
    MinMaxFloorObserver,
    MinMaxObserver,
    PoTModeObserver,
)
from observer_helpers import EPS, batches, np_fake_quant


def np_qparams(lo: float, hi: float, qmin: int, qmax: int, symmetric: bool) -> tuple[float, int]:
    """Scale and zero point of a range, written independently of mqbench.functional."""
    lo, hi = min(float(lo), 0.0), max(float(hi), 0.0)
    if symmetric:
        scale = (max(-lo, hi) / ((qmax - qmin) / 2)) if qmin < 0 else hi / qmax
        return max(scale, EPS), 0
    scale = max((hi - lo) / (qmax - qmin), EPS)
    return scale, int(np.clip(qmin - np.round(lo / scale), qmin, qmax))


# -- formulas ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("symmetric", [False, True])
def test_minmax_is_running_min_max(symmetric: bool) -> None:
    data = batches(0, (4, 50), 4)
    qscheme = torch.per_tensor_symmetric if symmetric else torch.per_tensor_affine
    obs = MinMaxObserver(quant_min=-128, quant_max=127, qscheme=qscheme)
    for x in data:
        obs(x)
    flat = torch.cat([x.flatten() for x in data]).numpy()
    assert obs.min_val.item() == flat.min() and obs.max_val.item() == flat.max()
    scale, zero_point = obs.calculate_qparams()
    ref_scale, ref_zp = np_qparams(flat.min(), flat.max(), -128, 127, symmetric)
    assert scale.item() == pytest.approx(ref_scale, rel=1e-6)
    assert zero_point.item() == ref_zp
    assert scale.dtype == torch.float32 and zero_point.dtype == torch.int32


def test_ema_minmax_formula() -> None:
    data = batches(1, (64,), 5)
    obs = EMAMinMaxObserver(ema_ratio=0.7)
    lo, hi = float(data[0].min()), float(data[0].max())
    for i, x in enumerate(data):
        obs(x)
        if i:
            lo = 0.7 * lo + 0.3 * float(x.min())
            hi = 0.7 * hi + 0.3 * float(x.max())
    assert obs.min_val.item() == pytest.approx(lo, rel=1e-6)
    assert obs.max_val.item() == pytest.approx(hi, rel=1e-6)


@given(amax=st.floats(1e-6, 1e6), qbits=st.sampled_from([4, 8]))
@settings(max_examples=40, deadline=None)
def test_minmax_floor_never_clips_and_is_smallest(amax: float, qbits: int) -> None:
    qmax = 2 ** (qbits - 1) - 1
    obs = MinMaxFloorObserver(quant_min=-qmax - 1, quant_max=qmax)
    x = torch.tensor([-amax / 3, amax], dtype=torch.float32)
    obs(x)
    scale = obs.calculate_qparams()[0].item()
    exact = float(x.abs().max())
    assert np.log2(scale) == round(np.log2(scale))
    assert qmax * scale >= exact  # never clips
    assert qmax * scale / 2 < exact  # and the next smaller power of two would
    fq = np_fake_quant(x.numpy().astype(np.float64), scale, 0, -qmax - 1, qmax)
    assert np.all(np.abs(fq - x.numpy()) <= scale / 2 + 1e-12)


def pot_batch_best(x: np.ndarray, qmin: int, qmax: int, exponents: range) -> int:
    errors = {e: np.mean((x - np_fake_quant(x, 2.0**e, 0, qmin, qmax)) ** 2) for e in exponents}
    return min(errors, key=lambda e: (errors[e], -e))


def test_pot_mode_single_batch_brute_force() -> None:
    x = batches(2, (2000,), 1)[0]
    obs = PoTModeObserver(quant_min=-128, quant_max=127)
    obs(x)
    xs = x.numpy().astype(np.float64)
    best = pot_batch_best(xs, -128, 127, range(-20, 10))
    assert obs.calculate_qparams()[0].item() == 2.0**best


def test_pot_mode_heavy_tail_within_window() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.cat([torch.randn(5000, generator=gen), torch.tensor([30.0])])
    obs = PoTModeObserver(quant_min=-8, quant_max=7, search_width=4)
    obs(x)
    xs = x.numpy().astype(np.float64)
    top = next(e for e in range(-30, 30) if 7 * 2.0**e >= np.abs(xs).max())
    best = pot_batch_best(xs, -8, 7, range(top - 4, top + 1))
    assert best < top  # the outlier is clipped
    assert obs.calculate_qparams()[0].item() == 2.0**best


def test_pot_mode_is_mode_over_batches() -> None:
    gen = torch.Generator().manual_seed(4)
    factors = [1.0, 4.0, 4.0, 0.25, 4.0, 1.0]
    obs = PoTModeObserver(quant_min=-128, quant_max=127)
    winners = []
    for f in factors:
        x = torch.randn(1000, generator=gen) * f
        obs(x)
        winners.append(pot_batch_best(x.numpy().astype(np.float64), -128, 127, range(-20, 10)))
    counts = Counter(winners)
    mode = max(counts, key=lambda e: (counts[e], e))
    assert obs.calculate_qparams()[0].item() == 2.0**mode


def test_pot_mode_tie_goes_to_larger_scale() -> None:
    obs = PoTModeObserver(quant_min=-128, quant_max=127)
    obs(torch.full((10,), 127.0))  # exponent 0
    obs(torch.full((10,), 254.0))  # exponent 1
    assert obs.calculate_qparams()[0].item() == 2.0


# -- MeanMinMaxObserver ------------------------------------------------------------------------------


def test_mean_min_max_averages_each_sample_whatever_the_batching() -> None:
    torch.manual_seed(0)
    data = torch.randn(7, 3, 5, 5) * torch.linspace(0.5, 4.0, 7).view(7, 1, 1, 1)
    expected_low = float(sum(sample.min() for sample in data) / len(data))
    expected_high = float(sum(sample.max() for sample in data) / len(data))
    for sizes in ([7], [1] * 7, [2, 4, 1]):
        observer = MeanMinMaxObserver()
        for batch in data.split(sizes):
            observer(batch)
        assert observer.min_val.item() == pytest.approx(expected_low, rel=1e-6)
        assert observer.max_val.item() == pytest.approx(expected_high, rel=1e-6)
    # an outlier sample moves the range by its share, where the running min/max follows it whole
    spiked = data.clone()
    spiked[3, 0, 0, 0] = 100.0
    observer, running = MeanMinMaxObserver(), MinMaxObserver()
    observer(spiked), running(spiked)
    assert running.max_val.item() == 100.0
    assert observer.max_val.item() == pytest.approx(expected_high + (100.0 - float(data[3].max())) / 7, rel=1e-6)


def test_mean_min_max_keeps_channel_extremes_and_forgets_on_reset() -> None:
    torch.manual_seed(1)
    data = torch.randn(4, 3, 6)
    observer = MeanMinMaxObserver(qscheme=torch.per_channel_symmetric, ch_axis=1)
    observer(data[:1]), observer(data[1:])
    assert torch.equal(observer.max_val, data.amax(dim=(0, 2)))
    assert torch.equal(observer.min_val, data.amin(dim=(0, 2)))
    per_tensor = MeanMinMaxObserver()
    per_tensor(data), per_tensor(data)
    per_tensor.num_batches.zero_()  # what mqbench.utils.state.reset_observers does
    per_tensor(data[2:])
    assert per_tensor.max_val.item() == pytest.approx(float(data[2:].amax(dim=(1, 2)).mean()), rel=1e-6)
    assert int(per_tensor.samples) == 2
