"""convert_deploy end to end: both export paths, export options, errors, extension, verification."""

from __future__ import annotations

import dataclasses
import json
import os
import warnings

import numpy as np
import onnx
import pytest
import torch
from torch import nn

from mqbench.backends import ParamsTable
from mqbench.convert_deploy import DeployContext, convert_deploy, deploy_functions, register_deploy_function
from mqbench.custom_quantizer.plan import plan_of
from mqbench.deploy.freeze import UncalibratedError
from mqbench.deploy.onnx_graph import ort_session
from mqbench.deploy.verify import verify_deploy
from mqbench.fake_quantize import QuantizeBase
from mqbench.models import DigitsCNN, two_head_detector
from mqbench.prepare_by_platform import prepare_by_platform
from mqbench.utils.state import enable_calibration, enable_quantization

SHAPE = [2, 1, 8, 8]


def calibrated(model: nn.Module, backend: str, shape=SHAPE, batches: int = 3, **prepare_kwargs) -> nn.Module:
    qmodel = prepare_by_platform(model.eval(), backend, **prepare_kwargs)
    enable_calibration(qmodel)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _ in range(batches):
            qmodel(torch.randn(shape, generator=generator))
    enable_quantization(qmodel)
    return qmodel


def quantizer_calls(qmodel: nn.Module, x: torch.Tensor) -> int:
    """How many times enabled quantizers run in one forward (an independent count of quantized tensors)."""
    count = 0

    def hook(*_: object) -> None:
        nonlocal count
        count += 1

    handles = [m.register_forward_hook(hook) for m in qmodel.modules() if isinstance(m, QuantizeBase)]
    with torch.no_grad():
        qmodel.eval()(x)
    for handle in handles:
        handle.remove()
    return count


@pytest.fixture(scope="module")
def digits_qdq() -> nn.Module:
    torch.manual_seed(0)
    return calibrated(DigitsCNN(), "qdq")


@pytest.mark.parametrize("dynamo", [False, True])
def test_both_export_paths_deploy_and_match_the_simulation(digits_qdq, tmp_path, dynamo):
    result = convert_deploy(digits_qdq, "qdq", {"x": SHAPE}, output_path=tmp_path, model_name="digits", dynamo=dynamo)
    assert sorted(result.artifacts) == ["deploy_onnx", "onnx"]
    assert result.artifacts["onnx"] == str(tmp_path / "digits.onnx")
    assert sorted(os.listdir(tmp_path)) == ["digits.onnx", "digits_deploy_model.onnx"]
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(1))
    assert len(result.table) == quantizer_calls(digits_qdq, x)
    qdq = onnx.load(result.artifacts["onnx"])
    ops = [node.op_type for node in qdq.graph.node]
    assert ops.count("QuantizeLinear") == ops.count("DequantizeLinear") == len(result.table)
    deploy = onnx.load(result.artifacts["deploy_onnx"])
    assert not {"QuantizeLinear", "DequantizeLinear"} & {node.op_type for node in deploy.graph.node}
    report = verify_deploy(digits_qdq, result, x)
    art = report.artifacts["onnx"]
    assert set(art.per_tensor) == set(result.table)
    assert report.max_lsb_diff <= 1
    assert art.tensor_exact_fraction >= 0.99
    # The float output, from the runtime's own quantized input: the same Gemm, float32 rounding apart.
    with torch.no_grad():
        reference = digits_qdq(x)
    assert art.local_outputs["output"].max_abs_diff <= 1e-5 * reference.abs().max().item()
    # End to end, a 1-LSB flip upstream may move the logits; they stay close.
    assert report.max_abs_diff <= 0.01 * reference.abs().max().item()


def test_weights_are_clipped_and_the_float_model_reproduces_fake_quantized_weights(digits_qdq, tmp_path):
    result = convert_deploy(digits_qdq, "qdq", {"x": SHAPE}, output_path=tmp_path)
    deploy = onnx.load(result.artifacts["deploy_onnx"])
    weights = {init.name: onnx.numpy_helper.to_array(init) for init in deploy.graph.initializer}
    for tensor, entry in result.table.weights().items():
        w = weights[tensor].astype(np.float64)
        scale = entry.scale.astype(np.float64).reshape([-1] + [1] * (w.ndim - 1))
        zero = entry.zero_point.astype(np.float64).reshape(scale.shape)
        low, high = (entry.quant_min - zero) * scale, (entry.quant_max - zero) * scale
        ulp = np.spacing(np.abs(high).astype(np.float32)).astype(np.float64)  # the bound is a float32 product
        assert np.all(w >= low - ulp), tensor
        assert np.all(w <= high + ulp), tensor
        assert np.any(np.isclose(w, low, rtol=0, atol=ulp.max()) | np.isclose(w, high, rtol=0, atol=ulp.max()))
        # Quantizing the deployed weight gives integers inside the range (the formula, written here).
        q = np.round(w / scale) + zero
        assert q.min() >= entry.quant_min and q.max() <= entry.quant_max


