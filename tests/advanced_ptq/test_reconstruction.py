"""ptq_reconstruction end to end on a digits CNN trained here: better than rounding to nearest, on the grid,
deployable and verifiable, and saved and reloaded bit for bit."""

from __future__ import annotations

import io
import types

import pytest
import torch

from mqbench.advanced_ptq import calibrate, ptq_reconstruction
from mqbench.backends import ParamsTable
from mqbench.convert_deploy import convert_deploy
from mqbench.deploy.verify import verify_deploy
from mqbench.fake_quantize import AdaRoundFakeQuantize, QDropFakeQuantize
from mqbench.prepare_by_platform import prepare_by_platform
from mqbench.utils.state import enable_quantization


@pytest.fixture(scope="module")
def digits(trained_digits_cnn):
    model, train_split, test_split = trained_digits_cnn
    calibration = [train_split.images[i : i + 64] for i in range(0, 256, 64)]
    return model, calibration, test_split


def mqbench_config(weight: str, activation: str, wbit: int, abit: int) -> dict:
    """MQBench's PTQ recipe layout (configs/*/r18_*.yaml): MSE observers with p = 2.4."""
    return {
        "extra_qconfig_dict": {
            "w_observer": "MSEObserver",
            "a_observer": "EMAMSEObserver",
            "w_fakequantize": weight,
            "a_fakequantize": activation,
            "w_qscheme": {"bit": wbit, "symmetry": False, "per_channel": True, "pot_scale": False, "p": 2.4},
            "a_qscheme": {"bit": abit, "symmetry": False, "per_channel": False, "pot_scale": False, "p": 2.4},
        }
    }


def calibrated(model, calibration, backend, config):
    return calibrate(prepare_by_platform(model, backend, config), calibration)


def output_error(qmodel, model, images) -> float:
    with torch.no_grad():
        return float((qmodel(images) - model(images)).pow(2).sum(1).mean())


RECON = {"max_count": 300, "warm_up": 0.2, "weight": 0.01, "b_range": [20, 2], "progress": False}


@pytest.mark.parametrize("pattern", ["layer", "block"])
def test_learned_rounding_beats_rounding_to_nearest_and_lands_on_the_grid(digits, pattern):
    model, calibration, test = digits
    config = mqbench_config("AdaRoundFakeQuantize", "FixedFakeQuantize", 3, 8)
    nearest = calibrated(model, calibration, "academic", config)
    learned = calibrated(model, calibration, "academic", config)
    ptq_reconstruction(learned, calibration, {**RECON, "pattern": pattern})
    images = test.images[:256]
    errors = (output_error(learned, model, images), output_error(nearest, model, images))
    assert errors[0] < errors[1], errors  # on held-out digits, not the calibration batches
    for name, module in learned.named_modules():
        quantizer = getattr(module, "weight_fake_quant", None)
        if isinstance(quantizer, AdaRoundFakeQuantize):
            assert not quantizer.adaround and quantizer.alpha is None
            scale = quantizer.scale.reshape(-1, *[1] * (module.weight.dim() - 1))
            zero_point = quantizer.zero_point.reshape(scale.shape).float()
            steps = module.weight.detach() / scale + zero_point
            assert torch.allclose(steps, steps.round(), atol=1e-3), name  # every weight on its grid
            assert steps.round().min() >= quantizer.quant_min and steps.round().max() <= quantizer.quant_max


def test_qdrop_reconstructs_and_restores_quantization_everywhere(digits):
    model, calibration, test = digits
    config = mqbench_config("AdaRoundFakeQuantize", "QDropFakeQuantize", 3, 4)
    nearest = calibrated(model, calibration, "academic", mqbench_config("FixedFakeQuantize", "QDropFakeQuantize", 3, 4))
    qmodel = calibrated(model, calibration, "academic", config)
    before = {n: float(m.scale.detach().mean()) for n, m in qmodel.named_modules() if isinstance(m, QDropFakeQuantize)}
    ptq_reconstruction(qmodel, calibration, {**RECON, "pattern": "block", "prob": 0.5, "scale_lr": 4e-3})
    quantizers = {n: m for n, m in qmodel.named_modules() if isinstance(m, QDropFakeQuantize)}
    assert quantizers and all(m.prob == 1.0 for m in quantizers.values())
    assert any(float(m.scale.detach().mean()) != before[n] for n, m in quantizers.items())  # scales were learned
    assert output_error(qmodel, model, test.images[:256]) < output_error(nearest, model, test.images[:256])


