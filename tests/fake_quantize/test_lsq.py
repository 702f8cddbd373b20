"""LearnableFakeQuantize (LSQ / LSQ+): forward, gradients against the papers' formulas, state."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mqbench.fake_quantize import FakeQuantizeDict, LearnableFakeQuantize
from mqbench.observer import MinMaxObserver
from onnx_helpers import reload

PER_TENSOR = {
    "int8_sym": dict(quant_min=-128, quant_max=127, qscheme=torch.per_tensor_symmetric),
    "int8_narrow": dict(quant_min=-127, quant_max=127, qscheme=torch.per_tensor_symmetric),
    "uint8_affine": dict(quant_min=0, quant_max=255, qscheme=torch.per_tensor_affine),
    "int4_affine": dict(quant_min=-8, quant_max=7, qscheme=torch.per_tensor_affine),
}
PER_CHANNEL = {
    "int8_pc_sym": dict(quant_min=-127, quant_max=127, qscheme=torch.per_channel_symmetric, ch_axis=1),
    "uint4_pc_affine": dict(quant_min=0, quant_max=15, qscheme=torch.per_channel_affine, ch_axis=1),
}


def data(*shape, seed=0, scale=1.0, shift=0.3):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator) * scale + shift


def calibrated(kwargs, x, **extra):
    fq = LearnableFakeQuantize(MinMaxObserver, **extra, **kwargs)
    fq.disable_fake_quant()
    fq(x)
    fq.enable_fake_quant()
    fq.disable_observer()
    return fq


def np_fake_quant(x, s, z, qmin, qmax):
    """Reference: clamp(round_half_even(x / s) + z) then (q - z) * s, all in float32."""
    x, s, z = np.float32(x), np.float32(s), np.float32(z)
    q = np.clip(np.round(x / s) + z, qmin, qmax)
    return ((q - z) * s).astype(np.float32)


def channel_view(param, x, axis):
    shape = [1] * x.ndim
    shape[axis] = -1
    return np.asarray(param).reshape(shape)


def lsq_reference_grads(x, g, s, z, qmin, qmax, axis=None):
    """LSQ scale gradient and LSQ+ zero-point gradient (before grad scaling), float64 sums."""
    x, g = x.astype(np.float64), g.astype(np.float64)
    if axis is not None:
        s, z = channel_view(s, x, axis), channel_view(z, x, axis)
    v = x.astype(np.float32) / np.float32(s)
    q = np.round(v) + z
    below, above = q < qmin, q > qmax
    local_s = np.where(below, qmin - z, np.where(above, qmax - z, np.round(v) - v.astype(np.float64)))
    local_z = np.where(below | above, -s, 0.0)
    reduce = tuple(i for i in range(x.ndim) if i != axis) if axis is not None else None
    return (g * local_s).sum(axis=reduce), (g * local_z).sum(axis=reduce), ~(below | above)


@pytest.mark.parametrize("name", [*PER_TENSOR, *PER_CHANNEL])
def test_calibration_copies_the_observer_qparams(name):
    kwargs = {**PER_TENSOR, **PER_CHANNEL}[name]
    x = data(8, 4, 5, seed=1, scale=2.0)
    fq = calibrated(kwargs, x)
    observer = MinMaxObserver(**kwargs)
    observer(x)
    scale, zero_point = observer.calculate_qparams()
    assert isinstance(fq.scale, torch.nn.Parameter) and isinstance(fq.zero_point, torch.nn.Parameter)
    assert torch.equal(fq.scale.detach(), scale)
    assert torch.equal(fq.zero_point.detach(), zero_point.float())
    assert fq.scale.shape == ((4,) if "ch_axis" in kwargs else (1,))
    # observer off: the parameters are left to training
    with torch.no_grad():
        fq.scale.mul_(2)
    fq(x * 10)
    assert torch.equal(fq.scale.detach(), scale * 2)


@pytest.mark.parametrize("name", [*PER_TENSOR, *PER_CHANNEL])
def test_forward_matches_reference(name):
    kwargs = {**PER_TENSOR, **PER_CHANNEL}[name]
    fq = calibrated(kwargs, data(8, 4, 5, seed=2))
    with torch.no_grad():  # a learned, non-integer zero point acts as its rounded value
        fq.zero_point.add_(0.3 if not fq.symmetric else 0.0)
        fq.scale.mul_(1.1)
    x = data(6, 4, 5, seed=3, scale=2.5)
    axis = 1 if "ch_axis" in kwargs else None
    s = fq.scale.detach().numpy()
    z = np.round(fq.zero_point.detach().numpy())
    if axis is not None:
        s, z = channel_view(s, x.numpy(), axis), channel_view(z, x.numpy(), axis)
    expected = np_fake_quant(x.numpy(), s, z, fq.quant_min, fq.quant_max)
    np.testing.assert_array_equal(fq(x).detach().numpy(), expected)


@pytest.mark.parametrize("name", [*PER_TENSOR, *PER_CHANNEL])
@pytest.mark.parametrize("use_grad_scaling", [True, False])
def test_gradients_match_lsq_and_lsq_plus(name, use_grad_scaling):
    kwargs = {**PER_TENSOR, **PER_CHANNEL}[name]
    fq = calibrated(kwargs, data(8, 4, 5, seed=4), use_grad_scaling=use_grad_scaling)
    x = data(6, 4, 5, seed=5, scale=2.0).requires_grad_()
    upstream = data(6, 4, 5, seed=6, shift=0.0)
    fq(x).backward(upstream)

    axis = 1 if "ch_axis" in kwargs else None
    s, z = fq.scale.detach().numpy(), fq.zero_point.detach().numpy()
    grad_s, grad_z, inside = lsq_reference_grads(
        x.detach().numpy(), upstream.numpy(), s, z, fq.quant_min, fq.quant_max, axis
    )
    per_scale = x.numel() // (4 if axis is not None else 1)
    factor = 1.0 / math.sqrt(per_scale * fq.quant_max) if use_grad_scaling else 1.0
    np.testing.assert_allclose(fq.scale.grad.numpy(), np.reshape(grad_s * factor, -1), rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(x.grad.numpy(), upstream.numpy() * inside)
    if fq.symmetric:
        assert fq.zero_point.grad is None and not fq.zero_point.requires_grad
    else:
        np.testing.assert_allclose(fq.zero_point.grad.numpy(), np.reshape(grad_z * factor, -1), rtol=1e-4, atol=1e-5)


def test_grad_factor_formula():
    fq = LearnableFakeQuantize(quant_min=-8, quant_max=7, qscheme=torch.per_channel_symmetric, ch_axis=0)
    assert fq.grad_factor(torch.zeros(16, 3, 3, 3)) == pytest.approx(1 / math.sqrt(27 * 7))
    fq = LearnableFakeQuantize(quant_min=0, quant_max=255)
    assert fq.grad_factor(torch.zeros(2, 50)) == pytest.approx(1 / math.sqrt(100 * 255))
    assert LearnableFakeQuantize(use_grad_scaling=False).grad_factor(torch.zeros(9)) == 1.0


def test_scale_is_kept_positive_with_a_sane_gradient():
    fq = LearnableFakeQuantize(scale=0.1, quant_min=-127, quant_max=127, qscheme=torch.per_tensor_symmetric)
    fq.disable_observer()
    x = torch.tensor([0.25, -1.0, 30.0])
    with torch.no_grad():
        fq.scale.fill_(-0.1)  # a negative scale acts as its magnitude
    negative = fq(x)
    with torch.no_grad():
        fq.scale.fill_(0.1)
    assert torch.equal(negative, fq(x))
    with torch.no_grad():
        fq.scale.fill_(1e-12)  # floored at eps; the gradient still reaches the parameter
    y = fq(x)
    eps = torch.finfo(torch.float32).eps
    assert torch.equal(y, torch.tensor([127 * eps, -127 * eps, 127 * eps]))
    y.sum().backward()
    assert torch.isfinite(fq.scale.grad).all() and fq.scale.grad.item() != 0.0
    assert torch.equal(fq.export_qparams()[0], torch.tensor([eps]))


def test_zero_point_acts_as_a_clamped_integer():
    fq = LearnableFakeQuantize(scale=0.1, zero_point=2.6, quant_min=0, quant_max=15)
    fq.disable_observer()
    x = torch.tensor([0.0, 0.5, 1.2])
    assert torch.equal(fq(x), torch.tensor(np_fake_quant(x.numpy(), 0.1, 3.0, 0, 15)))
    with torch.no_grad():
        fq.zero_point.fill_(40.0)  # beyond quant_max: used as 15, still trainable
    y = fq(x)
    assert torch.equal(y, torch.tensor(np_fake_quant(x.numpy(), 0.1, 15.0, 0, 15)))
    y.sum().backward()
    assert fq.zero_point.grad.item() != 0.0
    _, zero_point = fq.export_qparams()
    assert zero_point.dtype == torch.int32 and zero_point.tolist() == [15]


def test_training_reduces_the_quantization_error():
    torch.manual_seed(0)
    x = torch.randn(512) * 2
    fq = calibrated(PER_TENSOR["int4_affine"], x)
    with torch.no_grad():
        fq.scale.mul_(3)  # a poor initial step size
    optimizer = torch.optim.Adam(fq.parameters(), lr=0.05)
    before = (fq(x) - x).square().mean().item()
    for _ in range(60):
        optimizer.zero_grad()
        (fq(x) - x).square().mean().backward()
        optimizer.step()
    assert (fq(x) - x).square().mean().item() < 0.5 * before


@pytest.mark.parametrize("name", ["uint8_affine", "int8_pc_sym", "uint4_pc_affine"])
def test_state_dict_loads_into_a_fresh_instance(name):
    kwargs = {**PER_TENSOR, **PER_CHANNEL}[name]
    fq = calibrated(kwargs, data(8, 4, 5, seed=7))
    with torch.no_grad():  # trained values, not just the observer's
        fq.scale.mul_(1.05)
        fq.zero_point.add_(0.0 if fq.symmetric else 1.0)
    fresh = LearnableFakeQuantize(MinMaxObserver, **kwargs)
    fresh.load_state_dict(reload(fq.state_dict()))
    x = data(5, 4, 5, seed=8, scale=3.0)
    assert torch.equal(fresh(x), fq(x))
    assert fresh.scale.requires_grad and fresh.zero_point.requires_grad == (not fq.symmetric)
    assert torch.equal(fresh.activation_post_process.min_val, fq.activation_post_process.min_val)


def test_argument_errors_and_registry():
    with pytest.raises(ValueError, match="scale must be positive"):
        LearnableFakeQuantize(scale=0.0)
    with pytest.raises(ValueError, match="zero point 0"):
        LearnableFakeQuantize(zero_point=3.0, qscheme=torch.per_tensor_symmetric, quant_min=-8, quant_max=7)
    assert FakeQuantizeDict["LearnableFakeQuantize"] is LearnableFakeQuantize


SCHEME_NAMES = st.sampled_from(sorted(PER_TENSOR))


@settings(max_examples=40, deadline=None)
@given(
    name=SCHEME_NAMES,
    values=st.lists(st.floats(-50, 50, width=32), min_size=1, max_size=64),
    scale=st.floats(1e-3, 2.0),
    zero_point=st.integers(-4, 20),
)
def test_grid_properties(name, values, scale, zero_point):
    kwargs = PER_TENSOR[name]
    symmetric = kwargs["qscheme"] == torch.per_tensor_symmetric
    zero_point = 0 if symmetric else min(max(zero_point, kwargs["quant_min"]), kwargs["quant_max"])
    fq = LearnableFakeQuantize(scale=scale, zero_point=float(zero_point), **kwargs)
    fq.disable_observer()
    x = torch.tensor(values, dtype=torch.float32)
    y = fq(x).detach()
    s = fq.scale.detach()
    qmin, qmax = fq.quant_min, fq.quant_max
    # every output is (k - z) * s for an integer k in [quant_min, quant_max]
    k = torch.round(y / s) + zero_point
    assert ((k >= qmin) & (k <= qmax)).all()
    assert torch.equal((k - zero_point) * s, y)
    # in range: at most half a step away
    inside = (x >= (qmin - zero_point) * s) & (x <= (qmax - zero_point) * s)
    assert ((y - x).abs() <= s * 0.5 + 1e-6 * x.abs())[inside].all()
    assert len(torch.unique(y)) <= 2**fq.bitwidth


def test_the_gradient_scale_counts_every_copy_of_a_data_parallel_batch():
    """With ``batch_replicas = k`` a batch of n rows gets LSQ's factor of a batch of k * n rows."""
    fq = LearnableFakeQuantize(quant_min=0, quant_max=15)
    local, global_batch = torch.zeros(8, 5), torch.zeros(16, 5)
    assert fq.grad_factor(local) == pytest.approx(1 / math.sqrt(40 * 15))
    fq.batch_replicas = 2
    assert fq.grad_factor(local) == pytest.approx(1 / math.sqrt(80 * 15))
    fq.batch_replicas = 1
    assert fq.grad_factor(global_batch) == pytest.approx(1 / math.sqrt(80 * 15))
