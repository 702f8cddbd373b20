"""Deploy and verify, integer reference included, on graphs users write: every one runs and agrees, or says why not.

Each model goes through the public flow: prepare_by_platform -> calibration -> quantization ->
convert_deploy -> verify_deploy(..., reference=True).
"""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from backend_configs import host_config
from mqbench.convert_deploy import convert_deploy
from mqbench.deploy.qlinear import float_ops
from mqbench.deploy.reference import AccumulatorOverflowWarning
from mqbench.deploy.verify import verify_deploy
from mqbench.prepare_by_platform import prepare_by_platform
from mqbench.utils.state import enable_calibration, enable_quantization
from onnx_helpers import ort_session

SHAPE = (2, 4, 6, 6)


class GroupedDeconv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.deconv = nn.ConvTranspose2d(4, 4, 2, stride=2, groups=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.deconv(self.conv(x))


class ResizeToSize(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.head = nn.Conv2d(4, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.interpolate(self.conv(x), size=(12, 10)))


class ChunkReshape(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.conv(x).chunk(2, dim=1)
        n = x.shape[0]
        return a.reshape(n, -1) + b.reshape(n, -1)


class BiasedConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 8, 3, padding=1)
        self.fc = nn.Linear(8 * 6 * 6, 5)
        with torch.no_grad():
            self.conv.bias.fill_(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.conv(x)).flatten(1))


def deploy(model: nn.Module, backend: str, tmp_path, calibration: str = "randn"):
    torch.manual_seed(0)
    qmodel = prepare_by_platform(model.eval(), backend, host_config(backend))
    enable_calibration(qmodel)
    with torch.no_grad():
        for _ in range(3):
            qmodel(torch.randn(SHAPE) * (1e-7 if calibration == "tiny" else 1.0))
    enable_quantization(qmodel)
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ops left in float in the QLinear graph are named, not counted here
        result = convert_deploy(qmodel, backend, dummy_input=x, output_path=str(tmp_path))
    return qmodel, result, x


@pytest.mark.parametrize(
    ("model", "backend"),
    [(m, b) for m in (GroupedDeconv, ResizeToSize, ChunkReshape) for b in ("tensorrt", "onnx_qnn")],
)
def test_graph_deploys_and_every_artifact_agrees_with_the_simulation(model, backend, tmp_path):
    qmodel, result, x = deploy(model(), backend, tmp_path)
    report = verify_deploy(qmodel, result, x, reference=True)
    assert report.passed, report.failures()
    assert report.artifacts["reference"].max_lsb_diff <= report.tolerance
    assert report.artifacts["reference"].per_tensor  # the quantized tensors were compared, not skipped


@pytest.mark.parametrize("model", [ResizeToSize, ChunkReshape])
def test_qlinear_file_is_valid_and_all_integer(model, tmp_path):
    """The QLinear file passes strict type inference, runs on onnxruntime, and leaves no op in float."""
    _, result, x = deploy(model(), "onnx_qnn", tmp_path)
    qlinear = onnx.load(result.artifacts["qlinear_onnx"])
    onnx.shape_inference.infer_shapes(qlinear, check_type=True, strict_mode=True)
    (out,) = ort_session(qlinear, optimize=True).run(None, {result.input_names[0]: x.numpy()})
    assert out.shape == ((2, 4, 12, 10) if model is ResizeToSize else (2, 72))
    assert float_ops(qlinear) == []


@pytest.mark.parametrize("backend", ["vitis", "pplcuda"])
def test_int32_overflow_after_near_zero_calibration_is_a_failed_verdict_naming_node_and_cause(backend, tmp_path):
    """Calibration on values of about 1e-7 puts the input's scale at its floor: the bias on the accumulator scale
    needs more than 32 bits. Verify reports it (the reference saturates the int32 accumulator) and never raises.
    (All-zero calibration no longer does this: a range of zeros is taken as [0, 1].)"""
    qmodel, result, x = deploy(BiasedConvNet(), backend, tmp_path, calibration="tiny")
    input_scale = float(result.table[result.input_names[0]].scale[0])
    weight_scale = float(np.max(result.table["conv.weight"].scale))
    assert 0.5 / (input_scale * weight_scale) > 2**31  # the bias alone leaves the int32 range
    with pytest.warns(AccumulatorOverflowWarning, match=r"'/conv/Conv' \(Conv\).*near-zero inputs") as caught:
        report = verify_deploy(qmodel, result, x, reference=True)
    assert "int32" in str(caught[0].message)
    assert not report.passed
    failures = [line for line in report.failures() if line.startswith("reference:")]
    assert len(failures) == 1
    assert report.artifacts["reference"].max_lsb_diff > 10 * report.tolerance
    assert report.artifacts["reference"].first_divergence in failures[0]  # the tensor after the convolution
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", AccumulatorOverflowWarning)
        plain = verify_deploy(qmodel, result, x, predict=True)  # the saturation prediction runs the reference too
    assert "reference" not in plain.artifacts and plain.artifacts["onnx"].max_lsb_diff == 0
