"""DSQFakeQuantize: hard forward, soft (tanh) gradients to x and alpha, eval mode, state."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mqbench.fake_quantize import DSQFakeQuantize, FakeQuantizeDict, FixedFakeQuantize
from mqbench.fake_quantize.dsq import soft_quantize
from onnx_helpers import reload

SCHEMES = {
    "int8_sym": dict(quant_min=-128, quant_max=127, qscheme=torch.per_tensor_symmetric),
    "int8_narrow": dict(quant_min=-127, quant_max=127, qscheme=torch.per_tensor_symmetric),
    "uint8_affine": dict(quant_min=0, quant_max=255, qscheme=torch.per_tensor_affine),
    "int4_affine": dict(quant_min=0, quant_max=15, qscheme=torch.per_tensor_affine),
    "int4_pc_sym": dict(quant_min=-8, quant_max=7, qscheme=torch.per_channel_symmetric, ch_axis=1),
}


def data(*shape, seed=0, scale=1.0, shift=0.2):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator) * scale + shift


def calibrated(kwargs, x, alpha=0.4):
    fq = DSQFakeQuantize(alpha=alpha, **kwargs)
    fq.disable_fake_quant()
    fq(x)
    fq.enable_fake_quant()
    fq.disable_observer()
    return fq


def reference_slopes(x, s, z, alpha, qmin, qmax):
    """The paper's soft quantizer, differentiated by hand (float64): d y/d x and d y/d alpha."""
    k = np.log(2 / alpha - 1)
    v = x / s + z
    inside = (v >= qmin) & (v <= qmax)
    v = np.clip(v, qmin, qmax)
    u = v - np.floor(v) - 0.5
    th = np.tanh(k * u)
    dy_dx = 0.5 * k * (1 - th**2) / (1 - alpha) * inside
    dk_dalpha = -2 / (alpha * (2 - alpha))
    dy_dalpha = s * 0.5 * ((1 - th**2) * u * dk_dalpha / (1 - alpha) + th / (1 - alpha) ** 2)
    return dy_dx, dy_dalpha


@pytest.mark.parametrize("name", SCHEMES)
def test_training_forward_is_hard_and_eval_is_fixed(name):
    kwargs = SCHEMES[name]
    calibration = data(8, 4, 5, seed=1)
    fq = calibrated(kwargs, calibration)
    fixed = FixedFakeQuantize(**kwargs)
    fixed(calibration)
    fixed.disable_observer()
    x = data(6, 4, 5, seed=2, scale=2.0)
    assert fq.training
    assert torch.equal(fq(x.requires_grad_()).detach(), fixed(x).detach())
    fq.eval()
    assert torch.equal(fq(x).detach(), fixed(x).detach())
    assert torch.equal(fq.scale, fixed.scale) and torch.equal(fq.zero_point, fixed.zero_point)


@pytest.mark.parametrize("name", ["int4_affine", "int8_narrow", "int4_pc_sym"])
def test_gradients_match_the_soft_quantizer(name):
    kwargs = SCHEMES[name]
    fq = calibrated(kwargs, data(8, 4, 5, seed=3), alpha=0.3)
    x = data(6, 4, 5, seed=4, scale=2.0).requires_grad_()
    upstream = data(6, 4, 5, seed=5, shift=0.0)
    fq(x).backward(upstream)

    s, z = fq.scale.double().numpy(), fq.zero_point.double().numpy()
    if fq.is_per_channel:
        s, z = s.reshape(1, -1, 1), z.reshape(1, -1, 1)
    dy_dx, dy_dalpha = reference_slopes(x.detach().double().numpy(), s, z, 0.3, fq.quant_min, fq.quant_max)
    g = upstream.double().numpy()
    np.testing.assert_allclose(x.grad.numpy(), g * dy_dx, rtol=1e-4, atol=1e-5)
    inside = dy_dx != 0
    assert fq.alpha.grad.item() == pytest.approx(float((g * dy_dalpha * inside).sum()), rel=1e-4, abs=1e-5)
    assert (x.grad[~torch.from_numpy(inside)] == 0).all()  # no gradient outside the grid


