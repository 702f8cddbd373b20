"""`mqbench qat --config`: training with quantization in the loop, checkpoints and resume, and the same run
across two processes (torchrun, gloo on the CPU) against one process with the same global batch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml

from mqbench.app.distributed import DistributedBatchNorm, restore_batch_norm, synchronise_batch_norm
from mqbench.cli import main

TINY_MODELS = """
from torch import nn


def cnn(num_classes=10):
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1, stride=2), nn.BatchNorm2d(8), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, num_classes),
    )
"""


def _config(folder: Path, batch_size: int, epochs: int = 1, **training: object) -> Path:
    (folder / "tiny_models.py").write_text(TINY_MODELS)
    torch.manual_seed(0)
    config = {
        "model": {"type": "tiny_models:cnn"},
        "data": {"batch_size": batch_size, "input_size": 16, "max_eval": 64},
        "quantize": {"cali_batchsize": 2, "backend": "Academic", "verify_samples": 8},
        "extra_prepare_dict": {
            "extra_qconfig_dict": {
                "w_observer": "MinMaxObserver",
                "a_observer": "EMAMinMaxObserver",
                "w_fakequantize": "LearnableFakeQuantize",
                "a_fakequantize": "LearnableFakeQuantize",
                "w_qscheme": {"bit": 4, "symmetry": True, "per_channel": True, "pot_scale": False},
                "a_qscheme": {"bit": 4, "symmetry": False, "per_channel": False, "pot_scale": False},
            }
        },
        "training": {"epochs": epochs, "lr": 0.05, "optimizer": "sgd", "max_steps": 3, **training},
        "process": {"seed": 3},
    }
    path = folder / f"qat_{batch_size}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _run(folder: Path, args: list[str], processes: int = 1) -> None:
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(folder)}
    if processes == 1:
        command = [sys.executable, "-m", "mqbench", *args]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes)]
        command += ["--standalone", "-m", "mqbench", *args]  # a free port on localhost
    done = subprocess.run(command, cwd=folder, env=environment, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def test_two_processes_train_what_one_process_trains_with_the_same_global_batch(tmp_path):
    _run(tmp_path, ["qat", "--config", str(_config(tmp_path, 8)), "--output", "ddp", "--quiet"], processes=2)
    _run(tmp_path, ["qat", "--config", str(_config(tmp_path, 16)), "--output", "single", "--quiet"])
    ddp = json.loads((tmp_path / "ddp" / "results.json").read_text())
    single = json.loads((tmp_path / "single" / "results.json").read_text())
    assert ddp["training"]["processes"] == 2 and single["training"]["processes"] == 1
    assert ddp["training"]["global_batch"] == single["training"]["global_batch"] == 16
    assert ddp["verify"]["passed"] and single["verify"]["passed"]
    a = torch.load(tmp_path / "ddp" / "checkpoint.pt", weights_only=True)["model"]
    b = torch.load(tmp_path / "single" / "checkpoint.pt", weights_only=True)["model"]
    assert a.keys() == b.keys()
    for key in a:
        if a[key].is_floating_point():
            # float32 sums in another order (gradients all-reduced, BN statistics from per-rank sums)
            torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6, msg=key)
        else:
            assert torch.equal(a[key], b[key]), key
    final = torch.load(tmp_path / "ddp" / "quantized_state_dict.pt", weights_only=True)
    assert all(torch.equal(final[key], a[key]) for key in a)  # rank 0 deployed the trained model
    loss_ddp = [h["loss"] for h in ddp["training"]["history"]]
    loss_single = [h["loss"] for h in single["training"]["history"]]
    assert loss_ddp == pytest.approx(loss_single, rel=1e-6)


def test_resume_continues_where_the_checkpoint_stopped_as_an_uninterrupted_run(tmp_path, user_modules):
    whole = _config(tmp_path, 16, epochs=2)
    assert main(["qat", "--config", str(whole), "--output", "whole", "--quiet"]) == 0
    first = tmp_path / "first.yaml"
    raw = yaml.safe_load(whole.read_text())
    raw["training"]["epochs"] = 1
    first.write_text(yaml.safe_dump(raw))
    assert main(["qat", "--config", str(first), "--output", "first", "--quiet"]) == 0
    raw["training"] |= {"epochs": 2, "resume": str(tmp_path / "first" / "checkpoint.pt")}
    second = tmp_path / "second.yaml"
    second.write_text(yaml.safe_dump(raw))
    assert main(["qat", "--config", str(second), "--output", "second", "--quiet"]) == 0
    a = torch.load(tmp_path / "whole" / "checkpoint.pt", weights_only=True)
    b = torch.load(tmp_path / "second" / "checkpoint.pt", weights_only=True)
    assert a["epoch"] == b["epoch"] == 2
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    assert [h["loss"] for h in a["history"]] == [h["loss"] for h in b["history"]]
    results = json.loads((tmp_path / "second" / "results.json").read_text())
    assert results["training"]["resumed_from_epoch"] == 1
    report = (tmp_path / "second" / "report.md").read_text()
    assert "## Training" in report and "| 2 |" in report

    raw["training"]["lr"] = 0.5  # another configuration's checkpoint is refused
    other = tmp_path / "other.yaml"
    other.write_text(yaml.safe_dump(raw))
    with pytest.raises(SystemExit):
        main(["qat", "--config", str(other), "--output", "other", "--quiet"])


def test_batch_norm_swaps_keep_the_state_and_the_class():
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 1), torch.nn.BatchNorm2d(2), torch.nn.BatchNorm1d(3))
    model[1].running_mean.fill_(0.5)
    synchronise_batch_norm(model)
    assert isinstance(model[1], DistributedBatchNorm) and isinstance(model[2], DistributedBatchNorm)
    x = torch.randn(4, 2, 3, 3)
    model.eval()
    expected = torch.nn.functional.batch_norm(x, model[1].running_mean, model[1].running_var, eps=1e-5)
    torch.testing.assert_close(model[1](x), expected)
    restore_batch_norm(model)
    assert type(model[1]) is torch.nn.BatchNorm2d and type(model[2]) is torch.nn.BatchNorm1d
    assert float(model[1].running_mean[0]) == 0.5


def test_a_config_without_labels_or_with_advanced_ptq_is_refused(tmp_path, capsys):
    config = tmp_path / "bad.yaml"
    config.write_text(
        textwrap.dedent(
            """
            quantize: {quantize_type: advanced_ptq, reconstruction: {pattern: block}, backend: tensorrt}
            """
        )
    )
    with pytest.raises(SystemExit):
        main(["qat", "--config", str(config), "--output", str(tmp_path / "run"), "--quiet"])
    assert "advanced_ptq is for mqbench ptq" in capsys.readouterr().err


# MQBench's application/lsq_configs/resnet18-4bit-acedemic.yaml key for key (its flat QAT layout).
MQBENCH_LSQ = """
arch: resnet18                  # model architecture
model_path:                     # pretrained full-precision ckpt
deploy: False
evaluate: False
pretrained: True
resume:                         # resume qat ckpt

