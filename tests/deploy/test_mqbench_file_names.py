"""Deployed file names (and, where they follow it, layouts) are MQBench's, for every built-in backend."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from backend_configs import config_for
from mqbench.backends import BackendType, ParamsTable, register_backend
from mqbench.convert_deploy import convert_deploy
from mqbench.deploy.context import DeployResult
from mqbench.prepare_by_platform import prepare_by_platform
from mqbench.qparams import TensorQParams
from mqbench.utils.state import enable_calibration, enable_quantization

MODEL = "tiny"
SHAPE = [1, 2, 6, 6]

# What every deployment holds, named as MQBench names them: the ONNX model with the quantization
# and the float model it is deployed from.
COMMON = {"onnx": ".onnx", "deploy_onnx": "_deploy_model.onnx"}

# Artifact key -> file name after the model name, as MQBench writes the backend's parameter file.
MQBENCH = {
    "tensorrt": {"clip_ranges": "_clip_ranges.json"},
    "snpe": {"encodings": "_clip_ranges.json"},
    "pplw8a16": {"ppl_json": "_clip_ranges.json"},
    "pplcuda": {"ppl_json": "_clip_ranges.json"},
    "vitis": {"vitis_json": "_clip_ranges.json"},
    "nnie": {"nnie_json": "_gfpq_param_dict.json"},
    "tengine_u8": {"tengine_scale": "_for_tengine.scale"},
    "stpu": {"stpu_json": "_stpu_minmax.json"},
}

# Files this project writes beyond MQBench's, under names of their own: TensorRT's calibration cache;
# TensorRT's clip ranges for the backends that share its layout; the OpenVINO FakeQuantize model and
# the QLinear model, which MQBench writes under the names that here are the float and Q/DQ models.
OWN = {
    "tensorrt": {"calib_cache": "_calib_cache.txt"},
    "tensorrt_nlp": {"clip_ranges": "_clip_ranges.json", "calib_cache": "_calib_cache.txt"},
    "academic": {"clip_ranges": "_clip_ranges.json"},
    "academic_nlp": {"clip_ranges": "_clip_ranges.json"},
    "openvino": {"openvino_onnx": "_openvino.onnx"},
    "onnx_qnn": {"qlinear_onnx": "_qlinear.onnx"},
    "qdq": {},
}

# Checkpoints of Hugging Face models (tests/deploy/test_compressed_tensors.py): not written for the model here.
HUGGING_FACE = {"tensorrt_nlp": {"compressed_tensors": "_compressed_tensors"}}

BACKENDS = sorted(set(MQBENCH) | set(OWN))


def tiny_model() -> nn.Module:
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 3, 3, padding=1)).eval()


def calibrated(backend: str) -> nn.Module:
    torch.manual_seed(0)
    config = config_for(backend)
    extra = {"prepare_custom_config_dict": config} if config else {}
    qmodel = prepare_by_platform(tiny_model(), backend, **extra)
    enable_calibration(qmodel)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _ in range(2):
            qmodel(torch.randn(4, *SHAPE[1:], generator=generator))
    enable_quantization(qmodel)
    return qmodel.eval()


@pytest.fixture(scope="module")
def deployed(tmp_path_factory):
    cache: dict[str, tuple[Path, DeployResult]] = {}

    def deploy(backend: str) -> tuple[Path, DeployResult]:
        if backend not in cache:
            folder = tmp_path_factory.mktemp(backend)
            result = convert_deploy(calibrated(backend), backend, {"x": SHAPE}, output_path=folder, model_name=MODEL)
            cache[backend] = (folder, result)
        return cache[backend]

    return deploy


def f32(value: float) -> float:
    return float(np.float32(value))


def per_entry(entry: TensorQParams, values: list[float]) -> float | list[float]:
    """A number per tensor, a list per channel (how the files write them)."""
    return values if entry.per_channel else values[0]


def range_images(entry: TensorQParams) -> tuple[list[float], list[float]]:
    """float32 ``(quant_min - zp) * scale`` and ``(quant_max - zp) * scale`` of every channel."""
    pairs = list(zip(entry.scale.tolist(), entry.zero_point.tolist(), strict=True))
    low = [f32((entry.quant_min - zp) * scale) for scale, zp in pairs]
    high = [f32((entry.quant_max - zp) * scale) for scale, zp in pairs]
    return low, high


def test_the_table_covers_every_built_in_backend():
    assert sorted(backend.value for backend in BackendType) == BACKENDS
    for backend in BACKENDS:
        listed = set(MQBENCH.get(backend, {})) | set(OWN.get(backend, {})) | set(HUGGING_FACE.get(backend, {}))
        assert listed == set(ParamsTable[backend].deploy), backend


@pytest.mark.parametrize("backend", BACKENDS)
def test_file_names(deployed, backend):
    folder, result = deployed(backend)
    expected = {**COMMON, **MQBENCH.get(backend, {}), **OWN.get(backend, {})}
    assert {key: Path(path).name for key, path in result.artifacts.items()} == {
        key: MODEL + suffix for key, suffix in expected.items()
    }
    assert sorted(p.name for p in folder.iterdir()) == sorted(MODEL + suffix for suffix in expected.values())


@pytest.mark.parametrize("backend", ["tensorrt", "tensorrt_nlp"])
def test_tensorrt_blob_range(deployed, backend):
    _, result = deployed(backend)
    data = json.loads(Path(result.artifacts["clip_ranges"]).read_text())
    assert set(data) == {"tensorrt", "qparams"} and set(data["tensorrt"]) == {"blob_range"}
    ranges = data["tensorrt"]["blob_range"]
    assert set(ranges) == set(result.table)
    for tensor, entry in result.table.items():
        # symmetric [-127, 127]: amax = 127 * scale
        assert ranges[tensor] == per_entry(entry, [f32(127 * s) for s in entry.scale.tolist()]), tensor


def test_snpe_encodings(deployed):
    _, result = deployed("snpe")
    data = json.loads(Path(result.artifacts["encodings"]).read_text())
    assert set(data) == {"activation_encodings", "param_encodings"}
    table = result.table
    assert set(data["activation_encodings"]) == set(table.activations())
    assert set(data["param_encodings"]) == set(table) - set(table.activations())
    for section in data.values():
        for tensor, encodings in section.items():
            entry = table[tensor]
            assert (entry.quant_min, entry.quant_max) == (0, 255)  # SNPE's full unsigned 8-bit range
            low, high = range_images(entry)
            assert [e["bitwidth"] for e in encodings] == [8] * len(low)
            assert [e["min"] for e in encodings] == low and [e["max"] for e in encodings] == high


@pytest.mark.parametrize("backend", ["pplw8a16", "pplcuda"])
def test_ppl_clip_ranges(deployed, backend):
    _, result = deployed(backend)
    data = json.loads(Path(result.artifacts["ppl_json"]).read_text())
    assert list(data) == ["ppl"] and set(data["ppl"]) == set(result.table)
    for tensor, values in data["ppl"].items():
        entry = result.table[tensor]
        assert {"step", "zero_point", "min", "max", "bit", "type"} <= set(values)
        assert values["type"] == "biased"
        assert values["step"] == per_entry(entry, [f32(s) for s in entry.scale.tolist()])
        assert values["zero_point"] == per_entry(entry, entry.zero_point.tolist())
        low, high = range_images(entry)
        assert values["min"] == per_entry(entry, low) and values["max"] == per_entry(entry, high)
        assert 2 ** values["bit"] == entry.quant_max - entry.quant_min + 1


def test_vitis_scales(deployed):
    _, result = deployed("vitis")
    data = json.loads(Path(result.artifacts["vitis_json"]).read_text())
    assert list(data) == ["vitis"] and set(data["vitis"]) == set(result.table)
    for tensor, values in data["vitis"].items():
        assert "scale" in values
        scales = values["scale"] if isinstance(values["scale"], list) else [values["scale"]]
        assert all(math.frexp(s)[0] == 0.5 for s in scales), (tensor, scales)  # powers of two
        assert scales == [f32(s) for s in result.table[tensor].scale.tolist()]


def test_nnie_gfpq_param_dict(deployed):
    _, result = deployed("nnie")
    data = json.loads(Path(result.artifacts["nnie_json"]).read_text())
    assert list(data) == ["nnie"] and list(data["nnie"]) == ["gfpq_param_dict"]
    params = data["nnie"]["gfpq_param_dict"]
    assert params == {tensor: f32(entry.data_max) for tensor, entry in result.table.items()}
    assert all(value > 0 for value in params.values())


def test_tengine_scale_lines(deployed):
    _, result = deployed("tengine_u8")
    lines = Path(result.artifacts["tengine_scale"]).read_text().splitlines()
    assert lines
    seen = {}
    for line in lines:
        name, scale, zero_point = line.split(" ")  # exactly three fields
        seen.setdefault(name, []).append((float(scale), int(zero_point)))
    assert set(seen) == set(result.table)
    for tensor, entry in result.table.items():
        pairs = list(zip(entry.scale.tolist(), entry.zero_point.tolist(), strict=True))
        assert seen[tensor] == [(f32(s), zp) for s, zp in pairs]


def test_two_artifacts_with_one_file_name_are_refused(tmp_path):
    """SNPE's overrides and TensorRT's clip ranges share MQBench's name: one deployment cannot hold both."""
    spec = dataclasses.replace(ParamsTable["tensorrt"], name="twofiles", deploy=("clip_ranges", "encodings"))
    register_backend("twofiles", spec)
    try:
        qmodel = prepare_by_platform(tiny_model(), "twofiles")
        enable_calibration(qmodel)
        with torch.no_grad():
            qmodel(torch.randn(SHAPE))
        enable_quantization(qmodel)
        folder = tmp_path / "out"
        with pytest.raises(ValueError, match=r"'clip_ranges' and 'encodings' are both written to tiny_clip_ranges"):
            convert_deploy(qmodel, "twofiles", {"x": SHAPE}, output_path=folder, model_name=MODEL)
        assert not folder.exists()  # nothing left behind
    finally:
        ParamsTable.unregister("twofiles")
