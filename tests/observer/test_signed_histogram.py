"""AffineHistogramObserver against a brute-force search of the data's own squared error (NumPy)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mqbench.observer import AffineHistogramObserver, HistogramObserver, PercentileObserver
from observer_helpers import np_fake_quant, observe


def _data(kind: str) -> np.ndarray:
    rng = np.random.default_rng(5)
    x = rng.standard_normal(40000)
    if kind == "gelu":  # GELU's output: down to -0.17, a long right tail
        x = 3 * x
        return x * 0.5 * (1 + np.tanh(0.7978845608 * (x + 0.044715 * x**3)))
    if kind == "skewed-outliers":  # most values near zero, a few far positive ones
        return np.concatenate([x, rng.uniform(5, 35, 40)])
    if kind == "mostly-negative":  # a softmax's input
        return 2 * x - 4
    if kind == "relu":  # half of it exactly zero
        return np.maximum(x, 0) ** 2
    raise ValueError(kind)


def _data_error(x: np.ndarray, scale: float, zero_point: int, qmin: int, qmax: int) -> float:
    return float(np.mean((x - np_fake_quant(x, scale, zero_point, qmin, qmax)) ** 2))


def _brute_force(x: np.ndarray, qmin: int, qmax: int, symmetric: bool) -> float:
    """The least error over 400 scales up to the one covering all of ``x`` and every zero point of each."""
    lo, hi = min(float(x.min()), 0.0), max(float(x.max()), 0.0)
    if symmetric:
        widest = max(-lo, hi) / ((qmax - qmin) / 2) if qmin < 0 else hi / qmax
        zero_points = [0]
    else:
        widest = (hi - lo) / (qmax - qmin)
        zero_points = list(range(qmin, qmax + 1))
    errors = [_data_error(x, widest * k / 400, z, qmin, qmax) for k in range(1, 401) for z in zero_points]
    return min(errors)


@pytest.mark.parametrize("kind", ["gelu", "skewed-outliers", "mostly-negative", "relu"])
@pytest.mark.parametrize(
    ("qmin", "qmax", "qscheme"),
    [
        (0, 255, torch.per_tensor_affine),
        (0, 15, torch.per_tensor_affine),
        (-128, 127, torch.per_tensor_symmetric),
        (-8, 7, torch.per_tensor_symmetric),
    ],
    ids=["u8-affine", "u4-affine", "s8-sym", "s4-sym"],
)
def test_the_grid_is_as_good_as_a_brute_force_search_of_the_data(kind: str, qmin: int, qmax: int, qscheme) -> None:
    x = _data(kind)
    symmetric = qscheme == torch.per_tensor_symmetric
    if not symmetric and qmax == 255 and kind != "gelu":
        x = x[:10000]  # 256 zero points x 400 scales: keep the reference search short
    obs = AffineHistogramObserver(quant_min=qmin, quant_max=qmax, qscheme=qscheme)
    observe(obs, torch.from_numpy(x).float().split(7000))
    scale, zero_point = (v.item() for v in obs.calculate_qparams())
    if not symmetric:  # the qparams of the returned range are the grid searched: its ends are the grid's ends
        lo, hi = (float(v) for v in obs.clip_range())
        assert lo / scale == pytest.approx(qmin - zero_point, abs=1e-3)
        assert hi / scale == pytest.approx(qmax - zero_point, abs=1e-3)
    found = _data_error(x.astype(np.float32).astype(np.float64), scale, int(zero_point), qmin, qmax)
    best = _brute_force(x.astype(np.float32).astype(np.float64), qmin, qmax, symmetric)
    # within 1% of the best of a finer scan (the observer's model takes values as uniform within each bin)
    assert found <= best * 1.01


def test_an_affine_grid_beats_the_abs_histogram_on_skewed_data() -> None:
    """On GELU's output both ends matter: the |x| model of HistogramObserver cannot place them independently."""
    x = _data("gelu")
    errors = {}
    for cls in (AffineHistogramObserver, HistogramObserver, PercentileObserver):
        obs = observe(cls(quant_min=0, quant_max=15), [torch.from_numpy(x).float()])
        scale, zero_point = (v.item() for v in obs.calculate_qparams())
        errors[cls.__name__] = _data_error(x, scale, int(zero_point), 0, 15)
    assert errors["AffineHistogramObserver"] < min(errors["HistogramObserver"], errors["PercentileObserver"])


def test_the_histogram_does_not_depend_on_the_batch_order() -> None:
    """Ranges that double as larger batches arrive merge bins exactly: any order gives one pass's histogram."""
    gen = torch.Generator().manual_seed(3)
    parts = [torch.randn(500, generator=gen) * scale - shift for scale, shift in ((0.1, 0.0), (3.0, 1.0), (40.0, 5.0))]
    reference = observe(AffineHistogramObserver(bins=256), [torch.cat(parts)])
    for order in ((0, 1, 2), (2, 1, 0), (1, 0, 2)):
        obs = observe(AffineHistogramObserver(bins=256), [parts[i] for i in order])
        assert torch.equal(obs.histogram, reference.histogram) and torch.equal(obs.hist_range, reference.hist_range)
        for a, b in zip(obs.calculate_qparams(), reference.calculate_qparams(), strict=True):
            assert torch.equal(a, b)
    assert int(reference.histogram.sum()) == 1500


def test_bins_must_be_a_power_of_two() -> None:
    with pytest.raises(ValueError, match="power of two"):
        AffineHistogramObserver(bins=100)
