"""MQBench's ImageNet PTQ example flow, step by step, with its AdaRound / BRECQ / QDrop configs.

The configs are MQBench's ``configs/{adaround,brecq,qdrop}/r18_2_4.yaml`` key for key, loaded with
PyYAML into attribute-style dicts as its ``parse_config`` does (EasyDict); only the data source
(the 8x8 digits instead of ImageNet), the model section (a small CNN trained here instead of a
ResNet-18 checkpoint) and ``max_count`` (a CPU's budget instead of 20000) differ. The steps are the script's: prepare by
``BackendType`` with ``extra_prepare_dict``, activation then weight calibration without
quantizing, ``ptq_reconstruction(model, cali_data, config.quantize.reconstruction)``,
``enable_quantization``, evaluate, and ``convert_deploy`` with its ``deploy`` section.
"""

from __future__ import annotations

import importlib
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from mqbench.convert_deploy import convert_deploy
from mqbench.deploy.verify import verify_deploy
from mqbench.prepare_by_platform import BackendType, prepare_by_platform
from mqbench.utils.state import enable_calibration_woquantization, enable_quantization

CONFIG = """
extra_prepare_dict:
    extra_qconfig_dict:
        w_observer: MSEObserver
        a_observer: EMAMSEObserver
        w_fakequantize: AdaRoundFakeQuantize
        a_fakequantize: {a_fakequantize}
        w_qscheme:
            bit: 2
            symmetry: False
            per_channel: True
            pot_scale: False
            p: 2.4
        a_qscheme:
            bit: 4
            symmetry: False
            per_channel: False
            pot_scale: False
            p: 2.4
quantize:
    quantize_type: advanced_ptq # support naive_ptq or advanced_ptq
    cali_batchsize: 4
    reconstruction:
        pattern: {pattern}
        scale_lr: 4.0e-5
        warm_up: 0.2
        weight: 0.01
        max_count: 60
        b_range: [20,2]
        keep_gpu: True
        round_mode: learned_hard_sigmoid
        prob: {prob}
    deploy:
        model_name: r18_2_4
        output_path: {output}
        deploy_to_qlinear: False
model:
    type: digits_cnn
data:
    batch_size: 64
process:
    seed: 1005
"""
METHODS = {  # MQBench's three configs differ in these keys only
    "adaround": {"a_fakequantize": "FixedFakeQuantize", "pattern": "layer", "prob": 1.0},
    "brecq": {"a_fakequantize": "QDropFakeQuantize", "pattern": "block", "prob": 1.0},
    "qdrop": {"a_fakequantize": "QDropFakeQuantize", "pattern": "block", "prob": 0.5},
}


class AttrDict(dict):
    """EasyDict's behaviour as the example uses it: nested keys read as attributes, ``hasattr`` for optional ones."""

    def __init__(self, mapping: dict) -> None:
        super().__init__({k: AttrDict(v) if isinstance(v, dict) else v for k, v in mapping.items()})

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError as error:
            raise AttributeError(name) from error


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@pytest.fixture(scope="module")
def digits(trained_digits_cnn):
    model, train_split, test_split = trained_digits_cnn
    return model, train_split.images, test_split.images, test_split.labels


def evaluate(model, images, labels) -> float:
    with torch.no_grad():
        return float((model(images).argmax(1) == labels).float().mean())


def run_example(config, digits, reconstruct: bool, module: str):
    trained, train_images, test, labels = digits
    ptq_reconstruction = importlib.import_module(module).ptq_reconstruction
    seed_all(config.process.seed)
    model = {"digits_cnn": trained}[config.model.type]
    backend = BackendType.Academic if not hasattr(config.quantize, "backend") else BackendType[config.quantize.backend]
    model = prepare_by_platform(model, backend, prepare_custom_config_dict=config.extra_prepare_dict)
    batch = config.data.batch_size
    cali_data = [train_images[i * batch : (i + 1) * batch] for i in range(config.quantize.cali_batchsize)]
    model.eval()
    with torch.no_grad():
        enable_calibration_woquantization(model, quantizer_type="act_fake_quant")
        for images in cali_data:
            model(images)
        enable_calibration_woquantization(model, quantizer_type="weight_fake_quant")
        model(cali_data[0])
    if reconstruct and hasattr(config.quantize, "reconstruction"):
        model = ptq_reconstruction(model, cali_data, config.quantize.reconstruction)
    enable_quantization(model)
    return model, evaluate(model, test, labels)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_mqbench_s_ptq_example_runs_with_its_configs(method, digits, tmp_path):
    config = AttrDict(yaml.safe_load(CONFIG.format(**METHODS[method], output=tmp_path)))
    module = "mqbench.ptq_reconstruction" if method == "adaround" else "mqbench.advanced_ptq"  # both import paths
    _, naive_accuracy = run_example(config, digits, reconstruct=False, module=module)
    model, accuracy = run_example(config, digits, reconstruct=True, module=module)
    assert accuracy > naive_accuracy, (accuracy, naive_accuracy)  # W2A4: reconstruction recovers accuracy
    deploy = config.quantize.deploy
    result = convert_deploy(
        model,
        BackendType.Academic,
        {"input": [1, 1, 8, 8]},
        output_path=deploy.output_path,
        model_name=deploy.model_name,
        deploy_to_qlinear=deploy.deploy_to_qlinear,
    )
    assert result.artifacts, result
    for path in result.artifacts.values():
        assert Path(path).parent == tmp_path and Path(path).name.startswith("r18_2_4"), path
    for image in digits[2][:4]:
        report = verify_deploy(model, result, image[None])
        assert report.max_lsb_diff <= 1, report.summary()
