"""The fused CPU kernels and the PyTorch fallback both equal the reference arithmetic."""

import os
import time

import numpy as np
import pytest
import torch

from mqbench import kernels
from mqbench.fake_quantize import NNIEFakeQuantize
from mqbench.functional import fake_quantize, folded_learnable_fake_quantize, learnable_fake_quantize


@pytest.fixture(params=["fused", "pytorch"])
def path(request, monkeypatch):
    if request.param == "fused":
        assert kernels.load() is not None, "the fused kernels did not build on this machine"
    else:
        monkeypatch.setattr(kernels, "usable", lambda *tensors: False)
    return request.param


def data_with_ties(shape, scale, seed):
    """Random values plus exact half-way points (k + 0.5) * scale, where rounding direction matters."""
    generator = np.random.default_rng(seed)
    x = generator.standard_normal(shape).astype(np.float32) * np.float32(40 * scale)
    flat = x.reshape(-1)
    ties = generator.integers(-200, 200, flat.size // 4)
    flat[: ties.size] = ((ties + 0.5) * scale).astype(np.float32)
    return x


def reference(x, scale, zero_point, quant_min, quant_max, axis):
    shape = [1] * x.ndim
    if axis is not None:
        shape[axis] = -1
    s = np.asarray(scale, np.float32).reshape(shape)
    z = np.asarray(zero_point, np.float32).reshape(shape)
    q = np.round(x / s) + z
    inside = (q >= quant_min) & (q <= quant_max)
    return ((np.clip(q, quant_min, quant_max) - z) * s).astype(np.float32), q, inside, s, z


@pytest.mark.parametrize("axis", [None, 0, 1, 3])
def test_fixed_forward_and_mask(path, axis):
    x = data_with_ties((4, 6, 5, 7), 0.05, seed=1)
    channels = 1 if axis is None else x.shape[axis]
    scale = np.linspace(0.03, 0.07, channels).astype(np.float32)
    zero_point = np.arange(channels, dtype=np.int32) % 5 + 100
    expected, _, inside, _, _ = reference(x, scale, zero_point, 0, 255, axis)
    t = torch.from_numpy(x.copy()).requires_grad_()
    out = fake_quantize(t, torch.from_numpy(scale), torch.from_numpy(zero_point), 0, 255, axis)
    np.testing.assert_array_equal(out.detach().numpy(), expected)
    out.backward(torch.ones_like(out))
    np.testing.assert_array_equal(t.grad.numpy(), inside.astype(np.float32))


@pytest.mark.parametrize("axis", [None, 1])
def test_learnable_backward(path, axis):
    x = data_with_ties((3, 8, 33), 0.1, seed=2)
    channels = 1 if axis is None else x.shape[axis]
    scale = np.linspace(0.08, 0.12, channels).astype(np.float32)
    zero_point = np.full(channels, 3.0, np.float32)
    grad = np.random.default_rng(3).standard_normal(x.shape).astype(np.float32)
    expected, q, inside, s, z = reference(x, scale, zero_point, -8, 7, axis)
    t = torch.from_numpy(x.copy()).requires_grad_()
    scale_t = torch.from_numpy(scale.copy()).requires_grad_()
    zero_t = torch.from_numpy(zero_point.copy()).requires_grad_()
    out = learnable_fake_quantize(t, scale_t, zero_t, -8, 7, axis, grad_factor=0.25)
    np.testing.assert_array_equal(out.detach().numpy(), expected)
    out.backward(torch.from_numpy(grad))
    below, above = q < -8, q > 7
    local = np.where(below, -8 - z, np.where(above, 7 - z, np.round(x / s) - x / s))
    reduce_axes = tuple(d for d in range(x.ndim) if axis is None or d != axis)
    np.testing.assert_array_equal(t.grad.numpy(), grad * inside)
    np.testing.assert_allclose(scale_t.grad.numpy(), 0.25 * (grad * local).sum(reduce_axes), rtol=1e-4, atol=1e-4)
    zero_grad = np.where(inside, 0.0, -grad * s).sum(reduce_axes)
    np.testing.assert_allclose(zero_t.grad.numpy(), 0.25 * zero_grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("axis", [None, 1])
def test_learnable_with_dropped_elements(path, axis):
    """QDrop's drop: an element with byte >= threshold is x itself, gradient 1 to x and none to scale or zero point."""
    x = data_with_ties((3, 8, 33), 0.1, seed=4)
    channels = 1 if axis is None else x.shape[axis]
    scale = np.linspace(0.08, 0.12, channels).astype(np.float32)
    zero_point = np.full(channels, 2.0, np.float32)
    grad = np.random.default_rng(5).standard_normal(x.shape).astype(np.float32)
    drop = np.random.default_rng(6).integers(0, 256, x.shape).astype(np.uint8)
    threshold = 128
    kept = drop < threshold
    quantized, q, inside, s, z = reference(x, scale, zero_point, -8, 7, axis)
    t = torch.from_numpy(x.copy()).requires_grad_()
    scale_t = torch.from_numpy(scale.copy()).requires_grad_()
    zero_t = torch.from_numpy(zero_point.copy()).requires_grad_()
    out = learnable_fake_quantize(
        t, scale_t, zero_t, -8, 7, axis, grad_factor=0.5, drop=torch.from_numpy(drop), threshold=threshold
    )
    np.testing.assert_array_equal(out.detach().numpy(), np.where(kept, quantized, x))
    out.backward(torch.from_numpy(grad))
    below, above = q < -8, q > 7
    local = np.where(below, -8 - z, np.where(above, 7 - z, np.round(x / s) - x / s))
    reduce_axes = tuple(d for d in range(x.ndim) if axis is None or d != axis)
    np.testing.assert_array_equal(t.grad.numpy(), np.where(kept, grad * inside, grad))
    expected_scale = 0.5 * np.where(kept, grad * local, 0.0).sum(reduce_axes)
    np.testing.assert_allclose(scale_t.grad.numpy(), expected_scale, rtol=1e-4, atol=1e-4)
    zero_grad = np.where(kept & ~inside, -grad * s, 0.0).sum(reduce_axes)
    np.testing.assert_allclose(zero_t.grad.numpy(), 0.5 * zero_grad, rtol=1e-4, atol=1e-4)


def log_grid_reference(x, data_max):
    """The logarithmic grid's formula in float64 NumPy (log2 and powers of 2 written out)."""
    x = np.asarray(x, np.float64)
    z = np.round(16 * np.log2(np.float64(data_max))) - 127
    with np.errstate(divide="ignore", invalid="ignore"):
        n = np.round(16 * np.log2(np.abs(x)))
    positive = x > 0
    k = np.clip(np.maximum(n - z, np.where(positive, 0, 1)), None, 127)
    level = (2.0 ** ((k + z) / 16)).astype(np.float32).astype(np.float64)
    threshold = (2.0 ** ((z - 16 + np.where(positive, 0, 1)) / 16)).astype(np.float32).astype(np.float64)
    keep = np.abs(x) >= threshold
    return np.where(keep, np.where(positive, level, -level), 0.0).astype(np.float32)


def boundary_neighbours():
    """The float32 values within 3 ULP of every rounding boundary 2^((j - 1/2) / 16) of 120 octaves, both signs."""
    exact = np.array([2.0**e * 2.0 ** ((j - 0.5) / 16) for e in range(-60, 60) for j in range(1, 17)])
    bits = exact.astype(np.float32).view(np.int32)
    near = (bits[:, None] + np.arange(-3, 4)[None, :]).reshape(-1).view(np.float32)
    return np.concatenate([near, -near, np.array([0.0, -0.0, np.inf, -np.inf], np.float32)])


@pytest.mark.parametrize("data_max", [1e-20, 0.01, 0.37, 1.0, 8.0, 1000.0, 3e15])
def test_log_grid_forward(path, data_max):
    """Every rounding boundary's neighbours and a wide random spread land on the formula's level; the
    gradient is straight through."""
    generator = np.random.default_rng(3)
    spread = (generator.standard_normal(20000) * data_max * np.exp(generator.uniform(-8, 2, 20000))).astype(np.float32)
    x = np.concatenate([boundary_neighbours(), spread])
    fq = NNIEFakeQuantize()
    fq.disable_observer()
    fq.data_max.fill_(data_max)
    t = torch.from_numpy(x).requires_grad_()
    out = fq(t)
    np.testing.assert_array_equal(out.detach().numpy(), log_grid_reference(x, fq.data_max.item()))
    out.backward(torch.ones_like(out))
    np.testing.assert_array_equal(t.grad.numpy(), np.ones_like(x))


def test_log_grid_every_mantissa():
    """Every float32 mantissa of one octave, both signs, lands on the formula's level: the kernel's code
    within an octave depends on the mantissa alone, so this covers every input the count sees."""
    mantissas = np.arange(2**23, dtype=np.uint32)
    x = (mantissas | np.uint32(127 << 23)).view(np.float32)  # [1, 2)
    x = np.concatenate([x, -x])
    fq = NNIEFakeQuantize()
    fq.disable_observer()
    fq.data_max.fill_(1.5)
    with torch.no_grad():
        out = fq(torch.from_numpy(x))
    np.testing.assert_array_equal(out.numpy(), log_grid_reference(x, fq.data_max.item()))


@pytest.mark.parametrize("data_max", [0.05, 2.0, 300.0])
def test_folded_log_grid_forward_and_gradients(path, data_max):
    """A training ConvBn's NNIE weight, q(w f) / f per output channel: forward against the formula in
    NumPy to the bit (the division is the multiplication by 1 / f in float32), gradients against
    float64 autograd of the formula with the identity through q."""
    generator = np.random.default_rng(7)
    w = (generator.standard_normal((10, 3, 3, 3)) * data_max / 4).astype(np.float32)
    w.reshape(-1)[:5] = 0.0
    f = generator.uniform(0.2, 3.0, 10).astype(np.float32)
    grad = generator.standard_normal(w.shape).astype(np.float32)
    fq = NNIEFakeQuantize()
    fq.disable_observer()
    fq.data_max.fill_(data_max)
    w_t, f_t = torch.from_numpy(w.copy()).requires_grad_(), torch.from_numpy(f.copy()).requires_grad_()
    out = fq.quantize_folded(w_t, f_t)
    assert out is not None
    shape = (-1, 1, 1, 1)
    expected = log_grid_reference(w * f.reshape(shape), fq.data_max.item()) * (np.float32(1.0) / f.reshape(shape))
    np.testing.assert_array_equal(out.detach().numpy(), expected)
    out.backward(torch.from_numpy(grad))
    w64 = torch.from_numpy(w).double().requires_grad_()
    f64 = torch.from_numpy(f).double().requires_grad_()
    scaled = w64 * f64.reshape(shape)
    levels = torch.from_numpy(log_grid_reference(scaled.detach().numpy(), data_max)).double()
    quantized = scaled + (levels - scaled).detach()  # the identity gradient through the grid
    ((quantized / f64.reshape(shape)) * torch.from_numpy(grad).double()).sum().backward()
    torch.testing.assert_close(w_t.grad.double(), w64.grad, rtol=1e-6, atol=1e-6)
    bound = 1e-5 * float(f64.grad.abs().max())
    torch.testing.assert_close(f_t.grad.double(), f64.grad, rtol=1e-4, atol=bound)


@pytest.mark.parametrize("per_channel", [True, False])
def test_folded_learnable_forward_and_gradients(path, per_channel):
    """fq(w f) / f against the formula in float32 (forward, to the bit) and float64 autograd of the
    formula written here (gradients to w, f, scale and zero point)."""
    generator = torch.Generator().manual_seed(4)
    w = torch.randn(12, 5, 3, 3, generator=generator)
    f = torch.rand(12, generator=generator) * 2 + 0.1
    channels = 12 if per_channel else 1
    scale = torch.rand(channels, generator=generator) * 0.05 + 0.02
    zero = torch.randint(-4, 4, (channels,), generator=generator).float()
    grad = torch.randn(w.shape, generator=generator)
    lo, hi, factor = -128, 127, 0.25
    leaves = [t.clone().requires_grad_() for t in (w, f, scale, zero)]
    out = folded_learnable_fake_quantize(*leaves, lo, hi, 0 if per_channel else None, factor, 1e-8)
    out.backward(grad)
    # forward: the formula in float32 NumPy, in the order the three ops compute it
    wn, fn, sn, zn = (t.numpy() for t in (w, f, scale, zero))
    shape = (-1, 1, 1, 1)
    s_b, z_b, f_b = sn.reshape(shape), zn.reshape(shape), fn.reshape(shape)
    q = np.round((wn * f_b) / s_b) + z_b
    expected = ((np.clip(q, lo, hi) - z_b) * s_b) * (np.float32(1.0) / f_b)
    np.testing.assert_array_equal(out.detach().numpy(), expected.astype(np.float32))
    # gradients: LSQ's straight-through formula in float64 autograd
    w64, f64, s64, z64 = (t.double().requires_grad_() for t in (w, f, scale, zero))
    s_b, z_b, f_b = s64.reshape(shape), z64.reshape(shape), f64.reshape(shape)
    v = w64 * f_b / s_b
    rounded = v + (torch.round(v) - v).detach()
    q = rounded + z_b
    clipped = q + (q.clamp(lo, hi) - q).detach()  # no gradient to x outside the range
    inside = ((q >= lo) & (q <= hi)).double()
    # outside the range the output is (bound - z) s: its gradients to s and z are those of that expression
    y = (clipped - z_b) * s_b * inside + (q.clamp(lo, hi).detach() - z_b) * s_b * (1 - inside)
    ((y / f_b) * grad.double()).sum().backward()
    got = {"w": leaves[0].grad, "f": leaves[1].grad, "scale": leaves[2].grad / factor, "zero": leaves[3].grad / factor}
    reference = {"w": w64.grad, "f": f64.grad, "scale": s64.grad, "zero": z64.grad}
    for name, value in got.items():
        bound = 1e-4 * float(reference[name].abs().max())
        torch.testing.assert_close(value.double(), reference[name], rtol=1e-4, atol=bound)


def test_a_build_lock_left_by_a_killed_build_is_removed_and_a_fresh_one_is_waited_for(tmp_path):
    """PyTorch's builder waits for its lock without a limit: one left by a process killed while building (older
    than any build takes) is removed with a warning; one a process holds now is left alone."""
    lock = tmp_path / "lock"
    lock.touch()
    assert not kernels.clear_stale_lock(tmp_path)  # a build in progress
    assert lock.exists()
    old = time.time() - kernels.STALE_LOCK_SECONDS - 60
    os.utime(lock, (old, old))
    with pytest.warns(RuntimeWarning, match="removed the kernel build lock"):
        assert kernels.clear_stale_lock(tmp_path)
    assert not lock.exists()
    assert not kernels.clear_stale_lock(tmp_path)  # no lock: nothing to do
