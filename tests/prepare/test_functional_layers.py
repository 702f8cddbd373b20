"""Functional convolutions and Linears on a model's own parameters are quantized like their modules."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from backend_configs import host_config
from mqbench.convert_deploy import convert_deploy
from mqbench.deploy.verify import verify_deploy
from mqbench.prepare_by_platform import prepare_by_platform
from mqbench.utils.state import disable_all, enable_calibration, enable_quantization


class Functional(nn.Module):
    """``F.conv2d`` with its own weight and bias (a grouped, dilated one), then ``F.linear`` with a weight only."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(6, 2, 3, 3) * 0.2)
        self.bias = nn.Parameter(torch.randn(6) * 0.1)
        self.proj = nn.Parameter(torch.randn(5, 6) * 0.3)

    def forward(self, x):
        y = F.relu(F.conv2d(x, self.weight, self.bias, padding=2, dilation=2, groups=2))
        return F.linear(y.mean((2, 3)), self.proj)


@pytest.mark.parametrize("backend", ["tensorrt", "onnx_qnn", "openvino", "vitis"])
def test_functional_layers_get_weight_quantizers_and_deploy(backend, tmp_path):
    torch.manual_seed(0)
    model = Functional().eval()
    x = torch.randn(2, 4, 8, 8)
    qmodel = prepare_by_platform(model, backend, host_config(backend))
    quantized = sorted(n for n, m in qmodel.named_modules() if n.endswith("weight_fake_quant"))
    assert len(quantized) == 2, quantized
    with torch.no_grad():
        expected = model(x)
        disable_all(qmodel)
        torch.testing.assert_close(qmodel(x), expected)  # with quantization off: the float model
    enable_calibration(qmodel)
    with torch.no_grad():
        for _ in range(3):
            qmodel(torch.randn(2, 4, 8, 8))
    enable_quantization(qmodel)
    result = convert_deploy(qmodel, backend, dummy_input=x, output_path=tmp_path)
    weights = [name for name, entry in result.table.items() if entry.kind == "weight"]
    assert len(weights) == 2, weights
    report = verify_deploy(qmodel, result, x, reference=True)
    assert report.passed, report.failures()
    # the deployed weights are on their grids: (q - z) * s with integer q
    initializers = {
        i.name: onnx.numpy_helper.to_array(i) for i in onnx.load(result.artifacts["deploy_onnx"]).graph.initializer
    }
    for name in weights:
        entry = result.table[name]
        scale = np.asarray(entry.scale, np.float64).reshape([-1] + [1] * (initializers[name].ndim - 1))
        steps = initializers[name] / scale
        np.testing.assert_allclose(steps, np.round(steps), atol=1e-3)
