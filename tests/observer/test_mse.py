"""MSE and EMA-MSE observers against a brute-force dense-grid search in NumPy."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mqbench.observer import EMAMSEObserver, MSEObserver
from observer_helpers import EPS, observe

GRIDS = [(-128, 127, True), (0, 255, False), (-8, 7, True), (0, 15, False)]


def np_qparams(lo, hi, qmin: int, qmax: int, symmetric: bool, pot: bool = False):
    """Vectorised scale and zero point of ranges, written independently of mqbench.functional."""
    lo, hi = np.minimum(lo, 0.0), np.maximum(hi, 0.0)
    if symmetric:
        scale = np.maximum(-lo, hi) / ((qmax - qmin) / 2) if qmin < 0 else hi / qmax
    else:
        scale = (hi - lo) / (qmax - qmin)
    scale = np.maximum(scale, EPS)
    if pot:
        scale = 2.0 ** np.round(np.log2(scale))
    zero_point = np.zeros_like(scale) if symmetric else np.clip(qmin - np.round(lo / scale), qmin, qmax)
    return scale, zero_point


def np_errors(x: np.ndarray, lo, hi, qmin: int, qmax: int, symmetric: bool, p: float, pot: bool = False):
    """Mean |x - fq(x)|**p for each range (lo[k], hi[k])."""
    scale, zp = np_qparams(np.atleast_1d(lo), np.atleast_1d(hi), qmin, qmax, symmetric, pot)
    s, z = scale[:, None], zp[:, None]
    fq = (np.clip(np.round(x[None] / s) + z, qmin, qmax) - z) * s
    return np.mean(np.abs(x[None] - fq) ** p, axis=1)


def dense_optimum(x: np.ndarray, qmin: int, qmax: int, symmetric: bool, p: float, pot: bool = False) -> float:
    alphas = np.linspace(1.0, 1e-3, 1000)
    return float(np_errors(x, alphas * x.min(), alphas * x.max(), qmin, qmax, symmetric, p, pot).min())


def make_data(kind: str, n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if kind == "gauss":
        return torch.randn(n, generator=gen)
    if kind == "outliers":
        x = torch.randn(n, generator=gen)
        x[:3] = torch.tensor([25.0, -12.0, 18.0])
        return x
    if kind == "laplace":
        u = torch.rand(n, generator=gen) - 0.5
        return -torch.sign(u) * torch.log1p(-2 * u.abs()) + 0.5
    if kind == "relu":
        return torch.relu(torch.randn(n, generator=gen)) ** 1.5
    raise ValueError(kind)


def qscheme_of(symmetric: bool, per_channel: bool = False):
    if per_channel:
        return torch.per_channel_symmetric if symmetric else torch.per_channel_affine
    return torch.per_tensor_symmetric if symmetric else torch.per_tensor_affine


# -- the search ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("qmin", "qmax", "symmetric"), GRIDS)
@pytest.mark.parametrize("kind", ["gauss", "outliers", "laplace", "relu"])
@pytest.mark.parametrize("p", [2.0, 1.0, 2.4])
def test_search_is_near_dense_grid_optimum(qmin: int, qmax: int, symmetric: bool, kind: str, p: float) -> None:
    x = make_data(kind, 3000, seed=qmax + int(10 * p))
    obs = MSEObserver(quant_min=qmin, quant_max=qmax, qscheme=qscheme_of(symmetric), p=p)
    obs(x)
    xs = x.numpy().astype(np.float64)
    lo, hi = (float(v) for v in obs.clip_range())
    chosen = float(np_errors(xs, lo, hi, qmin, qmax, symmetric, p)[0])
    optimum = dense_optimum(xs, qmin, qmax, symmetric, p)
    assert chosen <= optimum * 1.01 + 1e-12
    # The chosen range is one of the searched ones: a ratio of the data's range.
    ratio = hi / xs.max()
    assert 0 < ratio <= 1 + 1e-6
    if xs.min() < 0:
        assert lo / xs.min() == pytest.approx(ratio, rel=1e-5)


@pytest.mark.parametrize(("qmin", "qmax", "symmetric"), GRIDS[:2])
def test_search_with_pot_scale(qmin: int, qmax: int, symmetric: bool) -> None:
    x = make_data("outliers", 3000, seed=5)
    obs = MSEObserver(quant_min=qmin, quant_max=qmax, qscheme=qscheme_of(symmetric), pot_scale=True)
    obs(x)
    scale = obs.calculate_qparams()[0].item()
    assert scale == 2.0 ** round(math.log2(scale))
    xs = x.numpy().astype(np.float64)
    lo, hi = (float(v) for v in obs.clip_range())
    chosen = float(np_errors(xs, lo, hi, qmin, qmax, symmetric, 2.0, pot=True)[0])
    assert chosen <= dense_optimum(xs, qmin, qmax, symmetric, 2.0, pot=True) * 1.01 + 1e-12


def test_outliers_are_clipped() -> None:
    x = make_data("outliers", 3000, seed=6)
    obs = MSEObserver(quant_min=-8, quant_max=7, qscheme=torch.per_tensor_symmetric)
    obs(x)
    assert obs.max_val.item() < 10.0


@pytest.mark.parametrize("symmetric", [True, False])
def test_per_channel_rows_each_near_optimum(symmetric: bool) -> None:
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(6, 4, 3, 3, generator=gen) * torch.tensor([0.1, 1, 3, 10, 0.5, 2]).view(-1, 1, 1, 1)
    w[2, 0, 0, 0] = 40.0
    obs = MSEObserver(quant_min=-8, quant_max=7, qscheme=qscheme_of(symmetric, True), ch_axis=0)
    obs(w)
    lo, hi = obs.clip_range()
    for c in range(6):
        xs = w[c].numpy().ravel().astype(np.float64)
        chosen = float(np_errors(xs, float(lo[c]), float(hi[c]), -8, 7, symmetric, 2.0)[0])
        assert chosen <= dense_optimum(xs, -8, 7, symmetric, 2.0) * 1.01 + 1e-12


# -- across batches -------------------------------------------------------------------------------------


def single_batch_ranges(data, **kwargs):
    ranges = []
    for x in data:
        obs = MSEObserver(**kwargs)
        obs(x)
        ranges.append(tuple(float(v) for v in obs.clip_range()))
    return ranges


def test_mse_keeps_widest_per_batch_optimum() -> None:
    data = [make_data(kind, 2000, seed=i) * (i + 1) for i, kind in enumerate(["gauss", "outliers", "laplace"])]
    kwargs = {"quant_min": -128, "quant_max": 127, "qscheme": torch.per_tensor_affine}
    ranges = single_batch_ranges(data, **kwargs)
    obs = observe(MSEObserver(**kwargs), data)
    assert obs.min_val.item() == pytest.approx(min(r[0] for r in ranges), rel=1e-6)
    assert obs.max_val.item() == pytest.approx(max(r[1] for r in ranges), rel=1e-6)


def test_ema_mse_averages_per_batch_optimum() -> None:
    data = [make_data(kind, 2000, seed=i) * (i + 1) for i, kind in enumerate(["gauss", "outliers", "laplace", "gauss"])]
    kwargs = {"quant_min": -8, "quant_max": 7, "qscheme": torch.per_tensor_symmetric}
    ranges = single_batch_ranges(data, **kwargs)
    lo, hi = ranges[0]
    for r in ranges[1:]:
        lo, hi = 0.75 * lo + 0.25 * r[0], 0.75 * hi + 0.25 * r[1]
    obs = observe(EMAMSEObserver(ema_ratio=0.75, **kwargs), data)
    assert obs.min_val.item() == pytest.approx(lo, rel=1e-5)
    assert obs.max_val.item() == pytest.approx(hi, rel=1e-5)


# -- edge cases -------------------------------------------------------------------------------------


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="num_candidates"):
        MSEObserver(num_candidates=1)
    with pytest.raises(ValueError, match="p must"):
        MSEObserver(p=0)
    with pytest.raises(ValueError, match="ema_ratio"):
        EMAMSEObserver(ema_ratio=1.0)