@pytest.mark.parametrize("backend", ["academic", "tensorrt"])
def test_a_reconstructed_model_deploys_verifies_and_reloads_bit_for_bit(digits, backend, tmp_path):
    model, calibration, test = digits
    if backend == "academic":
        config = mqbench_config("AdaRoundFakeQuantize", "FixedFakeQuantize", 4, 8)
    else:
        config = {"extra_qconfig_dict": {"w_fakequantize": "AdaRoundFakeQuantize", "w_observer": "MSEObserver"}}
    qmodel = calibrated(model, calibration, backend, config)
    ptq_reconstruction(qmodel, calibration, {**RECON, "max_count": 100, "pattern": "block"})
    result = convert_deploy(qmodel, backend, {"x": [4, 1, 8, 8]}, output_path=tmp_path / "out")
    report = verify_deploy(qmodel, result, test.images[:4])
    assert report.max_lsb_diff <= 1, report.summary()
    buffer = io.BytesIO()
    torch.save(qmodel.state_dict(), buffer)
    buffer.seek(0)
    reloaded = calibrated(model, calibration[:1], backend, config)
    reloaded.load_state_dict(torch.load(buffer, weights_only=True))
    enable_quantization(reloaded)
    with torch.no_grad():
        assert torch.equal(reloaded(test.images[:64]), qmodel(test.images[:64]))


def test_config_keys_are_mqbench_s_and_checked(digits):
    model, calibration, _ = digits
    qmodel = calibrated(
        model, calibration, "academic", mqbench_config("AdaRoundFakeQuantize", "FixedFakeQuantize", 4, 8)
    )
    with pytest.raises(ValueError, match=r"unknown reconstruction config key\(s\) \['patern'\]; valid keys: b_range"):
        ptq_reconstruction(qmodel, calibration, {"patern": "block"})
    with pytest.raises(ValueError, match="b_range is"):
        ptq_reconstruction(qmodel, calibration, {"b_range": [2, 20]})
    attribute_style = types.SimpleNamespace(pattern="layer", max_count=5, progress=False, exclude_node=["fc"])
    ptq_reconstruction(qmodel, calibration, attribute_style)  # EasyDict-style objects work too


LINEAR_GRID_BACKENDS = sorted(
    name
    for name in ParamsTable
    if ParamsTable[name].weight is not None and ParamsTable[name].weight.factory().cls.deploy_grid == "linear"
)  # NNIE's weights are on its log grid, tensorrt_fp8's on FP8: learned linear rounding does not apply (refused)


@pytest.mark.parametrize("backend", LINEAR_GRID_BACKENDS)
def test_block_reconstruction_deploys_and_verifies_on_every_backend(digits, backend, tmp_path):
    """The backend's own activation quantizers (scales learned) with AdaRound weights: every artifact
    within the backend's tolerance of the simulation."""
    model, calibration, test = digits
    config = {"extra_qconfig_dict": {"w_fakequantize": "AdaRoundFakeQuantize"}}
    qmodel = calibrated(model, calibration[:2], backend, config)
    ptq_reconstruction(qmodel, calibration[:2], {**RECON, "max_count": 30, "pattern": "block"})
    result = convert_deploy(qmodel, backend, {"x": [2, 1, 8, 8]}, output_path=tmp_path / "out")
    report = verify_deploy(qmodel, result, test.images[:2])
    assert report.max_lsb_diff <= ParamsTable[backend].lsb_tolerance, report.summary()


def test_a_log_grid_backend_refuses_learned_linear_rounding(digits):
    model, _, _ = digits
    with pytest.raises(ValueError, match=r"backend 'nnie' deploys weights on its 'log' grid.*AdaRoundFakeQuantize"):
        prepare_by_platform(model, "nnie", {"extra_qconfig_dict": {"w_fakequantize": "AdaRoundFakeQuantize"}})