def test_export_options_reach_torch_onnx_export(digits_qdq, tmp_path):
    result = convert_deploy(
        digits_qdq,
        "qdq",
        {"image": SHAPE},
        output_path=tmp_path,
        output_names=["logits"],
        dynamic_axes={"image": {0: "batch"}, "logits": {0: "batch"}},
        opset_version=18,
    )
    model = onnx.load(result.artifacts["onnx"])
    assert [v.name for v in model.graph.input] == ["image"]
    assert [v.name for v in model.graph.output] == ["logits"]
    assert max(op.version for op in model.opset_import if op.domain in ("", "ai.onnx")) == 18
    session = ort_session(model)
    x = torch.randn(5, 1, 8, 8)
    (logits,) = session.run(None, {"image": x.numpy()})
    with torch.no_grad():
        reference = digits_qdq(x).numpy()
    assert logits.shape == (5, 10)  # the dynamic batch axis
    # End to end (a 1-LSB rounding flip upstream may move the logits a little).
    np.testing.assert_allclose(logits, reference, atol=0.01 * np.abs(reference).max())


def test_dict_outputs_and_quantized_network_outputs_have_entries(tmp_path):
    torch.manual_seed(0)
    qmodel = calibrated(two_head_detector(num_classes=3), "tengine_u8", shape=[2, 3, 32, 32])
    result = convert_deploy(qmodel, "tengine_u8", {"x": [2, 3, 32, 32]}, output_path=tmp_path)
    assert len(result.output_names) == 2
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    assert len(result.table) == quantizer_calls(qmodel, x)
    quantized_outputs = {out for entry in result.table.values() for out in entry.extra.get("outputs", ())}
    assert quantized_outputs == set(result.output_names)  # tengine quantizes the network outputs
    report = verify_deploy(qmodel, result, x)
    for art in report.artifacts.values():
        assert art.max_lsb_diff <= 1, art.artifact
        assert set(art.outputs) == set(result.output_names)
        assert all(diff.max_lsb_diff is not None for diff in art.outputs.values())


def test_uncalibrated_model_names_its_quantizers(tmp_path):
    qmodel = prepare_by_platform(DigitsCNN().eval(), "qdq")
    with pytest.raises(UncalibratedError, match=r"x_post_act_fake_quantizer.*enable_calibration"):
        convert_deploy(qmodel, "qdq", {"x": SHAPE}, output_path=tmp_path)
    assert os.listdir(tmp_path) == []