def test_gradcheck_of_the_soft_quantizer():
    generator = torch.Generator().manual_seed(6)
    x = (torch.rand(40, generator=generator, dtype=torch.float64) * 1.4 - 0.2).requires_grad_()
    alpha = torch.tensor([0.35], dtype=torch.float64, requires_grad=True)
    scale = torch.tensor([0.1], dtype=torch.float64)
    zero_point = torch.tensor([2], dtype=torch.int32)

    def function(x, alpha):
        return soft_quantize(x, scale, zero_point, alpha, 0, 15)

    assert torch.autograd.gradcheck(function, (x, alpha))
    # per-channel, along axis 0
    x2 = (torch.rand(3, 8, generator=generator, dtype=torch.float64) - 0.5).requires_grad_()
    scales = torch.tensor([0.05, 0.1, 0.2], dtype=torch.float64)

    def per_channel(x, alpha):
        return soft_quantize(x, scales, torch.zeros(3, dtype=torch.int32), alpha, -8, 7, ch_axis=0)

    assert torch.autograd.gradcheck(per_channel, (x2, alpha))


def test_soft_function_shape():
    scale, zero_point = torch.tensor([1.0], dtype=torch.float64), torch.tensor([0])
    v = torch.linspace(0, 5, 501, dtype=torch.float64)
    soft = soft_quantize(v, scale, zero_point, torch.tensor(0.4, dtype=torch.float64), 0, 15)
    integers = v == torch.round(v)
    assert torch.allclose(soft[integers], v[integers], atol=1e-12)  # meets the grid at integers
    assert (soft[1:] >= soft[:-1]).all()  # monotone
    # alpha -> 0: rounding; alpha -> 1: the identity
    sharp = soft_quantize(v, scale, zero_point, torch.tensor(1e-6, dtype=torch.float64), 0, 15)
    away = (v - torch.floor(v) - 0.5).abs() > 0.35  # k grows only like log(2 / alpha)
    assert torch.allclose(sharp[away], torch.round(v)[away], atol=1e-3)
    flat = soft_quantize(v, scale, zero_point, torch.tensor(1 - 1e-6, dtype=torch.float64), 0, 15)
    assert torch.allclose(flat, v, atol=1e-5)


def test_alpha_is_kept_in_the_open_unit_interval():
    fq = calibrated(SCHEMES["int4_affine"], data(100, seed=7))
    with torch.no_grad():
        fq.alpha.fill_(1.7)
    assert fq.effective_alpha().item() == pytest.approx(1 - 1e-4)
    x = data(100, seed=8).requires_grad_()
    fq(x).sum().backward()
    assert torch.isfinite(x.grad).all() and torch.isfinite(fq.alpha.grad).all()
    assert fq.alpha.grad.item() != 0.0  # can move back into range
    with pytest.raises(ValueError, match=r"alpha must lie in \(0, 1\)"):
        DSQFakeQuantize(alpha=1.0)


def test_no_grad_and_eval_use_the_fixed_path():
    fq = calibrated(SCHEMES["int8_sym"], data(100, seed=9))
    x = data(50, seed=10)
    with torch.no_grad():
        y = fq(x)
    fq.eval()
    assert torch.equal(y, fq(x))


@pytest.mark.parametrize("name", ["uint8_affine", "int4_pc_sym"])
def test_state_dict_loads_into_a_fresh_instance(name):
    kwargs = SCHEMES[name]
    fq = calibrated(kwargs, data(8, 4, 5, seed=11))
    with torch.no_grad():
        fq.alpha.fill_(0.25)
    fresh = DSQFakeQuantize(**kwargs)
    fresh.load_state_dict(reload(fq.state_dict()))
    x = data(5, 4, 5, seed=12, scale=2.0).requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    assert torch.equal(fresh(x), fq(x2))
    fresh(x).sum().backward()
    fq(x2).sum().backward()
    assert torch.equal(x.grad, x2.grad) and fresh.alpha.item() == 0.25


def test_registry():
    assert FakeQuantizeDict["DSQFakeQuantize"] is DSQFakeQuantize


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(["int8_sym", "int8_narrow", "uint8_affine", "int4_affine"]),
    values=st.lists(st.floats(-20, 20, width=32), min_size=1, max_size=64),
    calibration=st.floats(0.1, 10.0),
)
def test_grid_properties(name, values, calibration):
    fq = calibrated(SCHEMES[name], torch.tensor([-calibration / 3, calibration]))
    x = torch.tensor(values, requires_grad=True)
    y = fq(x).detach()
    s, z = fq.scale, fq.zero_point.float()
    k = torch.round(y / s) + z
    assert ((k >= fq.quant_min) & (k <= fq.quant_max)).all()
    assert torch.equal((k - z) * s, y)
    inside = (x >= (fq.quant_min - z) * s) & (x <= (fq.quant_max - z) * s)
    assert ((y - x).abs() <= s * 0.5 + 1e-6 * x.abs())[inside].all()
    assert len(torch.unique(y)) <= 2**fq.bitwidth
