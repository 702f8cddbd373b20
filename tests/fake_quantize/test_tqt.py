"""TqtFakeQuantize: power-of-two scale from a learned log2 threshold and TQT's gradient."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mqbench.fake_quantize import FakeQuantizeDict, TqtFakeQuantize
from onnx_helpers import reload

# scheme -> (kwargs, levels per threshold: 2**(bits-1) signed, 2**bits unsigned)
SCHEMES = {
    "int8_sym": (dict(quant_min=-128, quant_max=127, qscheme=torch.per_tensor_symmetric), 128),
    "int8_narrow": (dict(quant_min=-127, quant_max=127, qscheme=torch.per_tensor_symmetric), 128),
    "uint8_sym": (dict(quant_min=0, quant_max=255, qscheme=torch.per_tensor_symmetric), 256),
    "int4_sym": (dict(quant_min=-8, quant_max=7, qscheme=torch.per_tensor_symmetric), 8),
    "int8_pc": (dict(quant_min=-127, quant_max=127, qscheme=torch.per_channel_symmetric, ch_axis=1), 128),
    "int4_pc": (dict(quant_min=-8, quant_max=7, qscheme=torch.per_channel_symmetric, ch_axis=1), 8),
}


def data(*shape, seed=0, scale=1.0, shift=0.1):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator) * scale + shift


def calibrated(kwargs, x):
    fq = TqtFakeQuantize(**kwargs)
    fq.disable_fake_quant()
    fq(x)
    fq.enable_fake_quant()
    fq.disable_observer()
    return fq


def axis_of(kwargs):
    return kwargs.get("ch_axis") if kwargs["qscheme"] == torch.per_channel_symmetric else None


@pytest.mark.parametrize("name", SCHEMES)
def test_calibration_sets_log2_threshold_and_scale(name):
    kwargs, levels = SCHEMES[name]
    x = data(8, 4, 5, seed=1, scale=2.0)
    fq = calibrated(kwargs, x)
    axis = axis_of(kwargs)
    reduce = tuple(i for i in range(3) if i != axis) if axis is not None else None
    amax = np.abs(x.numpy()).max(axis=reduce)
    np.testing.assert_allclose(fq.log2_threshold.detach().numpy(), np.reshape(np.log2(amax), -1), rtol=1e-6)
    expected_scale = 2.0 ** np.ceil(np.log2(amax)) / levels
    np.testing.assert_array_equal(fq.scale.numpy(), np.reshape(expected_scale, -1).astype(np.float32))
    assert torch.equal(fq.zero_point, torch.zeros_like(fq.scale, dtype=torch.int32))
    assert fq.export_qparams()[0].equal(fq.scale)
    with pytest.raises(AttributeError):
        fq.scale = torch.ones(1)  # type: ignore[misc]


@pytest.mark.parametrize("name", SCHEMES)
def test_forward_and_gradients_match_tqt(name):
    kwargs, levels = SCHEMES[name]
    fq = calibrated(kwargs, data(8, 4, 5, seed=2))
    with torch.no_grad():
        fq.log2_threshold.sub_(0.7)  # a trained threshold that clips some values
    x = data(6, 4, 5, seed=3, scale=1.5).requires_grad_()
    upstream = data(6, 4, 5, seed=4, shift=0.0)
    y = fq(x)
    y.backward(upstream)

    axis = axis_of(kwargs)
    s = 2.0 ** np.ceil(fq.log2_threshold.detach().numpy()) / levels
    if axis is not None:
        s = s.reshape(1, -1, 1)
    xs, g = x.detach().numpy(), upstream.numpy()
    v = xs / s.astype(np.float32)
    q = np.round(v)
    qmin, qmax = fq.quant_min, fq.quant_max
    expected = (np.clip(q, qmin, qmax) * s).astype(np.float32)
    np.testing.assert_array_equal(y.detach().numpy(), expected)
    # d y / d log2_t = s ln2 (round(v) - v) inside, s ln2 quant_min below, s ln2 quant_max above
    local = np.where(q < qmin, qmin, np.where(q > qmax, qmax, q - v.astype(np.float64)))
    reduce = tuple(i for i in range(3) if i != axis) if axis is not None else None
    expected_grad = (g * s * math.log(2) * local).sum(axis=reduce)
    np.testing.assert_allclose(fq.log2_threshold.grad.numpy(), np.reshape(expected_grad, -1), rtol=1e-4, atol=1e-6)
    np.testing.assert_array_equal(x.grad.numpy(), g * ((q >= qmin) & (q <= qmax)))


def test_training_the_threshold():
    torch.manual_seed(0)
    x = torch.randn(2000)
    fq = TqtFakeQuantize(quant_min=-8, quant_max=7, qscheme=torch.per_tensor_symmetric)
    fq.disable_observer()
    with torch.no_grad():
        fq.log2_threshold.fill_(4.0)  # far too wide for N(0, 1) with 16 levels
    optimizer = torch.optim.Adam(fq.parameters(), lr=0.1)
    before = (fq(x) - x).square().mean().item()
    for _ in range(40):
        optimizer.zero_grad()
        (fq(x) - x).square().mean().backward()
        optimizer.step()
    assert fq.log2_threshold.item() < 3.0
    assert (fq(x) - x).square().mean().item() < 0.5 * before


def test_affine_schemes_are_rejected():
    with pytest.raises(ValueError, match="symmetric qscheme"):
        TqtFakeQuantize(quant_min=0, quant_max=255, qscheme=torch.per_tensor_affine)
    with pytest.raises(ValueError, match="symmetric qscheme"):
        TqtFakeQuantize(quant_min=0, quant_max=15, qscheme=torch.per_channel_affine, ch_axis=0)
    assert FakeQuantizeDict["TqtFakeQuantize"] is TqtFakeQuantize


@pytest.mark.parametrize("name", ["int8_sym", "int4_pc"])
def test_state_dict_loads_into_a_fresh_instance(name):
    kwargs, _ = SCHEMES[name]
    fq = calibrated(kwargs, data(8, 4, 5, seed=5))
    with torch.no_grad():
        fq.log2_threshold.add_(0.6)
    fresh = TqtFakeQuantize(**kwargs)
    fresh.load_state_dict(reload(fq.state_dict()))
    x = data(3, 4, 5, seed=6, scale=2.0)
    assert torch.equal(fresh(x), fq(x))
    assert torch.equal(fresh.scale, fq.scale)


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(["int8_sym", "int8_narrow", "uint8_sym", "int4_sym"]),
    values=st.lists(st.floats(-40, 40, width=32), min_size=1, max_size=64),
    log2_threshold=st.floats(-6.0, 6.0),
)
def test_grid_properties(name, values, log2_threshold):
    kwargs, _ = SCHEMES[name]
    fq = TqtFakeQuantize(**kwargs)
    fq.disable_observer()
    with torch.no_grad():
        fq.log2_threshold.fill_(log2_threshold)
    s = fq.scale
    assert torch.equal(torch.log2(s), torch.round(torch.log2(s)))  # a power of two
    x = torch.tensor(values)
    y = fq(x).detach()
    k = torch.round(y / s)
    assert ((k >= fq.quant_min) & (k <= fq.quant_max)).all()
    assert torch.equal(k * s, y)
    inside = (x >= fq.quant_min * s) & (x <= fq.quant_max * s)
    assert ((y - x).abs() <= s * 0.5 + 1e-6 * x.abs())[inside].all()
    assert len(torch.unique(y)) <= 2**fq.bitwidth
