"""A float16 / bfloat16 model is quantized in float32: prepared with a warning that says so, calibrated on its
own half-precision inputs, deployed, and verified against onnxruntime."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mqbench.advanced_ptq import calibrate
from mqbench.convert_deploy import convert_deploy
from mqbench.deploy.verify import verify_deploy
from mqbench.prepare_by_platform import prepare_by_platform
from mqbench.utils.state import disable_all, enable_quantization


def _model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 8 * 8, 5)
    )
    with torch.no_grad():
        model[1].running_mean.uniform_(-0.5, 0.5)
        model[1].running_var.uniform_(0.5, 2.0)
    return model.eval().to(dtype)


@pytest.mark.parametrize("capture", ["fx", "export"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_half_precision_model_prepares_calibrates_deploys_and_verifies_in_float32(dtype, capture, tmp_path):
    model = _model(dtype)
    config = {"capture": capture}
    if capture == "export":  # captured on its own half-precision example
        config["example_inputs"] = torch.randn(2, 3, 8, 8).to(dtype)
    with pytest.warns(UserWarning, match=r"parameters; mqbench calibrates, simulates and deploys in float32"):
        qmodel = prepare_by_platform(model, "tensorrt", config)
    assert qmodel.mqbench_capture == capture
    assert all(p.dtype == dtype for p in model.parameters())  # the user's model is left as it was
    assert all(p.dtype == torch.float32 for p in qmodel.parameters())

    images = torch.randn(16, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    calibrate(qmodel, [images.to(dtype)])  # the model's own input type
    disable_all(qmodel)
    reference = model.float()(images.to(dtype).float())  # the same weights and inputs, in float32
    torch.testing.assert_close(qmodel(images.to(dtype)), reference, rtol=0, atol=1e-5)
    enable_quantization(qmodel)
    simulated = qmodel(images.to(dtype))
    assert simulated.dtype == torch.float32
    torch.testing.assert_close(simulated, qmodel(images.to(dtype).float()), rtol=0, atol=0)

    result = convert_deploy(
        qmodel,
        "tensorrt",
        {"x": [1, 3, 8, 8]},
        output_path=tmp_path,
        model_name="half",
        dynamic_axes={"x": {0: "batch"}},
    )
    # the deployment takes float32, as the warning says; the half inputs in float32 are the same numbers
    report = verify_deploy(qmodel, result, images.to(dtype).float())
    assert report.passed, report.failures()
    assert report.artifacts["onnx"].max_lsb_diff <= 1
    assert verify_deploy(qmodel, result, images.to(dtype)).passed  # the half inputs themselves verify too
