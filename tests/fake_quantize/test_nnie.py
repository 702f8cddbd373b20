"""NNIEFakeQuantize: NNIE's 8-bit log-domain grid, data_max tracking, STE gradient, state."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mqbench.fake_quantize import FakeQuantizeDict, NNIEFakeQuantize
from mqbench.fake_quantize.nnie import nnie_quantize
from onnx_helpers import reload


def np_nnie(x, data_max):
    """The NNIE formula, written out elementwise in float64."""
    x = np.asarray(x, dtype=np.float64)
    z = np.round(16 * np.log2(np.float64(data_max))) - 127
    out = np.zeros_like(x)
    for i, value in np.ndenumerate(x):
        if value == 0:
            continue
        n = np.round(16 * np.log2(abs(value)))
        if value > 0:
            k = min(max(n - z, 0), 127)
            out[i] = 0.0 if value < 2 ** ((z - 16) / 16) else 2 ** ((k + z) / 16)
        else:
            k = min(max(n - z, 1), 127)
            out[i] = 0.0 if -value < 2 ** ((z + 1 - 16) / 16) else -(2 ** ((k + z) / 16))
    return out.astype(np.float32)


def calibrated(x):
    fq = NNIEFakeQuantize()
    fq.disable_fake_quant()
    fq(x)
    fq.enable_fake_quant()
    fq.disable_observer()
    return fq


def log_uniform(n, seed, low=-12, high=6):
    generator = torch.Generator().manual_seed(seed)
    magnitude = torch.pow(2.0, torch.rand(n, generator=generator) * (high - low) + low)
    sign = torch.where(torch.rand(n, generator=generator) < 0.5, -1.0, 1.0)
    return magnitude * sign


@pytest.mark.parametrize("data_max", [8.0, 0.37, 1000.0, 1.0])
def test_forward_matches_reference(data_max):
    fq = calibrated(torch.tensor([-data_max, data_max / 2]))
    assert fq.data_max.item() == pytest.approx(data_max)
    x = log_uniform(3000, seed=1)
    x[:4] = torch.tensor([0.0, -0.0, data_max * 2, -data_max * 3])
    y = fq(x)
    np.testing.assert_array_equal(y.numpy(), np_nnie(x.numpy(), fq.data_max.item()))
    # the levels: 128 positive, 127 negative, and 0
    z = np.round(16 * np.log2(np.float64(fq.data_max.item()))) - 127
    positive = (2.0 ** ((np.arange(128) + z) / 16)).astype(np.float32)
    negative = -(2.0 ** ((np.arange(1, 128) + z) / 16)).astype(np.float32)
    assert set(np.unique(y.numpy())) <= {*positive, *negative, np.float32(0.0)}
    assert fq.scale.item() == pytest.approx(2 ** (z / 16), rel=1e-6)
    assert fq.zero_point.tolist() == [0]


def test_thresholds_and_clamping():
    fq = calibrated(torch.tensor([8.0]))  # z = 48 - 127 = -79
    z = -79
    smallest = 2 ** (z / 16)
    cases = {
        2 ** ((z - 16) / 16) * 1.0001: smallest,  # just above the positive threshold: the smallest level
        2 ** ((z - 16) / 16) * 0.9999: 0.0,  # just below: zero
        -(2 ** ((z - 15) / 16)) * 1.0001: -(2 ** ((z + 1) / 16)),  # negative: smallest is k = 1
        -(2 ** ((z - 15) / 16)) * 0.9999: 0.0,
        1000.0: 2 ** ((127 + z) / 16),  # clamped at k = 127
        -1000.0: -(2 ** ((127 + z) / 16)),
    }
    x = torch.tensor(list(cases), dtype=torch.float32)
    np.testing.assert_allclose(fq(x).numpy(), np.array(list(cases.values()), dtype=np.float32), rtol=1e-6)


def test_data_max_is_the_running_max_while_observing():
    fq = NNIEFakeQuantize()
    fq(torch.tensor([-3.0, 1.0]))
    fq(torch.tensor([2.0]))
    assert fq.data_max.tolist() == [3.0]
    fq(torch.tensor([5.0, -4.0]))
    assert fq.data_max.tolist() == [5.0]
    fq.disable_observer()
    fq(torch.tensor([50.0]))
    assert fq.data_max.tolist() == [5.0]


def test_straight_through_gradient():
    fq = calibrated(torch.tensor([4.0]))
    x = log_uniform(100, seed=2).requires_grad_()
    upstream = torch.randn(100, generator=torch.Generator().manual_seed(3))
    fq(x).backward(upstream)
    assert torch.equal(x.grad, upstream)


def test_float64_input():
    x = log_uniform(200, seed=4).double()
    y = nnie_quantize(x, torch.tensor([2.0]))
    assert y.dtype == torch.float64
    np.testing.assert_array_equal(y.numpy(), np_nnie(x.numpy(), 2.0).astype(np.float64))


def test_export_qparams_is_not_linear():
    with pytest.raises(NotImplementedError, match="logarithmic"):
        NNIEFakeQuantize().export_qparams()


def test_per_channel_is_rejected_and_registry():
    with pytest.raises(ValueError, match="per tensor"):
        NNIEFakeQuantize(qscheme=torch.per_channel_affine, ch_axis=0)
    assert FakeQuantizeDict["NNIEFakeQuantize"] is NNIEFakeQuantize


def test_state_dict_loads_into_a_fresh_instance():
    fq = calibrated(log_uniform(100, seed=5) * 3)
    fresh = NNIEFakeQuantize()
    fresh.load_state_dict(reload(fq.state_dict()))
    x = log_uniform(500, seed=6)
    assert torch.equal(fresh(x), fq(x))
    assert torch.equal(fresh.data_max, fq.data_max)


@settings(max_examples=50, deadline=None)
@given(
    values=st.lists(st.floats(-1e4, 1e4, width=32), min_size=1, max_size=64),
    data_max=st.floats(1e-3, 1e3),
)
def test_log_grid_properties(values, data_max):
    fq = calibrated(torch.tensor([data_max]))
    x = torch.tensor(values)
    y = fq(x)
    # monotone and sign-preserving
    order = torch.argsort(x)
    assert (y[order][1:] >= y[order][:-1]).all()
    assert ((y == 0) | (torch.sign(y) == torch.sign(x))).all()
    assert len(torch.unique(y)) <= 256
    # within half a level (a factor 2 ** (1/32)) in the log domain, inside the grid's range
    z = np.round(16 * np.log2(np.float64(fq.data_max.item()))) - 127
    low, high = 2 ** ((z + 1) / 16), 2 ** ((z + 127) / 16)
    inside = (x.abs() >= low) & (x.abs() <= high)
    ratio = (y[inside] / x[inside]).double()
    assert ((ratio >= 2 ** (-1 / 32) * (1 - 1e-6)) & (ratio <= 2 ** (1 / 32) * (1 + 1e-6))).all()
