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


def _calibrated_deployment(qmodel, backend, x, folder):
    """Calibrate on three random batches shaped like ``x``, quantize, deploy."""
    enable_calibration(qmodel)
    with torch.no_grad():
        for _ in range(3):
            qmodel(torch.randn_like(x))
    enable_quantization(qmodel)
    return convert_deploy(qmodel, backend, dummy_input=x, output_path=folder)


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
    result = _calibrated_deployment(qmodel, backend, x, tmp_path)
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


class NormAct(nn.BatchNorm2d):
    """A batch norm and its activation in one module that checks its input's rank (timm's ``BatchNormAct2d`` does
    this): traced, it is ``_assert(x.ndim == 4)`` and ``F.batch_norm`` on the module's own statistics."""

    def __init__(self, channels: int, act: bool = True) -> None:
        super().__init__(channels)
        self.act = nn.ReLU6() if act else nn.Identity()

    def forward(self, x):
        torch._assert(x.ndim == 4, "expected a 4-d input")
        x = F.batch_norm(
            x, self.running_mean, self.running_var, self.weight, self.bias, self.training, self.momentum, self.eps
        )
        return self.act(x)


class DepthwiseBlock(nn.Module):
    """stem -> NormAct -> depthwise -> NormAct -> pointwise -> NormAct (no activation) -> pooled Linear."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.stem, self.bn = nn.Conv2d(3, width, 3, 2, 1, bias=False), NormAct(width)
        self.dw, self.bn_dw = nn.Conv2d(width, width, 3, 1, 1, groups=width, bias=False), NormAct(width)
        self.pw, self.bn_pw = nn.Conv2d(width, width, 1, bias=False), NormAct(width, act=False)
        self.head = nn.Linear(width, 10)
        for norm in (self.bn, self.bn_dw, self.bn_pw):  # statistics that move the values (not an identity)
            with torch.no_grad():
                norm.running_mean.uniform_(-0.3, 0.3)
                norm.running_var.uniform_(0.5, 2.0)
                norm.weight.uniform_(0.5, 1.5)
                norm.bias.uniform_(-0.2, 0.2)

    def forward(self, x):
        y = self.bn_pw(self.pw(self.bn_dw(self.dw(self.bn(self.stem(x))))))
        return self.head(y.mean((2, 3)))


@pytest.mark.parametrize("backend", ["openvino", "tensorrt", "snpe"])
def test_functional_batch_norms_fold_into_their_convolutions(backend, tmp_path):
    """Each ``F.batch_norm`` on a module's own statistics folds into the convolution before it (the shape check
    between them no longer holds the convolution's output), as an ``nn.BatchNorm2d`` would; the deployment has no
    float batch norm left after an int8 convolution, and verifies."""
    torch.manual_seed(0)
    model = DepthwiseBlock().eval()
    x = torch.randn(2, 3, 32, 32)
    qmodel = prepare_by_platform(model, backend, host_config(backend))
    calls = {n.target for n in qmodel.graph.nodes if n.op == "call_function"}
    assert F.batch_norm not in calls and torch._assert not in calls
    with torch.no_grad():
        expected = model(x)
        disable_all(qmodel)
        torch.testing.assert_close(qmodel(x), expected, rtol=1e-4, atol=1e-5)  # folding changes float rounding only
    result = _calibrated_deployment(qmodel, backend, x, tmp_path)
    ops = {node.op_type for node in onnx.load(result.artifacts["onnx"]).graph.node}
    assert "BatchNormalization" not in ops, ops
    report = verify_deploy(qmodel, result, x, reference=True)
    assert report.passed, report.failures()


def test_a_functional_batch_norm_follows_the_models_mode():
    """Prepared for training, the batch norm uses the batch's statistics and updates the running ones, as the model
    does; after ``eval()`` it uses the running ones (the trace's constant ``training=True`` does not outlive the
    mode)."""
    torch.manual_seed(0)
    model = DepthwiseBlock().train()
    qmodel = prepare_by_platform(model, "tensorrt")  # a copy: the model and qmodel each update their own statistics
    disable_all(qmodel)
    norms = [m for m in qmodel.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert norms
    before = [m.running_mean.clone() for m in norms]
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(qmodel(x), model(x), rtol=1e-4, atol=1e-5)
    assert all(not torch.equal(m.running_mean, b) for m, b in zip(norms, before, strict=True))
    model.eval()
    qmodel.eval()
    y = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(qmodel(y), model(y), rtol=1e-4, atol=1e-5)


def test_only_assertions_on_shapes_are_dropped():
    """``_assert`` on a rank goes (nothing exports it, and it reads the layer's output); one on values stays."""
    from torch import fx

    from mqbench.custom_quantizer.passes import drop_shape_assertions

    class Checks(nn.Module):
        def forward(self, x):
            torch._assert(x.ndim == 4, "rank")
            torch._assert(x.shape[1] == 3, "channels")
            torch._assert(x.sum() > -1e9, "a value")
            return x + 1

    gm = drop_shape_assertions(fx.symbolic_trace(Checks()))
    kept = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch._assert]
    assert [n.args[1] for n in kept] == ["a value"]
    assert not any(n.op == "call_function" and n.target is getattr for n in gm.graph.nodes)  # the rank read is gone
    torch.testing.assert_close(gm(torch.zeros(1, 3, 2, 2)), torch.ones(1, 3, 2, 2))
