"""AdaRound's rounding variable and regulariser, QDrop's drop probability, the b schedule: hand-computed cases."""

from __future__ import annotations

import math

import pytest
import torch

from mqbench.advanced_ptq import LinearTempDecay
from mqbench.fake_quantize import AdaRoundFakeQuantize, FakeQuantizeDict, QDropFakeQuantize

ZETA, GAMMA = 1.1, -0.1


def rectified_sigmoid(alpha: float) -> float:
    return min(1.0, max(0.0, (ZETA - GAMMA) / (1 + math.exp(-alpha)) + GAMMA))


def calibrated_adaround(weight: torch.Tensor, **kwargs) -> AdaRoundFakeQuantize:
    fq = AdaRoundFakeQuantize(**{"quant_min": -8, "quant_max": 7, "qscheme": torch.per_tensor_symmetric, **kwargs})
    fq(weight)
    fq.disable_observer()
    return fq


def test_both_quantizers_are_registered_by_name():
    assert FakeQuantizeDict["AdaRoundFakeQuantize"] is AdaRoundFakeQuantize
    assert FakeQuantizeDict["QDropFakeQuantize"] is QDropFakeQuantize


def test_the_rounding_variable_starts_at_the_fractional_part():
    """alpha = -log((zeta - gamma) / (frac - gamma) - 1): h(alpha) is frac, so the soft weight is w itself."""
    weight = torch.tensor([0.26, -0.74, 0.5, 0.1])
    fq = calibrated_adaround(weight)
    scale = 0.74 / 7.5  # MinMax, symmetric [-8, 7]: max|w| / ((qmax - qmin) / 2)
    assert float(fq.scale) == pytest.approx(scale, rel=1e-6)
    fq.init(weight, "learned_hard_sigmoid")
    for w, alpha in zip(weight.tolist(), fq.alpha.tolist(), strict=True):
        frac = w / scale - math.floor(w / scale)
        assert alpha == pytest.approx(-math.log((ZETA - GAMMA) / (frac - GAMMA) - 1), rel=1e-4, abs=1e-5)
        assert rectified_sigmoid(alpha) == pytest.approx(frac, abs=1e-5)
    assert torch.allclose(fq(weight), weight, atol=1e-6)  # soft targets reproduce the float weight


def test_hard_rounding_goes_up_where_alpha_is_not_negative():
    weight = torch.tensor([0.26, -0.74, 0.5, 0.1])
    fq = calibrated_adaround(weight)
    fq.init(weight, "learned_hard_sigmoid")
    with torch.no_grad():
        fq.alpha.copy_(torch.tensor([-3.0, 0.0, 2.0, -0.01]))
    scale = float(fq.scale)
    expected = [(math.floor(w / scale) + up) * scale for w, up in zip(weight.tolist(), [0, 1, 1, 0], strict=True)]
    assert fq.get_hard_value(weight).tolist() == pytest.approx(expected, abs=1e-7)
    fq.soft_targets = False
    assert fq(weight).tolist() == pytest.approx(expected, abs=1e-7)
    hard = fq.get_hard_value(weight)
    fq.finish()  # round to nearest again: the hard values are grid points, so nothing moves
    assert torch.equal(fq(hard), hard)


def test_the_regulariser_is_one_minus_the_distance_to_a_hard_value():
    weight = torch.tensor([0.26, -0.74, 0.5])
    fq = calibrated_adaround(weight)
    fq.init(weight, "learned_hard_sigmoid")
    alphas = [-1.0, 0.3, 10.0]
    with torch.no_grad():
        fq.alpha.copy_(torch.tensor(alphas))
    for b in (20.0, 2.0):
        expected = sum(1 - abs(2 * rectified_sigmoid(a) - 1) ** b for a in alphas)
        assert float(fq.rounding_loss(b).detach()) == pytest.approx(expected, rel=1e-5)
    with torch.no_grad():  # every h at 0 or 1: no penalty
        fq.alpha.copy_(torch.tensor([-20.0, 20.0, 20.0]))
    assert float(fq.rounding_loss(2.0).detach()) == 0.0


