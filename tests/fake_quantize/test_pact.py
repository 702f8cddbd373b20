"""PACTFakeQuantize: clipping, derived qparams, the PACT alpha gradient, state."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mqbench.fake_quantize import FakeQuantizeDict, PACTFakeQuantize
from onnx_helpers import reload

# scheme -> (kwargs, the reference scale and zero point for clipping level alpha)
SCHEMES = {
    "uint8_affine": (dict(quant_min=0, quant_max=255), lambda a: (a / 255, 0)),
    "uint8_unsigned_sym": (
        dict(quant_min=0, quant_max=255, qscheme=torch.per_tensor_symmetric),
        lambda a: (a / 255, 0),
    ),
    "int8_sym": (dict(quant_min=-128, quant_max=127, qscheme=torch.per_tensor_symmetric), lambda a: (a / 127.5, 0)),
    "int8_narrow": (dict(quant_min=-127, quant_max=127, qscheme=torch.per_tensor_symmetric), lambda a: (a / 127, 0)),
    # an odd number of steps on [-alpha, alpha]: the zero point is -8 - round(-7.5 +- rounding)
    "int4_signed_affine": (dict(quant_min=-8, quant_max=7), lambda a: (2 * a / 15, -8 - np.round(-a / (2 * a / 15)))),
    "uint4_affine": (dict(quant_min=0, quant_max=15), lambda a: (a / 15, 0)),
}


def data(*shape, seed=0, scale=3.0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator) * scale


def np_fake_quant(x, s, z, qmin, qmax):
    x, s, z = np.float32(x), np.float32(s), np.float32(z)
    q = np.clip(np.round(x / s) + z, qmin, qmax)
    return ((q - z) * s).astype(np.float32)


@pytest.mark.parametrize("name", SCHEMES)
def test_qparams_follow_alpha(name):
    kwargs, reference = SCHEMES[name]
    fq = PACTFakeQuantize(alpha=2.0, **kwargs)
    scale, zero_point = reference(np.float32(2.0))
    assert fq.scale.item() == pytest.approx(scale, rel=1e-6)
    assert fq.zero_point.tolist() == [int(zero_point)] and fq.zero_point.dtype == torch.int32
    with torch.no_grad():
        fq.alpha.fill_(3.0)
    assert fq.scale.item() == pytest.approx(reference(np.float32(3.0))[0], rel=1e-6)
    with pytest.raises(AttributeError):
        fq.scale = torch.ones(1)  # type: ignore[misc]


@pytest.mark.parametrize("name", SCHEMES)
def test_forward_and_gradients_match_pact(name):
    kwargs, reference = SCHEMES[name]
    alpha = 2.5
    fq = PACTFakeQuantize(alpha=alpha, **kwargs)
    x = data(400, seed=1).requires_grad_()
    upstream = data(400, seed=2, scale=1.0)
    y = fq(x)
    y.backward(upstream)

    xs, g = x.detach().numpy(), upstream.numpy()
    signed = fq.quant_min < 0
    lower = -alpha if signed else 0.0
    clipped = np.clip(xs, np.float32(lower), np.float32(alpha))
    scale, zero_point = reference(np.float32(alpha))
    np.testing.assert_array_equal(
        y.detach().numpy(), np_fake_quant(clipped, fq.scale.item(), zero_point, fq.quant_min, fq.quant_max)
    )
    assert fq.scale.item() == pytest.approx(scale, rel=1e-6)
    # d y / d alpha: 1 above alpha, -1 below -alpha (signed grids), 0 inside
    expected_alpha = g[xs >= alpha].sum() - (g[xs <= -alpha].sum() if signed else 0.0)
    assert fq.alpha.grad.item() == pytest.approx(expected_alpha, rel=1e-5, abs=1e-5)
    # d y / d x: 1 inside the clipping range, 0 outside (straight through the rounding)
    inside = (xs < alpha) & (xs > lower) if signed else (xs < alpha) & (xs >= 0)
    np.testing.assert_array_equal(x.grad.numpy(), g * inside)


def test_observer_only_records():
    fq = PACTFakeQuantize(alpha=1.5, quant_min=0, quant_max=255)
    x = data(100, seed=3)
    fq(x)
    assert fq.alpha.item() == 1.5
    assert fq.activation_post_process.max_val == x.max()
    fq.disable_fake_quant()
    assert torch.equal(fq(x), x)


def test_pot_scale_still_clips_at_alpha():
    fq = PACTFakeQuantize(alpha=3.0, quant_min=0, quant_max=255, qscheme=torch.per_tensor_symmetric, pot_scale=True)
    assert fq.scale.item() == 2.0**-6  # 3 / 255 rounded to a power of two in the log domain
    y = fq(torch.tensor([2.9, 3.5, 10.0]))
    assert y.tolist() == [2.90625, 3.0, 3.0]  # 255 * 2**-6 = 3.98 would not clip; alpha does


def test_training_moves_alpha():
    torch.manual_seed(0)
    x = torch.rand(1000) * 6
    fq = PACTFakeQuantize(alpha=4.0, quant_min=0, quant_max=15)
    fq.disable_observer()
    optimizer = torch.optim.SGD(fq.parameters(), lr=0.5)
    for _ in range(20):  # the values clipped at alpha pull it up
        optimizer.zero_grad()
        (fq(x) - x).square().mean().backward()
        optimizer.step()
    grown = fq.alpha.item()
    assert grown > 4.5
    for _ in range(20):  # PACT's L2 regularisation of alpha pulls it down
        optimizer.zero_grad()
        ((fq(x) - x).square().mean() + 0.5 * fq.alpha.square().sum()).backward()
        optimizer.step()
    assert fq.alpha.item() < grown - 0.5


def test_state_dict_loads_into_a_fresh_instance():
    fq = PACTFakeQuantize(alpha=2.0, quant_min=-128, quant_max=127, qscheme=torch.per_tensor_symmetric)
    fq(data(50, seed=4))
    fq.disable_observer()
    with torch.no_grad():
        fq.alpha.fill_(1.7)  # a trained value
    fresh = PACTFakeQuantize(quant_min=-128, quant_max=127, qscheme=torch.per_tensor_symmetric)
    fresh.load_state_dict(reload(fq.state_dict()))
    x = data(64, seed=5)
    assert fresh.alpha.item() == pytest.approx(1.7) and not bool(fresh.observer_enabled[0])
    assert torch.equal(fresh(x), fq(x))
    assert torch.equal(fresh.activation_post_process.max_val, fq.activation_post_process.max_val)


def test_argument_errors_and_registry():
    with pytest.raises(ValueError, match="one clipping level per tensor"):
        PACTFakeQuantize(qscheme=torch.per_channel_symmetric, quant_min=-8, quant_max=7, ch_axis=0)
    with pytest.raises(ValueError, match="alpha must be positive"):
        PACTFakeQuantize(alpha=0.0)
    assert FakeQuantizeDict["PACTFakeQuantize"] is PACTFakeQuantize


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(sorted(SCHEMES)),
    values=st.lists(st.floats(-20, 20, width=32), min_size=1, max_size=64),
    alpha=st.floats(0.05, 10.0),
)
def test_grid_properties(name, values, alpha):
    kwargs, _ = SCHEMES[name]
    fq = PACTFakeQuantize(alpha=alpha, **kwargs)
    fq.disable_observer()
    x = torch.tensor(values, dtype=torch.float32)
    y = fq(x).detach()
    s, z = fq.scale, fq.zero_point.float()
    k = torch.round(y / s) + z
    assert ((k >= fq.quant_min) & (k <= fq.quant_max)).all()
    assert torch.equal((k - z) * s, y)
    a = fq.alpha.detach()
    lower = -a if fq.quant_min < 0 else torch.zeros(1)
    inside = (x >= lower) & (x <= a)
    assert ((y - x).abs() <= s * 0.5 + 1e-6 * x.abs())[inside].all()
    assert (y <= a * (1 + 1e-6)).all() and (y >= lower * (1 + 1e-6) - s).all()
    assert len(torch.unique(y)) <= 2**fq.bitwidth
