"""PyTorch's BackendConfig tutorial on mqbench: only the imports differ (and mqbench's module names).

The three experiments: (1) linear and conv-relu quantized, sigmoid float; (2) a conv-bn-relu
model on a backend that knows only conv-relu: only linear is quantized and the report names
the unmatched chain; (3) the default qconfig (eps below 2**-12): nothing is quantized and the
warning and the report name ``scale_min_lower_bound``.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import mqbench.nn.intrinsic as nni
from backend_config_tutorial import tutorial_objects
from mqbench.backend_config import (
    convert_fx,
    get_default_qconfig_mapping,
    prepare_fx,
    quantization_report,
)
from mqbench.fake_quantize import QuantizeBase
from mqbench.nn import quantized as nnq
from mqbench.utils.state import enable_quantization

# -- steps 2 to 5 of the tutorial (shared with the configuration tests) ----------------------------------
_tutorial = tutorial_objects()
backend_config, qconfig_mapping = _tutorial["backend"], _tutorial["mapping"]


class MyModel(torch.nn.Module):
    def __init__(self, use_bn: bool):
        super().__init__()
        self.linear = torch.nn.Linear(10, 3)
        self.conv = torch.nn.Conv2d(3, 3, 3)
        self.bn = torch.nn.BatchNorm2d(3)
        self.relu = torch.nn.ReLU()
        self.sigmoid = torch.nn.Sigmoid()
        self.use_bn = use_bn

    def forward(self, x):
        x = self.linear(x)
        x = self.conv(x)
        if self.use_bn:
            x = self.bn(x)
        x = self.relu(x)
        x = self.sigmoid(x)
        return x


example_inputs = (torch.rand(1, 3, 10, 10, dtype=torch.float),)


def calibrate(prepared: torch.nn.Module) -> None:
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _ in range(8):
            prepared(torch.rand(4, 3, 10, 10, generator=generator))


def report_rows(model: torch.nn.Module) -> dict[str, str]:
    return {line.split()[0]: line for line in quantization_report(model).splitlines()[1:-1]}


# -- step 6 and experiment 1 ------------------------------------------------------------------------------
def test_linear_and_conv_relu_are_quantized_and_sigmoid_stays_float():
    torch.manual_seed(0)
    model = MyModel(use_bn=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the sigmoid's "no pattern" note
        prepared = prepare_fx(model, qconfig_mapping, example_inputs, backend_config=backend_config)
    x = torch.rand(16, 3, 10, 10, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(prepared(x), model(x))  # prepared: observers only, outputs stay float
    calibrate(prepared)
    converted = convert_fx(prepared, backend_config=backend_config)
    assert type(converted.linear) is nnq.Linear
    assert type(converted.conv) is nnq.ConvReLU2d
    assert type(converted.sigmoid) is torch.nn.Sigmoid
    text = repr(converted)
    assert "scale=" in text and "zero_point=" in text
    assert not any(isinstance(m, QuantizeBase) for m in converted.modules())  # every quantizer absorbed
    rows = report_rows(converted)
    assert "quantized" in rows["linear"] and "quantized" in rows["conv"]
    assert "float" in rows["sigmoid"]
    with torch.no_grad():
        out, reference = converted(x), model(x)
        simulated = prepared_in_quantize_mode(prepared)(x)
    # Close to float: 7-bit activations (the tutorial's [0, 127]) and int8 weights.
    assert (out - reference).abs().max().item() < 0.02
    # The integer modules compute what the fake-quant simulation computes: the conv-relu output may
    # differ by 1 LSB at a rounding tie, which the sigmoid (slope <= 1/4) shrinks to a quarter.
    lsb = converted.conv.scale
    assert (out - simulated).abs().max().item() <= 0.25 * lsb + 1e-6
    assert (out == simulated).float().mean().item() >= 0.99


def prepared_in_quantize_mode(prepared: torch.nn.Module) -> torch.nn.Module:
    import copy

    simulated = copy.deepcopy(prepared).eval()
    enable_quantization(simulated)
    return simulated


# -- experiment 2: conv-bn-relu on a backend that only knows conv-relu --------------------------------------
def test_an_unmatched_conv_bn_relu_stays_float_and_the_report_names_it():
    torch.manual_seed(0)
    model = MyModel(use_bn=True).eval()
    with pytest.warns(UserWarning, match=r"no pattern of the backend matches Conv2d-BatchNorm2d-ReLU"):
        prepared = prepare_fx(model, qconfig_mapping, example_inputs, backend_config=backend_config)
    calibrate(prepared)
    converted = convert_fx(prepared, backend_config=backend_config)
    assert type(converted.linear) is nnq.Linear
    assert type(converted.conv) is torch.nn.Conv2d
    assert type(converted.bn) is torch.nn.BatchNorm2d
    assert type(converted.relu) is torch.nn.ReLU
    rows = report_rows(prepared)
    assert "quantized" in rows["linear"]
    assert "float" in rows["conv"] and "no pattern of the backend matches Conv2d-BatchNorm2d-ReLU" in rows["conv"]
    assert "part of the unmatched Conv2d-BatchNorm2d-ReLU" in rows["bn"]
    assert "part of the unmatched Conv2d-BatchNorm2d-ReLU" in rows["relu"]


# -- experiment 3: the default qconfig breaks the backend's scale_min_lower_bound ------------------------------
def test_the_default_qconfig_quantizes_nothing_and_names_scale_min_lower_bound():
    model = MyModel(use_bn=False)
    with pytest.warns(UserWarning, match="scale_min_lower_bound") as caught:
        prepared = prepare_fx(model, get_default_qconfig_mapping(), example_inputs, backend_config=backend_config)
    bound_warnings = [w for w in caught if "scale_min_lower_bound" in str(w.message)]
    assert len(bound_warnings) == 1  # once per reason, naming every node it applies to
    assert "linear" in str(bound_warnings[0].message) and "conv" in str(bound_warnings[0].message)
    assert not any(isinstance(m, QuantizeBase) for m in prepared.modules())
    calibrate(prepared)
    converted = convert_fx(prepared, backend_config=backend_config)
    assert type(converted.linear) is torch.nn.Linear
    assert type(converted.conv) is nni.ConvReLU2d  # fused (the qconfig is set), not quantized
    rows = report_rows(converted)
    assert "scale_min_lower_bound" in rows["linear"] and "scale_min_lower_bound" in rows["conv"]
    x = torch.rand(2, 3, 10, 10)
    with torch.no_grad():
        np.testing.assert_allclose(converted(x).numpy(), model(x).numpy(), rtol=1e-5, atol=1e-6)