def test_per_channel_rounding_uses_each_channels_scale():
    torch.manual_seed(0)
    weight = torch.randn(3, 4) * torch.tensor([[0.1], [1.0], [5.0]])
    fq = AdaRoundFakeQuantize(quant_min=-8, quant_max=7, qscheme=torch.per_channel_symmetric, ch_axis=0)
    fq(weight)
    fq.disable_observer()
    fq.init(weight, "learned_hard_sigmoid")
    scale = fq.scale.reshape(3, 1)
    up = weight / scale - torch.floor(weight / scale) >= 0.5
    half_up = torch.clamp(torch.floor(weight / scale) + up, -8, 7) * scale  # round half up, channel by channel
    with torch.no_grad():  # alpha >= 0 exactly where the fractional part is at least a half
        fq.alpha.copy_(torch.where(up, 1.0, -1.0))
    assert torch.allclose(fq.get_hard_value(weight), half_up, atol=1e-6)


def test_the_exponent_stays_then_falls_linearly():
    decay = LinearTempDecay(t_max=100, rel_start_decay=0.2, start_b=20, end_b=2)
    assert [decay(t) for t in (0, 10, 19)] == [20, 20, 20]
    assert decay(20) == pytest.approx(20)
    assert decay(60) == pytest.approx(2 + 18 * (1 - 40 / 80))
    assert decay(100) == pytest.approx(2)


def test_qdrop_keeps_each_element_quantized_with_probability_prob():
    fq = QDropFakeQuantize(quant_min=0, quant_max=15)
    fq(torch.linspace(0, 1.5, 16))
    fq.disable_observer()
    x = torch.full((20000,), 0.33)  # not on the grid: quantized and float elements differ
    quantized = float(torch.round(torch.tensor(0.33) / fq.scale.detach()) * fq.scale.detach())
    torch.manual_seed(0)
    for prob in (1.0, 0.5, 0.2):
        fq.prob = prob
        y = fq(x)
        kept = (y == quantized).float().mean().item()
        assert torch.all((y == quantized) | (y == x))  # each element: its quantized or its float value
        assert kept == pytest.approx(prob, abs=0.015)  # binomial: 3 standard deviations at n = 20000 is < 0.011
    with pytest.raises(ValueError, match=r"probability of quantizing an element, in \[0, 1\]"):
        fq.prob = 1.5


def test_qdrop_learns_its_scale_without_lsq_gradient_scaling():
    fq = QDropFakeQuantize(quant_min=0, quant_max=15)
    fq(torch.linspace(0, 1.5, 16))
    fq.disable_observer()
    fq(torch.tensor([0.33])).sum().backward()
    v = 0.33 / float(fq.scale)
    assert float(fq.scale.grad) == pytest.approx(round(v) - v, rel=1e-4)  # LSQ's d/ds inside the grid, factor 1


def test_the_qscheme_key_p_is_the_mse_observers_norm():
    from mqbench.prepare_by_platform import prepare_by_platform

    scheme = {"bit": 4, "symmetry": False, "per_channel": False, "pot_scale": False, "p": 2.4}
    config = {
        "extra_qconfig_dict": {
            "w_observer": "MSEObserver",
            "a_observer": "EMAMSEObserver",
            "w_fakequantize": "AdaRoundFakeQuantize",
            "a_fakequantize": "QDropFakeQuantize",
            "w_qscheme": {**scheme, "per_channel": True},
            "a_qscheme": scheme,
        }
    }
    qmodel = prepare_by_platform(torch.nn.Sequential(torch.nn.Linear(4, 4)).eval(), "academic", config)
    observers = [m.activation_post_process for m in qmodel.modules() if hasattr(m, "activation_post_process")]
    assert observers and all(observer.p == 2.4 for observer in observers)
    minmax = {"extra_qconfig_dict": {"w_qscheme": {"p": 2.4}}}
    with pytest.raises(ValueError, match=r"'p' is an argument of the observer, and MinMaxObserver takes none"):
        prepare_by_platform(torch.nn.Sequential(torch.nn.Linear(4, 4)).eval(), "tensorrt", minmax)
