"""`mqbench bench --config`: the backends x methods x models matrix, each cell an ordinary run folder."""

from __future__ import annotations

import json

import pytest
import yaml

from mqbench.app.bench import split_bench
from mqbench.app.config import ConfigError
from mqbench.cli import main

TINY = """
from torch import nn


def cnn(num_classes=10):
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, num_classes),
    )
"""


def test_the_matrix_runs_every_combination_and_tabulates_what_each_run_folder_says(tmp_path, user_modules, capsys):
    from PIL import Image

    user_modules("bench_models", TINY)
    config = {
        "bench": {"models": ["bench_models:cnn"], "backends": ["tensorrt", "openvino"], "latency_repeats": 3},
        "data": {"batch_size": 16, "input_size": 16, "max_eval": 48},
        "quantize": {"cali_batchsize": 1, "verify_samples": 4},
        "extra_prepare_dict": {"reduce_range": True},
    }
    (tmp_path / "bench.yaml").write_text(yaml.safe_dump(config))
    assert main(["bench", "--config", "bench.yaml", "--output", "out", "--quiet"]) == 0
    printed = capsys.readouterr().out
    payload = json.loads((tmp_path / "out" / "bench.json").read_text())
    rows = payload["rows"]
    assert [(r["backend"], r["method"]) for r in rows] == [("tensorrt", "naive_ptq"), ("openvino", "naive_ptq")]
    for row in rows:
        results = json.loads((tmp_path / "out" / row["run"] / "results.json").read_text())
        assert row["simulated"] == results["accuracy"]["simulated"]
        assert row["deployed"] == results["accuracy"]["deployed"]
        assert row["max_lsb"] == max(a["max_lsb_diff"] for a in results["verify"]["artifacts"].values())
        assert row["verified"] and row["latency_ms"] > 0
        assert f"| bench_models:cnn | {row['backend']} | naive_ptq |" in printed
    with Image.open(tmp_path / "out" / "bench.png") as picture:
        assert picture.format == "PNG" and picture.size[0] > 100


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"quantize": {}}, "needs a 'bench' section"),
        ({"bench": {"models": ["resnet18"], "backends": ["tensorrt"], "repeat": 3}}, "unknown key 'bench.repeat'"),
        ({"bench": {"models": [], "backends": ["tensorrt"]}}, "'bench.models' must be a non-empty list"),
        ({"bench": {"models": ["resnet18"], "backends": ["tensorrt"], "methods": ["qat"]}}, "'bench.methods' has"),
    ],
)
def test_a_bench_section_is_checked(raw, message):
    with pytest.raises(ConfigError, match=message):
        split_bench(raw, "b.yaml")
