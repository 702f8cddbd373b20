"""The blocks of architectures users bring (tests/architecture_blocks.py: SE, ghost, RepVGG/MobileOne branches,
dense concatenation, Inception branches, ConvNeXt, Swin windows, LeViT attention, MobileViT, FastViT's mixer),
through prepare, calibration, deployment and verify on the five backends a vision user picks first."""

from __future__ import annotations

import pytest
import torch

from architecture_blocks import AttentionNet, ConvNet, randomize_norms
from backend_configs import host_config
from mqbench.convert_deploy import convert_deploy
from mqbench.deploy.verify import verify_deploy
from mqbench.prepare_by_platform import prepare_by_platform
from mqbench.utils.state import enable_calibration, enable_quantization

BACKENDS = ["tensorrt", "snpe", "openvino", "onnx_qnn", "academic"]
NETWORKS = {"convnet": ConvNet, "attention": AttentionNet}
BATCH = {"input_0": {0: "batch"}}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("network", sorted(NETWORKS))
def test_architecture_blocks_prepare_deploy_and_verify(network, backend, tmp_path):
    torch.manual_seed(0)
    model = randomize_norms(NETWORKS[network]()).eval()
    images = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    config = {**(host_config(backend) or {}), "example_inputs": images}
    qmodel = prepare_by_platform(model, backend, config)
    enable_calibration(qmodel)
    with torch.no_grad():
        qmodel(images)
    enable_quantization(qmodel)
    with torch.no_grad():
        expected, got = model(images), qmodel(images)
    relative = (got - expected).norm() / expected.norm()
    assert relative < 0.1, float(relative)  # W8A8 of a small random network stays near its float outputs
    # a dynamic batch, as deployments usually have (with a static one, OpenVINO's CPU plugin computes the padded
    # average pool 2 steps off: the test below)
    result = convert_deploy(qmodel, backend, dummy_input=images[:2], output_path=tmp_path, dynamic_axes=BATCH)
    report = verify_deploy(qmodel, result, images[2:5])
    assert report.passed, report.failures()


def test_a_static_batch_that_openvino_computes_differently_is_named_with_its_remedy(tmp_path):
    """Deployed with a static batch, the ConvNet's padded 3x3 average pool came out 2 steps off on OpenVINO 2026.4's
    CPU plugin (the same file with a dynamic batch is exact). Where it does, verify names the static shape as
    the cause and a dynamic batch axis as the remedy, and following the remedy verifies."""
    torch.manual_seed(0)
    model = randomize_norms(ConvNet()).eval()
    images = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    qmodel = prepare_by_platform(model, "openvino", host_config("openvino"))
    enable_calibration(qmodel)
    with torch.no_grad():
        qmodel(images)
    enable_quantization(qmodel)
    static = convert_deploy(qmodel, "openvino", dummy_input=images[:2], output_path=tmp_path / "static")
    report = verify_deploy(qmodel, static, images[2:4])
    if not report.passed:
        host = report.artifacts["openvino_onnx"].host
        assert host is not None and "static batch dimension" in (host.cause or ""), report.failures()
        assert host.remedy is not None and "dynamic_axes={'input_0': {0: 'batch'}}" in host.remedy
    dynamic = convert_deploy(
        qmodel, "openvino", dummy_input=images[:2], output_path=tmp_path / "dynamic", dynamic_axes=BATCH
    )
    report = verify_deploy(qmodel, dynamic, images[2:4])
    assert report.passed, report.failures()
