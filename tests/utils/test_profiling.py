"""Per-layer profiling: MQBench's call, and the figures against the formula computed here."""

import math

import pytest
import torch
from torch import nn

from mqbench.advanced_ptq import calibrate
from mqbench.advanced_ptq.profiling import find_units, profile_layers, profiling
from mqbench.models import resnet18
from mqbench.prepare_by_platform import BackendType, prepare_by_platform
from mqbench.utils.state import enable_calibration, enable_quantization, quantizers


def calibrated(model, data, backend="tensorrt", config=None):
    return calibrate(prepare_by_platform(model.eval(), backend, config), data)


def sqnr_db(reference, other):
    reference, other = reference.double(), other.double()
    return 10 * math.log10(float(reference.pow(2).sum()) / float((reference - other).pow(2).sum()))


def test_mqbench_profiling_test_runs():
    """MQBench's own profiling test, with its ImageNet-sized ResNet-18 replaced by the project's at 64 px."""
    torch.manual_seed(0)
    extra_qconfig_dict = {
        "w_observer": "MinMaxObserver",
        "a_observer": "EMAMinMaxObserver",
        "w_fakequantize": "LearnableFakeQuantize",
        "a_fakequantize": "LearnableFakeQuantize",
    }
    prepare_custom_config_dict = {"extra_qconfig_dict": extra_qconfig_dict}
    model = prepare_by_platform(resnet18(num_classes=10), BackendType.Tensorrt, prepare_custom_config_dict)
    model.train()
    enable_calibration(model)
    model(torch.randn(1, 3, 64, 64))
    enable_quantization(model)
    model.eval()
    standalone = profiling(model, [torch.randn(1, 3, 64, 64) for _ in range(2)], "standalone")
    interaction = profiling(model, [torch.randn(1, 3, 64, 64) for _ in range(2)], "interaction")
    assert [r.name for r in standalone] == [r.name for r in interaction]
    assert {"conv1", "fc"} <= {r.name for r in standalone}
    assert all(0.0 < r.cosine <= 1.0 + 1e-9 for r in standalone + interaction)
    # the switches are as they were: every quantizer quantizes, no observer runs
    assert all(bool(q.fake_quant_enabled[0]) and not bool(q.observer_enabled[0]) for _, q in quantizers(model))


def test_figures_match_the_formula():
    """Weights alone, activations alone, both, and everything up to a layer, each recomputed by hand."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)).eval()
    data = [torch.randn(64, 16) for _ in range(3)]
    qmodel = calibrated(model, data)
    table = profile_layers(qmodel, data)
    units = {u.name: u for u in find_units(qmodel)}
    assert list(units) == ["input_1", "0", "2"]
    assert units["0"].weight == "0.weight_fake_quant" and len(units["0"].activations) == 1
    named = dict(qmodel.named_modules())

    def fq(name, x):  # the quantizer's own affine grid, written out
        q = named[name]
        scale, zero = q.export_qparams()
        shape = [-1] + [1] * (x.dim() - 1) if scale.numel() > 1 else [1]
        scale, zero = scale.reshape(shape), zero.reshape(shape).float()
        return (torch.clamp(torch.round(x / scale) + zero, q.quant_min, q.quant_max) - zero) * scale

    first, second = model[0], model[2]
    act_in, act_0 = "input_1_post_act_fake_quantizer", units["0"].activations[0]
    expected = {}
    with torch.no_grad():
        x = torch.cat(data)
        h = torch.relu(first(x))  # ReLU fused into the first layer
        w0 = fq("0.weight_fake_quant", first.weight)
        expected[("0", "standalone", "weight")] = sqnr_db(h, torch.relu(nn.functional.linear(x, w0, first.bias)))
        expected[("0", "standalone", "activation")] = sqnr_db(h, fq(act_0, h))
        both_0 = fq(act_0, torch.relu(nn.functional.linear(x, w0, first.bias)))
        expected[("0", "standalone", "both")] = sqnr_db(h, both_0)
        expected[("input_1", "standalone", "activation")] = sqnr_db(x, fq(act_in, x))
        upto_0 = fq(act_0, torch.relu(nn.functional.linear(fq(act_in, x), w0, first.bias)))
        expected[("0", "interaction", "both")] = sqnr_db(h, upto_0)
        y = second(h)
        w2 = fq("2.weight_fake_quant", second.weight)
        expected[("2", "standalone", "weight")] = sqnr_db(y, nn.functional.linear(h, w2, second.bias))
    got = {(r.name, r.mode, r.part): r.sqnr_db for r in table}
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, abs=1e-3), key
    # the last layer's interaction row is the fully quantized model
    with torch.no_grad():
        full = sqnr_db(model(x), qmodel(x))
    assert got[("2", "interaction", "both")] == pytest.approx(full, abs=1e-3)


def test_bad_input_is_named():
    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(TypeError, match="prepare_by_platform"):
        profiling(model, [torch.randn(2, 4)])
    qmodel = calibrated(model, [torch.randn(8, 4)])
    with pytest.raises(ValueError, match="standalone"):
        profiling(qmodel, [torch.randn(2, 4)], "sideways")
    with pytest.raises(ValueError, match="at least one batch"):
        profile_layers(qmodel, [])