def test_bad_output_path_and_names_raise_clear_errors(digits_qdq, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("user data")
    with pytest.raises(ValueError, match="output_path"):
        convert_deploy(digits_qdq, "qdq", {"x": SHAPE}, output_path=blocker)
    assert blocker.read_text() == "user data"
    with pytest.raises(ValueError, match="model_name"):
        convert_deploy(digits_qdq, "qdq", {"x": SHAPE}, output_path=tmp_path, model_name="../escape")
    with pytest.raises(ValueError, match="input_shape_dict"):
        convert_deploy(digits_qdq, "qdq", {"x": [1, -1, 8, 8]}, output_path=tmp_path)
    with pytest.raises(ValueError, match="input_shape_dict"):
        convert_deploy(digits_qdq, "qdq", output_path=tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["a_file"]


def test_a_bad_input_shape_fails_cleanly_without_leaving_files(digits_qdq, tmp_path):
    with pytest.raises(RuntimeError, match=r"does not run on inputs of shapes \[\[1, 3, 8, 8\]\]: .*channels"):
        convert_deploy(digits_qdq, "qdq", {"x": [1, 3, 8, 8]}, output_path=tmp_path)
    assert os.listdir(tmp_path) == []


def test_verify_names_a_shape_the_deployment_does_not_take(digits_qdq, tmp_path):
    result = convert_deploy(digits_qdq, "qdq", {"x": SHAPE}, output_path=tmp_path)
    with pytest.raises(ValueError, match=r"input 'x' of shape \[2, 1, 8, 8\].*dynamic_axes"):
        verify_deploy(digits_qdq, result, torch.randn(3, 1, 8, 8))


def test_register_deploy_function_adds_and_replaces_steps(digits_qdq, tmp_path):
    def summary(context: DeployContext):
        path = context.path("_summary.json")
        path.write_text(json.dumps({"tensors": sorted(context.table)}))
        return path

    register_deploy_function("qdq", "summary")(summary)
    try:
        with pytest.raises(ValueError, match="replace=True"):
            register_deploy_function("qdq", "summary")(summary)
        with pytest.raises(ValueError, match="replace=True"):
            register_deploy_function("qdq", "onnx")(summary)
        result = convert_deploy(digits_qdq, "qdq", {"x": SHAPE}, output_path=tmp_path, model_name="m")
        written = json.loads((tmp_path / "m_summary.json").read_text())
        assert result.artifacts["summary"] == str(tmp_path / "m_summary.json")
        assert written["tensors"] == sorted(result.table)
    finally:
        deploy_functions.unregister("qdq", "summary")
    assert "summary" not in deploy_functions["qdq"]


def test_a_failing_step_leaves_no_partial_artifact_set(digits_qdq, tmp_path):
    def broken(context: DeployContext):
        context.path("_half.txt").write_text("half")
        raise OSError("disk full")

    register_deploy_function("qdq", "broken")(broken)
    try:
        with pytest.raises(OSError, match="disk full"):
            convert_deploy(digits_qdq, "qdq", {"x": SHAPE}, output_path=tmp_path, model_name="m")
    finally:
        deploy_functions.unregister("qdq", "broken")
    assert os.listdir(tmp_path) == []


def test_disabled_quantizers_deploy_as_float(tmp_path):
    torch.manual_seed(0)
    qmodel = calibrated(DigitsCNN(), "qdq")
    qmodel.conv2.weight_fake_quant.disable_fake_quant()
    x = torch.randn(SHAPE)
    result = convert_deploy(qmodel, "qdq", {"x": SHAPE}, output_path=tmp_path)
    assert "conv2.weight" not in result.table
    assert len(result.table) == quantizer_calls(qmodel, x) - 1  # the hook also counts the disabled one
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = verify_deploy(qmodel, result, x)
    assert report.max_lsb_diff <= 1


def test_ops_without_an_integer_kernel_stay_float_with_a_warning_naming_them(tmp_path):
    from mqbench.deploy.qlinear import float_ops

    class Upsampler(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(1, 4, 3, padding=1)
            self.up = nn.ConvTranspose2d(4, 2, 2, stride=2)

        def forward(self, x):
            return self.up(torch.relu(self.conv(x)))

    torch.manual_seed(0)
    qmodel = calibrated(Upsampler(), "onnx_qnn")
    with pytest.warns(UserWarning, match=r"run in float .*ConvTranspose"):
        result = convert_deploy(qmodel, "onnx_qnn", {"x": SHAPE}, output_path=tmp_path)
    qlinear = onnx.load(result.artifacts["qlinear_onnx"])
    assert [node.op_type for node in float_ops(qlinear)] == ["ConvTranspose"]
    assert [node.op_type for node in qlinear.graph.node].count("QLinearConv") == 1
    report = verify_deploy(qmodel, result, torch.randn(SHAPE))
    assert report.max_lsb_diff <= 1


@pytest.mark.parametrize("given", ["spec", "name"])
def test_an_unregistered_backend_spec_deploys_and_verifies(given, tmp_path):
    """A BackendSpec passed directly (not registered) is resolved once at prepare and carried by the plan and the
    DeployResult: deploying it (the spec, or its name, which the plan resolves) and verifying need no registry."""
    spec = dataclasses.replace(ParamsTable["tensorrt"], name="my_tensorrt")
    assert "my_tensorrt" not in ParamsTable
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 4)).eval()
    x = torch.randn(4, 3, 8, 8)
    qmodel = prepare_by_platform(model, spec)
    assert plan_of(qmodel).spec is spec
    enable_calibration(qmodel)
    qmodel(x)
    enable_quantization(qmodel)
    result = convert_deploy(qmodel, spec if given == "spec" else "my_tensorrt", dummy_input=x, output_path=tmp_path)
    assert result.backend == "my_tensorrt" and result.backend_spec is spec
    assert {"clip_ranges", "calib_cache"} <= set(result.artifacts)  # the spec's own writers
    report = verify_deploy(qmodel, result, x)
    assert report.passed, report.failures()
