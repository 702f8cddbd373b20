"""A quantized attention that once ended the process in OpenVINO's ``compile_model``: the ``openvino_onnx`` file
compiles as a user compiles it, and a file the runtime crashes on fails verification (naming the signal) without
taking the caller's process with it.

The graph: two single-head attention branches on a ``[1, 4, 8]`` sequence; the second's output ``z`` feeds
``fc(z) - z``. OpenVINO 2026.4 segfaults compiling the file written without the writer's ``Max`` after each
attention output (:func:`mqbench.deploy.writers.openvino_layout._attention_outputs_kept`).
"""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

from backend_configs import host_config
from mqbench.convert_deploy import convert_deploy
from mqbench.deploy.verify import verify_deploy
from mqbench.deploy.writers import openvino_layout
from mqbench.prepare_by_platform import prepare_by_platform
from mqbench.utils.state import enable_calibration, enable_quantization

pytest.importorskip("openvino")


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).transpose(-2, -1) * 0.3536
        return torch.softmax(scores, dim=-1) @ self.v(x) + x


class TwoBranches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = Attention(), Attention()
        self.norm, self.head, self.fc, self.act = nn.LayerNorm(8), nn.Linear(8, 10), nn.Linear(8, 8), nn.Hardswish()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.softmax(self.head(self.norm(self.first(x))), dim=-1)
        z = self.second(x)
        return y, torch.softmax(torch.sigmoid(self.act(self.fc(z) - z)), dim=-1)


def _deployed(folder):
    torch.manual_seed(0)
    # on a CPU without VNNI, the documented remedy (7-bit weights and right operands of activation products), so
    # that the host's runtime serves the artifact's arithmetic: what is tested here is the compile and the rewrite
    qmodel = prepare_by_platform(TwoBranches().eval(), "openvino", prepare_custom_config_dict=host_config("openvino"))
    enable_calibration(qmodel)
    with torch.no_grad():
        for _ in range(4):
            qmodel(torch.randn(1, 4, 8))
    enable_quantization(qmodel)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = convert_deploy(qmodel, "openvino", {"x": [1, 4, 8]}, output_path=str(folder), model_name="m")
    return qmodel, result


def _compile_status(path) -> int:
    """The exit status of a fresh process that compiles the file as a user does (default configuration)."""
    code = f"import openvino as ov; ov.Core().compile_model({str(path)!r}, 'CPU')"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=300).returncode


def test_the_attention_graph_compiles_as_written_and_verifies(tmp_path):
    qmodel, result = _deployed(tmp_path)
    assert _compile_status(result.artifacts["openvino_onnx"]) == 0
    report = verify_deploy(qmodel, result, {"x": torch.randn(1, 4, 8)})
    assert report.passed, report.failures()


def test_a_file_the_runtime_crashes_on_fails_verify_naming_the_signal(tmp_path, monkeypatch):
    """The file written without the rewrite: where this host's OpenVINO crashes on it, verify (which runs the
    runtime in a child process) must fail naming the signal and say the file did not run, and this process lives
    on. Where this OpenVINO compiles it, there is no crash to contain."""
    monkeypatch.setattr(openvino_layout, "_attention_outputs_kept", lambda graph: None)
    qmodel, result = _deployed(tmp_path)
    status = _compile_status(result.artifacts["openvino_onnx"])
    if status == 0:
        pytest.skip("this host's OpenVINO compiles the file written without the rewrite: no crash to contain")
    assert status < 0, f"the compile ended with exit status {status}, not a signal"
    report = verify_deploy(qmodel, result, {"x": torch.randn(1, 4, 8)})
    assert not report.passed
    (line,) = [line for line in report.failures() if line.startswith("openvino_onnx")]
    assert f"signal {-status}" in line and "m_openvino.onnx" in line, line
    assert "did not run: " in report.summary()
