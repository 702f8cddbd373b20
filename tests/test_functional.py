"""The quantization primitives against formulas written here in numpy."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from mqbench.functional import (
    EPS,
    bits_of_range,
    broadcast_to_axis,
    fake_quantize,
    learnable_fake_quantize,
    qparams_from_range,
)

finite = st.floats(-1e4, 1e4, allow_nan=False, allow_infinity=False, width=32)
ranges = st.sampled_from([(-128, 127), (-127, 127), (0, 255), (-8, 7), (0, 15), (-2, 1), (-32768, 32767)])


def reference_fake_quant(x, scale, zero_point, quant_min, quant_max):
    """ONNX QuantizeLinear/DequantizeLinear in float32 numpy: true division, round half to even."""
    x, scale = np.float32(x), np.float32(scale)
    q = np.clip(np.round(x / scale) + zero_point, quant_min, quant_max)
    return ((q - zero_point) * scale).astype(np.float32)


@given(lo=finite, hi=finite, qrange=ranges, symmetric=st.booleans())
def test_qparams_formula_and_zero_exact(lo, hi, qrange, symmetric):
    lo, hi = min(lo, hi), max(lo, hi)
    quant_min, quant_max = qrange
    scale, zero_point = qparams_from_range(torch.tensor(lo), torch.tensor(hi), quant_min, quant_max, symmetric)
    lo_, hi_ = np.float32(min(lo, 0.0)), np.float32(max(hi, 0.0))
    if symmetric and quant_min < 0:
        expected = max(-lo_, hi_) / np.float32((quant_max - quant_min) / 2)
    elif symmetric:
        expected = hi_ / np.float32(quant_max)
    else:
        expected = (hi_ - lo_) / np.float32(quant_max - quant_min)
    if expected == 0:  # nothing on the grid's side of zero: the range [0, 1]
        if symmetric and quant_min < 0:
            expected = 1 / np.float32((quant_max - quant_min) / 2)
        else:
            expected = 1 / np.float32(quant_max if symmetric else quant_max - quant_min)
    expected = max(expected, EPS)
    assert scale.shape == (1,) and zero_point.shape == (1,) and zero_point.dtype == torch.int32
    assert scale.item() == pytest.approx(expected, rel=1e-6)
    assert quant_min <= zero_point.item() <= quant_max
    if symmetric:
        assert zero_point.item() == 0
    # zero is exactly representable
    assert fake_quantize(torch.zeros(1), scale, zero_point, quant_min, quant_max).item() == 0.0


@given(x=arrays(np.float32, st.integers(1, 64), elements=finite), qrange=ranges, symmetric=st.booleans())
def test_fake_quant_grid_error_and_levels(x, qrange, symmetric):
    quant_min, quant_max = qrange
    t = torch.from_numpy(x)
    scale, zero_point = qparams_from_range(t.min(), t.max(), quant_min, quant_max, symmetric)
    out = fake_quantize(t, scale, zero_point, quant_min, quant_max).numpy()
    s, z = scale.item(), zero_point.item()
    np.testing.assert_array_equal(out, reference_fake_quant(x, s, z, quant_min, quant_max))
    # grid membership: out = (k - z) * s with an integer k in range
    k = np.round(out / np.float32(s)) + z
    assert np.all((k >= quant_min) & (k <= quant_max))
    np.testing.assert_allclose(out, ((k - z) * np.float32(s)).astype(np.float32), rtol=0, atol=0)
    # error bound inside the representable range
    low, high = (quant_min - z) * s, (quant_max - z) * s
    inside = (x >= low) & (x <= high)
    # s/2 plus the float32 rounding of the division and the multiplication at this magnitude
    bound = s / 2 + 2 * np.spacing(np.abs(x[inside])) + np.spacing(np.float32(s))
    assert np.all(np.abs(out[inside] - x[inside]) <= bound)
    assert len(np.unique(out)) <= 2 ** bits_of_range(quant_min, quant_max)


@given(x=arrays(np.float32, st.integers(1, 64), elements=finite), qrange=ranges)
def test_ste_mask(x, qrange):
    quant_min, quant_max = qrange
    t = torch.from_numpy(x).requires_grad_()
    scale, zero_point = torch.tensor([0.37]), torch.tensor([quant_min + 1], dtype=torch.int32)
    fake_quantize(t, scale, zero_point, quant_min, quant_max).backward(torch.ones_like(t))
    q = np.round(x / np.float32(0.37)) + quant_min + 1
    np.testing.assert_array_equal(t.grad.numpy(), ((q >= quant_min) & (q <= quant_max)).astype(np.float32))


@pytest.mark.parametrize("axis", [0, 1, 2, -1])
def test_per_channel_is_per_tensor_per_slice(axis):
    torch.manual_seed(0)
    x = torch.randn(3, 4, 5) * torch.arange(1, 6).float()
    channels = x.shape[axis]
    scale = torch.rand(channels) * 0.1 + 0.01
    zero_point = torch.randint(0, 20, (channels,), dtype=torch.int32)
    out = fake_quantize(x, scale, zero_point, 0, 255, ch_axis=axis)
    for c in range(channels):
        expected = fake_quantize(x.select(axis, c), scale[c : c + 1], zero_point[c : c + 1], 0, 255)
        torch.testing.assert_close(out.select(axis, c), expected, rtol=0, atol=0)


def test_broadcast_errors_name_the_problem():
    with pytest.raises(ValueError, match="ch_axis=3 is out of range for a 2-D tensor"):
        broadcast_to_axis(torch.ones(2), torch.ones(2, 2), 3)
    with pytest.raises(ValueError, match="3 channels but axis 0"):
        broadcast_to_axis(torch.ones(3), torch.ones(2, 2), 0)


def test_constant_and_zero_tensors_give_finite_positive_scale():
    for value in (0.0, 3.5, -2.0):
        scale, _ = qparams_from_range(torch.tensor(value), torch.tensor(value), -128, 127, True)
        assert torch.isfinite(scale).all() and (scale > 0).all()
        scale, zero_point = qparams_from_range(torch.tensor(value), torch.tensor(value), 0, 255, False)
        assert torch.isfinite(scale).all() and (scale > 0).all() and 0 <= zero_point.item() <= 255


def test_pot_scale_is_power_of_two():
    scale, _ = qparams_from_range(torch.tensor([-3.0, -0.1]), torch.tensor([1.0, 0.2]), -128, 127, True, pot_scale=True)
    assert torch.equal(torch.log2(scale), torch.round(torch.log2(scale)))


@settings(max_examples=50, deadline=None)
@given(x=arrays(np.float64, st.integers(2, 32), elements=st.floats(-3, 3)), zp=st.integers(0, 5))
def test_learnable_gradients_match_lsq_formula(x, zp):
    quant_min, quant_max, s_value, factor = 0, 15, 0.21, 0.5
    t = torch.from_numpy(x).float().requires_grad_()
    scale = torch.tensor([s_value], requires_grad=True)
    zero_point = torch.tensor([float(zp)], requires_grad=True)
    grad_out = torch.linspace(-1, 1, t.numel())
    learnable_fake_quantize(t, scale, zero_point, quant_min, quant_max, grad_factor=factor).backward(grad_out)
    v = t.detach().numpy() / np.float32(s_value)
    q = np.round(v) + zp
    below, above = q < quant_min, q > quant_max
    inside = ~(below | above)
    g = grad_out.numpy()
    d_scale = np.where(below, quant_min - zp, np.where(above, quant_max - zp, np.round(v) - v))
    d_zero = np.where(inside, 0.0, -s_value)
    np.testing.assert_allclose(t.grad.numpy(), g * inside, atol=0)
    np.testing.assert_allclose(scale.grad.item(), factor * np.sum(g * d_scale), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(zero_point.grad.item(), factor * np.sum(g * d_zero), rtol=1e-4, atol=1e-5)
