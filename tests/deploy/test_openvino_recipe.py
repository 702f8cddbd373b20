"""OpenVINO's defaults that NNCF has too: per-channel inputs of depthwise convolutions, the mean-of-samples
activation ranges with bias correction, 7-bit weights after signed inputs on CPUs without VNNI, and 7-bit weights
written as the int8 FakeQuantize the CPU plugin runs in its integer kernels.

The measured effect on ImageNet MobileNetV2 against NNCF is benchmarks/peers/run.py's; here each part is checked
for what it must do, and the deployed file against the simulation on this host's OpenVINO.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper
from torch import nn

import mqbench.advanced_ptq.calibration as calibration_module
from backend_configs import host_config
from mqbench.advanced_ptq import calibrate
from mqbench.backends import ParamsTable
from mqbench.convert_deploy import convert_deploy
from mqbench.deploy.verify import verify_deploy
from mqbench.prepare_by_platform import prepare_by_platform


class Block(nn.Module):
    """conv -> ReLU -> depthwise conv -> ReLU -> 1x1 conv (signed output) -> 1x1 conv: an inverted residual's
    order, whose last layer reads a signed input."""

    def __init__(self) -> None:
        super().__init__()
        self.expand = nn.Conv2d(3, 8, 3, padding=1)
        self.depthwise = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.project = nn.Conv2d(8, 6, 1)
        self.head = nn.Conv2d(6, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.depthwise(torch.relu(self.expand(x))))
        return self.head(self.project(y))


def batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    # channels of very different ranges into the depthwise layer: per-channel scales matter there
    return [torch.randn(4, 3, 12, 12, generator=generator) * torch.tensor([0.2, 1.0, 3.0]).view(1, 3, 1, 1)] * 3


def prepared() -> nn.Module:
    torch.manual_seed(0)
    return prepare_by_platform(Block().eval(), "openvino", host_config("openvino"))


def input_quantizer(model: nn.Module, layer: str) -> nn.Module:
    """The activation quantizer the node calling ``layer`` reads."""
    modules = dict(model.named_modules())
    node = next(n for n in model.graph.nodes if n.op == "call_module" and n.target == layer)
    return modules[str(node.args[0].target)]


def test_the_backend_declares_the_defaults():
    spec = ParamsTable["openvino"]
    assert spec.placement.per_channel_depthwise_inputs
    recipe = spec.ptq_recipe
    assert (recipe.activation_observer, recipe.bias_correction, recipe.guard_pair_saturation) == (
        "MeanMinMaxObserver",
        True,
        True,
    )


def test_depthwise_inputs_per_channel_and_the_file_serves_the_simulation(tmp_path):
    model = prepared()
    calibrate(model, batches())
    depthwise_input = input_quantizer(model, "depthwise")
    assert depthwise_input.is_per_channel and depthwise_input.ch_axis == 1
    assert depthwise_input.scale.numel() == 8 and len(set(depthwise_input.scale.tolist())) > 1
    for layer in ("expand", "project", "head"):
        assert not input_quantizer(model, layer).is_per_channel, layer
    result = convert_deploy(model, "openvino", {"x": [2, 3, 12, 12]}, output_path=tmp_path, model_name="m")
    entries = [entry for entry in result.table.values() if entry.kind != "weight" and entry.axis is not None]
    assert len(entries) == 1 and entries[0].axis == 1 and np.asarray(entries[0].scale).size == 8
    x = torch.randn(2, 3, 12, 12, generator=torch.Generator().manual_seed(9))
    report = verify_deploy(model, result, x)
    assert report.passed, report.failures()
    host = report.artifacts["openvino_onnx"].host
    assert host is not None and host.max_lsb_diff <= 1, host.diverging(1)


@pytest.mark.parametrize("saturates", [True, False])
def test_guard_gives_7_bit_weights_after_signed_inputs_only_where_pairs_saturate(monkeypatch, saturates):
    monkeypatch.setattr(calibration_module, "int8_pairs_saturate", lambda: saturates)
    torch.manual_seed(0)
    model = prepare_by_platform(Block().eval(), "openvino")  # 8-bit weights as prepared
    calibrate(model, batches())
    ranges = {
        layer: (int(module.weight_fake_quant.quant_min), int(module.weight_fake_quant.quant_max))
        for layer in ("expand", "depthwise", "project", "head")
        for module in [dict(model.named_modules())[layer]]
    }
    # expand reads the network input and head the projection's output, both signed; the others read ReLU outputs
    signed = {"expand", "head"}
    for layer, grid in ranges.items():
        assert grid == ((-64, 63) if saturates and layer in signed else (-128, 127)), (layer, grid)
    modules = dict(model.named_modules())
    for layer, (low, high) in ranges.items():
        # the scales are computed for the grid the weights are on: each channel's widest weight spans half of it
        module = modules[layer]
        widest = module.weight.detach().abs().amax(dim=(1, 2, 3))
        scale = module.weight_fake_quant.scale.detach().reshape(-1)
        torch.testing.assert_close(widest / scale, torch.full_like(widest, (high - low) / 2), rtol=1e-5, atol=0)


def test_seven_bit_weights_are_written_as_int8_fake_quantize(tmp_path):
    torch.manual_seed(0)
    model = prepare_by_platform(Block().eval(), "openvino", {"reduce_range": True})
    calibrate(model, batches())
    result = convert_deploy(model, "openvino", {"x": [2, 3, 12, 12]}, output_path=tmp_path, model_name="m")
    graph = onnx.load(result.artifacts["openvino_onnx"]).graph
    values = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    weights = [
        n for n in graph.node if n.op_type == "FakeQuantize" and n.input[0] in values and values[n.input[0]].ndim == 4
    ]
    assert len(weights) == 4
    for node in weights:
        assert next(a.i for a in node.attribute if a.name == "levels") == 256
        low, high = values[node.input[1]], values[node.input[2]]
        step = (high - low) / 255
        np.testing.assert_allclose(low, -128 * step, rtol=1e-6)
        integers = values[node.input[0]] / step
        # every weight within the 7-bit grid's limits: the int8 kernel's pair sums fit 16 bits
        assert integers.min() >= -64 - 1e-3 and integers.max() <= 63 + 1e-3, node.input[0]
    x = torch.randn(2, 3, 12, 12, generator=torch.Generator().manual_seed(9))
    report = verify_deploy(model, result, x)
    assert report.passed, report.failures()
    host = report.artifacts["openvino_onnx"].host
    assert host is not None and host.max_lsb_diff <= 1, host.diverging(1)
