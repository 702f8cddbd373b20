"""verify_deploy says how far the simulation is from the float model, and warns when it is far."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

from mqbench.convert_deploy import convert_deploy
from mqbench.deploy.fidelity import FAR_SQNR_DB, simulation_fidelity
from mqbench.deploy.verify import verify_deploy
from mqbench.prepare_by_platform import prepare_by_platform
from mqbench.utils.state import enable_calibration, enable_quantization


class Net(nn.Module):
    """Academic keeps the first and the last layer at 8 bits: the middle one takes the tested width."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.middle = nn.Conv2d(8, 8, 3, padding=1)
        self.relu = nn.ReLU()
        self.fc = nn.Linear(8 * 8 * 8, 4)

    def forward(self, x):
        return self.fc(self.relu(self.middle(self.relu(self.conv(x)))).flatten(1))


def calibrated(bits: int) -> tuple[nn.Module, nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = Net().eval()
    scheme = {"bit": bits, "symmetry": True, "per_channel": False}
    config = {
        "extra_qconfig_dict": {
            "w_qscheme": scheme,
            "a_qscheme": {**scheme, "bit": 8},
            "w_observer": "MinMaxObserver",
            "a_observer": "MinMaxObserver",
            "w_fakequantize": "FixedFakeQuantize",
            "a_fakequantize": "FixedFakeQuantize",
        }
    }
    qmodel = prepare_by_platform(model, "academic", config)
    x = torch.randn(32, 3, 8, 8)
    enable_calibration(qmodel)
    with torch.no_grad():
        qmodel(x)
    enable_quantization(qmodel)
    return model, qmodel, x


def sqnr_db(reference: torch.Tensor, value: torch.Tensor) -> float:
    f, q = reference.double(), value.double()
    return 10 * math.log10(float((f * f).sum()) / float(((f - q) ** 2).sum()))


def test_the_output_fidelity_is_the_formula_on_the_float_model():
    model, qmodel, x = calibrated(8)
    fidelity = simulation_fidelity(qmodel, lambda m: m(x))
    with torch.no_grad():
        expected = sqnr_db(model(x), qmodel(x))
    assert fidelity.outputs[0].sqnr_db == pytest.approx(expected, rel=1e-9)
    assert not fidelity.far and fidelity.warning() is None
    # each quantizer's own error: the weight quantizer of fc against the formula on its weight
    fc_weight = next(q for q in fidelity.quantizers if q.name == "fc.weight_fake_quant")
    quantizer = qmodel.fc.weight_fake_quant
    with torch.no_grad():
        assert fc_weight.sqnr_db == pytest.approx(sqnr_db(qmodel.fc.weight, quantizer(qmodel.fc.weight)), rel=1e-9)
    assert [q.sqnr_db for q in fidelity.quantizers] == sorted(q.sqnr_db for q in fidelity.quantizers)


def test_a_simulation_far_from_float_passes_verify_and_warns_naming_the_worst_quantizer(tmp_path):
    model, qmodel, x = calibrated(2)
    result = convert_deploy(qmodel, "academic", {"x": [1, 3, 8, 8]}, output_path=tmp_path)
    with pytest.warns(UserWarning, match="far from the float model") as caught:
        report = verify_deploy(qmodel, result, x[:1])
    assert report.passed  # the files compute the simulation ...
    fidelity = report.fidelity
    assert fidelity is not None and fidelity.far  # ... which is far from float
    with torch.no_grad():
        assert fidelity.outputs[0].sqnr_db == pytest.approx(sqnr_db(model(x[:1]), qmodel(x[:1])), rel=1e-9)
    assert fidelity.outputs[0].sqnr_db < FAR_SQNR_DB
    worst = fidelity.worst(1)[0]
    assert worst.name == "middle.weight_fake_quant"  # the 2-bit weights
    message = str(caught[0].message)
    assert worst.name in message and "cross_layer_equalization" in message and "exclude_node_name" in message
    assert "WARNING" in report.summary() and "simulation vs float model" in report.summary()


def test_a_close_simulation_does_not_warn_and_the_check_can_be_skipped(tmp_path):
    _, qmodel, x = calibrated(8)
    result = convert_deploy(qmodel, "academic", {"x": [1, 3, 8, 8]}, output_path=tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning of any kind
        report = verify_deploy(qmodel, result, x[:1])
    assert report.fidelity is not None and not report.fidelity.far
    assert verify_deploy(qmodel, result, x[:1], fidelity=False).fidelity is None
    # the switches are as they were: the quantizers still quantize, the observers stay off
    assert all(
        bool(m.fake_quant_enabled[0]) and not bool(m.observer_enabled[0])
        for m in qmodel.modules()
        if hasattr(m, "fake_quant_enabled")
    )
