"""benchmarks/deploy_speed.py: speed only from graphs that verify on this host (quick mode, tiny models)."""

import importlib
import json
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from mqbench.utils.host import host_facts

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def deploy_speed():
    sys.path.insert(0, str(BENCHMARKS))  # the script imports _timing from beside it
    try:
        return importlib.import_module("deploy_speed")
    finally:
        sys.path.remove(str(BENCHMARKS))


class ExpTail(nn.Module):
    """A float tail after the last quantized tensor: quantize_static leaves Exp's output unquantized."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.fc = nn.Linear(8 * 6 * 6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(0.5 * self.fc(torch.relu(self.conv(x)).flatten(1)))


def _export_exp_tail(path: Path, **kwargs) -> None:
    """ExpTail as a float ONNX model with a fixed input shape [1, 3, 8, 8]."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notes
        torch.onnx.export(ExpTail().eval(), (torch.zeros(1, 3, 8, 8),), str(path), dynamo=False, **kwargs)


def _check_rows(payload: dict) -> None:
    assert payload["host"] == host_facts()
    assert payload["host_description"].startswith("host: ")
    for row in payload["latency"] + payload["graphs"]:
        assert isinstance(row["verified"], bool)
    for row in payload["latency"]:
        if row["verified"]:
            assert row["speedup_vs_float"] is not None
            assert not row["check"].startswith("does not verify")
        else:
            assert row["speedup_vs_float"] is None
            assert row["vs_quantize_static"] is None
            assert row["check"].startswith("does not verify: ")
    if payload["host"]["int8_pairs_saturate"]:
        # a family (a deployment, or quantize_static) with a graph that does not verify is timed with 7-bit weights
        for row in payload["latency"]:
            if not row["verified"]:
                family = row["variant"].split(":")[0]
                twins = [r for r in payload["latency"] if r["variant"].split(":")[0] == f"{family} 7-bit"]
                assert twins
                assert all(r["verified"] for r in twins)


def test_model_quick(deploy_speed, tmp_path):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(20, 1, 8, 8, generator=generator).numpy()
    np.savez(tmp_path / "digits.npz", x=x, labels=np.arange(20) % 10)
    output = tmp_path / "speed.json"
    argv = ["--quick", "--model", "mqbench.models:DigitsCNN", "--input-shape", "1,1,8,8"]
    deploy_speed.main([*argv, "--data", str(tmp_path / "digits.npz"), "--output", str(output)])
    payload = json.loads(output.read_text())
    _check_rows(payload)
    variants = {row["variant"] for row in payload["latency"]}
    assert {"float", "mqbench QDQ: Q/DQ", "mqbench QDQ: QLinear", "mqbench ONNX_QNN", "ort quantize_static"} <= variants
    assert {row["batch"] for row in payload["latency"]} == {1, 8}
    assert payload["models"][0]["calibration_images"] == 8
    assert payload["models"][0]["evaluation_images"] == 12
    assert all(0.0 <= graph["top1"] <= 1.0 for graph in payload["graphs"])
    if payload["host"]["int8_pairs_saturate"]:
        # DigitsCNN's full-range int8 weights saturate here; the 7-bit QLinear graph verifies and has a speedup
        seven_bit = [row for row in payload["latency"] if row["variant"] == "mqbench QDQ 7-bit: QLinear"]
        assert seven_bit
        assert all(row["verified"] and row["speedup_vs_float"] > 0 for row in seven_bit)
        assert all(graph["reduce_range"] for graph in payload["graphs"] if "7-bit" in graph["variant"])


def test_onnx_quick(deploy_speed, tmp_path):
    torch.manual_seed(0)
    path = tmp_path / "exp_tail.onnx"
    _export_exp_tail(path, input_names=["image"])
    np.savez(tmp_path / "images.npz", x=torch.randn(12, 3, 8, 8, generator=torch.Generator().manual_seed(0)).numpy())
    output = tmp_path / "speed.json"
    deploy_speed.main(["--quick", "--onnx", str(path), "--data", str(tmp_path / "images.npz"), "--output", str(output)])
    payload = json.loads(output.read_text())
    _check_rows(payload)
    assert {row["batch"] for row in payload["latency"]} == {1}  # the model's batch is fixed
    assert {row["variant"] for row in payload["latency"]} >= {"float", "ort quantize_static"}
    assert not any(row["variant"].startswith("mqbench") for row in payload["latency"])
    assert all(graph["top1"] is None for graph in payload["graphs"])  # no labels
    if payload["host"]["int8_pairs_saturate"]:
        # random inputs drive the 3-channel convolution's int8 pair sums past int16 here
        assert [row["verified"] for row in payload["latency"] if row["variant"] == "ort quantize_static"] == [False]
        assert [row["verified"] for row in payload["latency"] if row["variant"] == "ort quantize_static 7-bit"] == [
            True
        ]
    for graph in payload["graphs"]:
        if graph["variant"].startswith("ort") and graph["verified"]:
            # Exp's output is float: checked against the bound one step of its last quantized tensor implies
            assert "relative bound" in graph["detail"]


def _bad_onnx(tmp_path: Path) -> list[str]:
    (tmp_path / "broken.onnx").write_text("not a model")
    return ["--onnx", str(tmp_path / "broken.onnx")]


def _wrong_onnx_shape(tmp_path: Path) -> list[str]:
    path = tmp_path / "fixed.onnx"
    _export_exp_tail(path)
    return ["--onnx", str(path), "--input-shape", "1,3,16,16"]


def _wrong_data_shape(tmp_path: Path) -> list[str]:
    np.savez(tmp_path / "data.npz", x=np.zeros((4, 3, 8, 8), np.float32))
    return ["--model", "mqbench.models:DigitsCNN", "--input-shape", "1,1,8,8", "--data", str(tmp_path / "data.npz")]


@pytest.mark.parametrize(
    ("make_argv", "message"),
    [
        (lambda _: ["--model", "no_such_package_xyz.models:make", "--input-shape", "1,3,8,8"], "cannot import"),
        (lambda _: ["--model", "mqbench.models:NoSuchNet", "--input-shape", "1,3,8,8"], "has no attribute"),
        (lambda _: ["--model", "mqbench.models", "--input-shape", "1,3,8,8"], "expected package.module:factory"),
        (lambda _: ["--model", "mqbench.models:DigitsCNN", "--input-shape", "1,3,8,8"], "does not take input"),
        (lambda _: ["--model", "mqbench.models:DigitsCNN", "--input-shape", "1,x"], "comma-separated integers"),
        (lambda _: ["--model", "mqbench.models:DigitsCNN"], "needs --input-shape"),
        (lambda t: ["--onnx", str(t / "missing.onnx")], "no such file"),
        (lambda t: ["--model", "mqbench.models:DigitsCNN", "--data", str(t / "missing.npz")], "no such file"),
        (_bad_onnx, "not an ONNX model"),
        (_wrong_onnx_shape, "has shape"),
        (_wrong_data_shape, "samples of shape"),
    ],
)
def test_bad_input_is_one_line_error(deploy_speed, tmp_path, capsys, make_argv, message):
    with pytest.raises(SystemExit) as exit_info:
        deploy_speed.main([*make_argv(tmp_path), "--output", str(tmp_path / "out.json")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("deploy_speed.py: error: ")
    assert message in err.strip().splitlines()[-1]
    assert not (tmp_path / "out.json").exists()
