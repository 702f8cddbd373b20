"""Inputs a run adapts with a note or refuses with a clear error: ``.npz`` images without a channel axis, and a
float16 model, each taken through ``mqbench ptq`` to a verified deployment."""

from __future__ import annotations

import json
import logging
import re

import numpy as np
import pytest
import yaml

from mqbench.app.config import parse_config
from mqbench.app.distributed import Processes
from mqbench.app.runs import load_run
from mqbench.backends import resolve_backend
from mqbench.cli import main
from mqbench.data import load_digits_split

MODELS = """
import torch
from torch import nn


def cnn(channels=1, num_classes=10, half=False):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(channels, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, num_classes),
    )
    return model.half() if half else model
"""


def _digits_npz(path, with_channel_axis: bool) -> None:
    train, test = load_digits_split()
    x_train, x_val = train.images[:64, 0].numpy(), test.images[:32, 0].numpy()  # (N, 8, 8)
    if with_channel_axis:
        x_train, x_val = x_train[:, None], x_val[:, None]
    np.savez(path, x_train=x_train, y_train=train.labels[:64].numpy(), x_val=x_val, y_val=test.labels[:32].numpy())


def _config(tmp_path, **model_kwargs) -> dict:
    return {
        "model": {"type": "my_nets:cnn", "kwargs": model_kwargs},
        "data": {"path": str(tmp_path / "digits.npz"), "batch_size": 16},
        "quantize": {"backend": "tensorrt", "cali_batchsize": 2, "verify_samples": 8},
    }


def test_npz_images_without_a_channel_axis_get_one_for_a_one_channel_model(tmp_path, user_modules, caplog):
    user_modules("my_nets", MODELS)
    _digits_npz(tmp_path / "digits.npz", with_channel_axis=False)
    config = _config(tmp_path, channels=1)
    with caplog.at_level(logging.WARNING, logger="mqbench"):
        run, _, _ = load_run(parse_config(config), resolve_backend("tensorrt"), None, Processes(), True)
    assert tuple(run.val.shape) == (32, 1, 8, 8) and tuple(run.data.train.shape) == (64, 1, 8, 8)
    assert "have shape (64, 8, 8), without a channel axis" in caplog.text
    assert "read as (N, C, H, W) with C=1" in caplog.text

    (tmp_path / "ptq.yaml").write_text(yaml.safe_dump(config))
    assert main(["ptq", "--config", "ptq.yaml", "--output", "run", "--quiet"]) == 0
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["status"] == "finished" and results["verify"]["passed"]

    # the same arrays with the axis give the same accuracies
    _digits_npz(tmp_path / "digits.npz", with_channel_axis=True)
    assert main(["ptq", "--config", "ptq.yaml", "--output", "run_with_axis", "--quiet"]) == 0
    with_axis = json.loads((tmp_path / "run_with_axis" / "results.json").read_text())
    assert with_axis["accuracy"] == results["accuracy"]


@pytest.mark.parametrize(
    ("with_axis", "message"),
    [
        (
            False,
            r"the inputs have shape \(64, 8, 8\), without a channel axis, and the model's first layer '0' takes "
            r"3 channels: store them as \(N, C, H, W\) with C=3",
        ),
        (
            True,
            r"the model cannot run on inputs of shape \(64, 1, 8, 8\); its first layer '0' takes \(N, C, H, W\) "
            r"with C=3",
        ),
    ],
)
def test_npz_images_that_do_not_fit_the_first_layer_are_named(with_axis, message, tmp_path, user_modules, capsys):
    user_modules("my_nets", MODELS)
    _digits_npz(tmp_path / "digits.npz", with_channel_axis=with_axis)
    (tmp_path / "ptq.yaml").write_text(yaml.safe_dump(_config(tmp_path, channels=3)))
    with pytest.raises(SystemExit) as exit_info:
        main(["ptq", "--config", "ptq.yaml", "--output", "run", "--quiet"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert re.search(message, error), error
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["status"] == "failed" and re.search(message, results["error"])


def test_a_float16_model_runs_in_float32_with_a_note_and_verifies(tmp_path, user_modules, caplog):
    user_modules("my_nets", MODELS)
    _digits_npz(tmp_path / "digits.npz", with_channel_axis=True)
    (tmp_path / "ptq.yaml").write_text(yaml.safe_dump(_config(tmp_path, channels=1, half=True)))
    with caplog.at_level(logging.WARNING, logger="mqbench"):
        assert main(["ptq", "--config", "ptq.yaml", "--output", "run", "--quiet"]) == 0
    assert "its parameters are float16; the run evaluates, quantizes and deploys it in float32" in caplog.text
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["status"] == "finished" and results["verify"]["passed"]
    assert main(["verify", "--run", "run"]) == 0