epochs: 100
start_epoch: 0
batch_size: 512                 # 128 * 4 gpu
optim: adam
lr: 0.00005
lr_scheduler: Cosine            # T = 100_epochs
weight_decay: 0.000

quantization:
  enabled: True
  type: Academic
  qparams:
    w_observer: LSQObserver
    w_fakequantize: LearnableFakeQuantize
    w_qscheme:
      bit: 4
      symmetry: True
      per_channel: False
      pot_scale: False
    a_observer: LSQObserver
    a_fakequantize: LearnableFakeQuantize
    a_qscheme:
      bit: 4
      symmetry: False
      per_channel: False
      pot_scale: False
"""


def test_mqbench_s_flat_qat_layout_loads_key_for_key():
    from mqbench.app.config import parse_config

    raw = yaml.safe_load(MQBENCH_LSQ)
    config = parse_config(raw, "resnet18-4bit-acedemic.yaml")
    expected = {"type": "resnet18", "kwargs": {}, "path": None, "tracer": None, "input_names": None, "output": None}
    expected["task"] = "classification"  # filled in from model.type
    assert config["model"] == expected
    assert config["data"]["batch_size"] == 512
    training = config["training"]
    assert (training["epochs"], training["optimizer"], training["lr"]) == (100, "adam", 0.00005)
    assert (training["lr_scheduler"], training["weight_decay"], training["resume"]) == ("cosine", 0.0, None)
    assert config["quantize"]["backend"] == "Academic"
    assert config["extra_prepare_dict"]["extra_qconfig_dict"] == raw["quantization"]["qparams"]
    assert parse_config(config, "resolved.yaml") == config  # the resolved form (a run's config.yaml) reloads


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"deploy": True}, "'deploy: True' is not a QAT run here; deploying a trained checkpoint is mqbench deploy"),
        ({"evaluate": True}, "'evaluate: True' is not a QAT run here; evaluating a checkpoint is mqbench verify"),
        ({"pretrained": False}, "'pretrained: False' is not a QAT run here; mqbench qat starts from the trained"),
        ({"start_epoch": 3}, "'start_epoch: 3' is not a QAT run here; to continue a run, set resume"),
        ({"quantization": {"enabled": False}}, "'quantization.enabled' is not true"),
        ({"quantization": {"bits": 4}}, "unknown key 'quantization.bits'; valid keys: enabled, type, qparams"),
        ({"lr_scheduler": "step"}, "'training.lr_scheduler' must be null (constant) or cosine, got 'step'"),
        ({"optimiser": "adam"}, "unknown key 'optimiser' of MQBench's flat QAT layout; valid: arch, batch_size"),
        ({"training": {"epochs": 2}}, "'epochs' and 'training.epochs' both given; keep one"),
    ],
)
def test_flat_layout_values_a_qat_run_cannot_have_say_what_to_do(change, message):
    from mqbench.app.config import ConfigError, parse_config

    raw = yaml.safe_load(MQBENCH_LSQ) | change
    with pytest.raises(ConfigError) as error:
        parse_config(raw, "lsq.yaml")
    assert str(error.value).startswith("lsq.yaml: ") and message in str(error.value)


def test_a_flat_layout_config_trains_with_its_cosine_schedule(tmp_path, user_modules):
    """The LSQ config with its model and data adapted (a small CNN, the digits) and two short epochs."""
    user_modules("tiny_models", TINY_MODELS)
    raw = yaml.safe_load(MQBENCH_LSQ) | {"arch": "tiny_models:cnn", "batch_size": 16, "epochs": 2, "lr": 0.01}
    raw |= {"data": {"input_size": 16, "max_eval": 64}, "training": {"max_steps": 2}}
    raw |= {"quantize": {"cali_batchsize": 2, "verify_samples": 8}}
    config = tmp_path / "lsq.yaml"
    config.write_text(yaml.safe_dump(raw))
    assert main(["qat", "--config", str(config), "--output", "run", "--quiet"]) == 0
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["status"] == "finished" and results["verify"]["passed"]
    assert [h["epoch"] for h in results["training"]["history"]] == [1, 2]
    checkpoint = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)
    # The second epoch ran at lr (1 + cos(pi * 1 / 2)) / 2 = lr / 2 (CosineAnnealingLR's closed form).
    rates = [group["lr"] for group in checkpoint["optimizer"]["param_groups"]]
    assert rates == pytest.approx([0.005] * len(rates), rel=1e-12)
