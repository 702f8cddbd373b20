"""DoReFaFakeQuantize: tanh normalisation + fixed fake quantization, gradients, state."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mqbench.fake_quantize import DoReFaFakeQuantize, FakeQuantizeDict
from onnx_helpers import reload

SCHEMES = {
    "int8_sym": dict(quant_min=-128, quant_max=127, qscheme=torch.per_tensor_symmetric),
    "int8_narrow": dict(quant_min=-127, quant_max=127, qscheme=torch.per_tensor_symmetric),
    "uint8_affine": dict(quant_min=0, quant_max=255, qscheme=torch.per_tensor_affine),
    "int4_sym": dict(quant_min=-8, quant_max=7, qscheme=torch.per_tensor_symmetric),
    "int8_pc_narrow": dict(quant_min=-127, quant_max=127, qscheme=torch.per_channel_symmetric, ch_axis=0),
    "uint4_pc_affine": dict(quant_min=0, quant_max=15, qscheme=torch.per_channel_affine, ch_axis=0),
}


def weights(*shape, seed=0, scale=1.0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator) * scale


def np_normalize(w):
    t = np.tanh(w.astype(np.float64)).astype(np.float32)
    return t / np.abs(t).max()


def np_fake_quant(x, s, z, qmin, qmax):
    x, s, z = np.float32(x), np.float32(s), np.float32(z)
    q = np.clip(np.round(x / s) + z, qmin, qmax)
    return ((q - z) * s).astype(np.float32)


def np_qparams(w, qmin, qmax, symmetric, axis):
    """The observer's min/max qparams of the normalised weight, written out."""
    reduce = tuple(i for i in range(w.ndim) if i != axis) if axis is not None else None
    lo = np.minimum(w.min(axis=reduce), 0).astype(np.float32)
    hi = np.maximum(w.max(axis=reduce), 0).astype(np.float32)
    if symmetric:
        scale = np.maximum(-lo, hi) / np.float32((qmax - qmin) / 2) if qmin < 0 else hi / np.float32(qmax)
        return scale, np.zeros_like(scale)
    scale = (hi - lo) / np.float32(qmax - qmin)
    return scale, np.clip(qmin - np.round(lo / scale), qmin, qmax)


@pytest.mark.parametrize("name", SCHEMES)
def test_forward_matches_reference(name):
    kwargs = SCHEMES[name]
    fq = DoReFaFakeQuantize(**kwargs)
    w = weights(6, 3, 3, seed=1, scale=1.5)
    y = fq(w).numpy()  # observer and fake quant on: calibrates on w' and quantizes

    axis = 0 if "ch_axis" in kwargs else None
    normalized = np_normalize(w.numpy())
    np.testing.assert_allclose(fq.normalize(w).numpy(), normalized, rtol=1e-6, atol=0)
    symmetric = kwargs["qscheme"] in (torch.per_tensor_symmetric, torch.per_channel_symmetric)
    scale, zero_point = np_qparams(normalized, fq.quant_min, fq.quant_max, symmetric, axis)
    np.testing.assert_allclose(fq.scale.numpy(), np.reshape(scale, -1), rtol=1e-6)
    np.testing.assert_array_equal(fq.zero_point.numpy(), np.reshape(zero_point, -1))
    if axis is not None:
        scale, zero_point = scale.reshape(-1, 1, 1), zero_point.reshape(-1, 1, 1)
    expected = np_fake_quant(
        fq.normalize(w).numpy(), fq.scale.numpy().reshape(np.shape(scale)), zero_point, fq.quant_min, fq.quant_max
    )
    np.testing.assert_array_equal(y, expected)
    assert np.abs(y).max() <= 1.0 + fq.scale.max().item() / 2 + 1e-6  # an affine grid's rounded zero point


def test_observer_records_the_normalised_weight():
    fq = DoReFaFakeQuantize(quant_min=-127, quant_max=127, qscheme=torch.per_tensor_symmetric)
    w = weights(100, seed=2, scale=5.0)
    fq(w)
    observer = fq.activation_post_process
    assert max(-observer.min_val.item(), observer.max_val.item()) == 1.0
    assert fq.scale.item() == pytest.approx(1 / 127)


def test_gradient_through_the_normalisation():
    """Autograd through tanh(w) / max|tanh(w)| (including the max), straight through the rounding."""
    fq = DoReFaFakeQuantize(quant_min=-8, quant_max=7, qscheme=torch.per_tensor_symmetric)
    w = weights(50, seed=3, scale=1.2).double().requires_grad_()
    fq(w.detach())  # calibrate
    fq.disable_observer()
    upstream = weights(50, seed=4).double()
    fq(w).backward(upstream)

    x, g = w.detach().numpy(), upstream.numpy()
    t = np.tanh(x)
    j = np.argmax(np.abs(t))
    m = np.abs(t[j])
    normalized = t / m
    q = np.round(normalized / fq.scale.item())
    g_inside = g * ((q >= -8) & (q <= 7))  # the fixed quantizer's straight-through mask
    expected = g_inside * (1 - t**2) / m
    expected[j] += -np.sum(g_inside * t) / m**2 * np.sign(t[j]) * (1 - t[j] ** 2)
    np.testing.assert_allclose(w.grad.numpy(), expected, rtol=1e-10, atol=1e-12)


def test_gradcheck_of_the_normalisation():
    w = weights(12, seed=5).double().requires_grad_()
    assert torch.autograd.gradcheck(DoReFaFakeQuantize.normalize, (w,))


def test_disabled_fake_quant_is_the_identity():
    fq = DoReFaFakeQuantize(quant_min=0, quant_max=15)
    fq.disable_fake_quant()
    w = weights(20, seed=6, scale=3.0)
    assert torch.equal(fq(w), w)
    assert fq.activation_post_process.max_val.item() <= 1.0  # still observes w'
    fq.disable_observer()
    assert torch.equal(fq(w), w)


@pytest.mark.parametrize("name", ["uint8_affine", "int8_pc_narrow", "uint4_pc_affine"])
def test_state_dict_loads_into_a_fresh_instance(name):
    kwargs = SCHEMES[name]
    fq = DoReFaFakeQuantize(**kwargs)
    fq(weights(6, 3, 3, seed=7))
    fq.disable_observer()
    fresh = DoReFaFakeQuantize(**kwargs)
    fresh.load_state_dict(reload(fq.state_dict()))
    w = weights(6, 3, 3, seed=8, scale=2.0)
    assert torch.equal(fresh(w), fq(w))
    assert torch.equal(fresh.scale, fq.scale) and torch.equal(fresh.zero_point, fq.zero_point)


def test_registry():
    assert FakeQuantizeDict["DoReFaFakeQuantize"] is DoReFaFakeQuantize


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(["int8_sym", "int8_narrow", "uint8_affine", "int4_sym"]),
    values=st.lists(st.floats(-30, 30, width=32), min_size=2, max_size=64),
)
def test_grid_properties(name, values):
    fq = DoReFaFakeQuantize(**SCHEMES[name])
    w = torch.tensor(values)
    y = fq(w)
    s, z = fq.scale, fq.zero_point.float()
    k = torch.round(y / s) + z
    assert ((k >= fq.quant_min) & (k <= fq.quant_max)).all()
    assert torch.equal((k - z) * s, y)
    normalized = fq.normalize(w)
    # calibrated on w' itself, so every w' is in range: at most half a step away
    assert ((y - normalized).abs() <= s * 0.5 + 1e-6).all()
    assert len(torch.unique(y)) <= 2**fq.bitwidth
