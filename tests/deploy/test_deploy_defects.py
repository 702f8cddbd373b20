"""convert_deploy on what users pass it: identity shortcuts on every backend, the float model, a model
prepared for another backend, keyword inputs, failures in a new folder, reduced-range weights."""

from __future__ import annotations

import os

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper
from torch import nn

from backend_configs import config_for
from mqbench.convert_deploy import convert_deploy
from mqbench.deploy.verify import verify_deploy
from mqbench.prepare_by_platform import BackendType, prepare_by_platform
from mqbench.utils.state import enable_calibration, enable_quantization

BACKENDS = [backend.value for backend in BackendType]
SHAPE = [2, 3, 16, 16]


class IdentityShortcut(nn.Module):
    """A stem conv + ReLU feeding a block (conv, bn, relu, conv) and a shortcut: ``block(x) + shortcut(x)``."""

    def __init__(self, shortcut: nn.Module) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
        self.block = nn.Sequential(
            nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1)
        )
        self.short = shortcut
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))

    def forward(self, x):
        x = self.stem(x)
        return self.head(self.block(x) + self.short(x))


def calibrated(model: nn.Module, backend: str, shape=SHAPE, config: dict | None = None) -> nn.Module:
    qmodel = prepare_by_platform(model.eval(), backend, config if config is not None else config_for(backend))
    enable_calibration(qmodel)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _ in range(3):
            qmodel(torch.randn(shape, generator=generator))
    enable_quantization(qmodel)
    return qmodel


@pytest.mark.parametrize("shortcut", ["identity", "dropout"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_identity_shortcuts_deploy_and_match_the_simulation_on_every_backend(backend, shortcut, tmp_path):
    torch.manual_seed(0)
    model = IdentityShortcut(nn.Identity() if shortcut == "identity" else nn.Dropout(0.2))
    qmodel = calibrated(model, backend)
    result = convert_deploy(qmodel, backend, {"x": SHAPE}, output_path=tmp_path)
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(1))
    report = verify_deploy(qmodel, result, x)
    assert report.max_lsb_diff <= (2 if backend in ("nnie", "vitis") else 1)  # their coarse grids: 2


# -- what was passed ------------------------------------------------------------------------------
def small() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU()).eval()


def test_a_model_without_quantizers_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"has no fake quantizers: convert_deploy takes the model returned by prepare"):
        convert_deploy(small(), "qdq", {"x": [1, 1, 8, 8]}, output_path=tmp_path)
    assert os.listdir(tmp_path) == []


def test_deploying_for_another_backend_needs_an_explicit_override(tmp_path):
    qmodel = calibrated(small(), "tensorrt", shape=[2, 1, 8, 8])
    with pytest.raises(ValueError, match=r"prepared for backend 'tensorrt' but is deployed for 'openvino'.*allow_"):
        convert_deploy(qmodel, "openvino", {"x": [1, 1, 8, 8]}, output_path=tmp_path)
    assert os.listdir(tmp_path) == []
    result = convert_deploy(qmodel, "qdq", {"x": [1, 1, 8, 8]}, output_path=tmp_path, allow_backend_mismatch=True)
    assert result.backend == "qdq"
    assert convert_deploy(qmodel, BackendType.Tensorrt, {"x": [1, 1, 8, 8]}, output_path=tmp_path).backend == "tensorrt"


# -- keyword inputs -------------------------------------------------------------------------------
class TinyEncoder(nn.Module):
    """Token ids and a mask, as a tokenizer returns them (``model(**encoded_input)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.linear = nn.Linear(8, 8)
        self.out = nn.Linear(8, 3)

    def forward(self, input_ids, attention_mask):
        hidden = self.linear(self.embed(input_ids)) * attention_mask.unsqueeze(-1)
        return self.out(torch.relu(hidden))


def encoded(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    mask = torch.ones(2, 5)
    mask[1, 3:] = 0
    return {"input_ids": torch.randint(0, 20, (2, 5), generator=generator), "attention_mask": mask}


def calibrated_encoder() -> nn.Module:
    torch.manual_seed(0)
    qmodel = prepare_by_platform(TinyEncoder().eval(), "tensorrt_nlp")
    enable_calibration(qmodel)
    with torch.no_grad():
        for seed in range(3):
            qmodel(**encoded(seed))
    enable_quantization(qmodel)
    return qmodel


def test_a_tuple_ending_in_a_dict_gives_keyword_inputs(tmp_path):
    qmodel = calibrated_encoder()
    result = convert_deploy(qmodel, "tensorrt_nlp", dummy_input=(encoded(5),), output_path=tmp_path)
    assert result.input_names == ["input_ids", "attention_mask"]
    deployed = onnx.load(result.artifacts["onnx"])
    assert [v.name for v in deployed.graph.input] == ["input_ids", "attention_mask"]
    report = verify_deploy(qmodel, result, encoded(7))
    assert report.max_lsb_diff <= 1
    # a positional input, then the rest by keyword (torch.onnx.export's form)
    inputs = encoded(5)
    mixed = convert_deploy(
        qmodel,
        "tensorrt_nlp",
        dummy_input=(inputs["input_ids"], {"attention_mask": inputs["attention_mask"]}),
        output_path=tmp_path / "mixed",
    )
    assert mixed.input_names == ["input_ids", "attention_mask"]


def test_keyword_inputs_that_the_forward_does_not_take_are_named(tmp_path):
    qmodel = calibrated_encoder()
    with pytest.raises(ValueError, match=r"\['token_type_ids'\] are not parameters.*\['input_ids', 'attention_mask'\]"):
        convert_deploy(qmodel, "tensorrt_nlp", dummy_input=({**encoded(0), "token_type_ids": torch.zeros(2, 5)},))
    with pytest.raises(ValueError, match=r"not \['input_ids'\], which come before them"):
        convert_deploy(qmodel, "tensorrt_nlp", dummy_input=({"attention_mask": torch.ones(2, 5)},))


# -- failures leave no folder behind ----------------------------------------------------------------
def test_a_failed_deploy_removes_the_folder_it_created_and_nothing_else(tmp_path):
    uncalibrated = prepare_by_platform(small(), "qdq")
    target = tmp_path / "new" / "nested"
    with pytest.raises(RuntimeError, match="never calibrated"):
        convert_deploy(uncalibrated, "qdq", {"x": [1, 1, 8, 8]}, output_path=target)
    assert os.listdir(tmp_path) == []
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "notes.txt").write_text("user data")
    with pytest.raises(RuntimeError, match="never calibrated"):
        convert_deploy(uncalibrated, "qdq", {"x": [1, 1, 8, 8]}, output_path=existing / "out")
    assert sorted(os.listdir(tmp_path)) == ["existing"]
    assert os.listdir(existing) == ["notes.txt"]
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(RuntimeError, match="never calibrated"):
        convert_deploy(uncalibrated, "qdq", {"x": [1, 1, 8, 8]}, output_path=empty)
    assert empty.is_dir()  # it existed before: kept


# -- reduce_range ---------------------------------------------------------------------------------
def test_reduce_range_weights_deploy_within_7_bits_and_match_the_simulation(tmp_path):
    torch.manual_seed(0)
    qmodel = calibrated(IdentityShortcut(nn.Identity()), "qdq", config={"reduce_range": True})
    result = convert_deploy(qmodel, "qdq", {"x": SHAPE}, output_path=tmp_path)
    model = onnx.load(result.artifacts["onnx"])
    initializers = {init.name: numpy_helper.to_array(init) for init in model.graph.initializer}
    checked = 0
    for node in model.graph.node:
        if node.op_type != "QuantizeLinear" or node.input[0] not in initializers:
            continue
        weight = initializers[node.input[0]].astype(np.float64)
        if weight.ndim < 2:
            continue  # a bias or a scalar
        axis = next((a.i for a in node.attribute if a.name == "axis"), 1)
        scale = initializers[node.input[1]].astype(np.float64)
        zero = initializers[node.input[2]].astype(np.float64)
        shape = [1] * weight.ndim
        shape[axis] = -1
        q = np.round(weight / scale.reshape(shape if scale.size > 1 else [])) + zero.reshape(
            shape if zero.size > 1 else []
        )
        assert q.min() >= -64 and q.max() <= 63, node.input[0]
        checked += 1
    assert checked == 4  # stem, two block convs, head linear
    weights = result.table.weights()
    assert weights and all((entry.quant_min, entry.quant_max) == (-64, 63) for entry in weights.values())
    report = verify_deploy(qmodel, result, torch.randn(SHAPE, generator=torch.Generator().manual_seed(1)))
    assert report.max_lsb_diff <= 1


@pytest.mark.parametrize("backend", [backend.value for backend in BackendType])
def test_reduce_range_config_applies_where_weights_are_8_bit_linear_and_prepares_everywhere(backend):
    """What `mqbench verify --reduce-range` and the demo apply: 7-bit weights where that is possible."""
    from mqbench.app.check import reduce_range_config
    from mqbench.backends import resolve_backend

    spec = resolve_backend(backend)
    config = reduce_range_config(spec, config_for(backend))
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.ReLU(), nn.Conv2d(4, 2, 3)).eval()
    qmodel = prepare_by_platform(model, backend, config)  # never refused
    grids = {(m.quant_min, m.quant_max) for n, m in qmodel.named_modules() if n.endswith("weight_fake_quant")}
    if backend == "nnie":  # a log grid: unchanged
        assert "reduce_range" not in config
    else:
        assert config["reduce_range"] is True
        assert grids <= {(-64, 63), (0, 127)}, grids


class TwoConvs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv2d(3, 4, 3)
        self.d = nn.Conv2d(4, 4, 1)

    def forward(self, x):
        return self.d(torch.relu(self.c(x)))


@pytest.mark.parametrize("backend", ["tensorrt", "openvino"])  # backends whose last layer's output stays float
def test_an_artifact_that_computes_nan_fails_verification_and_says_so(backend, tmp_path):
    """NaN compares unequal to everything, so a difference measured with it is NaN and no bound catches it: verify
    counts non-finite values on both sides and fails on any, naming the tensor."""
    torch.manual_seed(0)
    qmodel = calibrated(TwoConvs(), backend, [2, 3, 8, 8])
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    result = convert_deploy(qmodel, backend, dummy_input=x, output_path=tmp_path)
    assert verify_deploy(qmodel, result, x, host=False).passed
    key = "openvino_onnx" if backend == "openvino" else "onnx"
    written = onnx.load(result.artifacts[key])
    (bias,) = [init for init in written.graph.initializer if init.name.endswith("d.bias")]
    values = numpy_helper.to_array(bias).copy()
    values[0] = np.nan  # the last layer's bias: its float output channel 0 becomes NaN in the file only
    bias.CopyFrom(numpy_helper.from_array(values, bias.name))
    onnx.save(written, result.artifacts[key])
    failures = verify_deploy(qmodel, result, x, host=False).failures()
    assert any(f.startswith(f"{key}:") and "non-finite" in f for f in failures), failures
    (line,) = [f for f in failures if f.startswith(f"{key}:")]
    assert "72 non-finite value(s) in the runtime's result, 0 in the simulation's" in line, line  # 2 x 1 x 6 x 6


def test_a_simulation_that_computes_nan_is_not_a_verified_result(tmp_path):
    class LogOfConv(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c = nn.Conv2d(3, 4, 3)

        def forward(self, x):
            return torch.log(self.c(x))  # NaN wherever the convolution is negative, in the simulation and the file

    torch.manual_seed(0)
    qmodel = calibrated(LogOfConv(), "tensorrt", [2, 3, 8, 8])
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    result = convert_deploy(qmodel, "tensorrt", dummy_input=x, output_path=tmp_path)
    failures = verify_deploy(qmodel, result, x, host=False).failures()
    assert failures, "a NaN output compared equal to itself"
    assert all("non-finite" in f and "in the simulation's" in f for f in failures), failures


class UnusedText(nn.Module):
    """A recognizer's forward with an argument used only in training: ``forward(input, text)``."""

    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv2d(3, 4, 3)

    def forward(self, input, text):
        return self.c(input)


def test_an_argument_fixed_at_prepare_is_left_out_of_the_call_and_the_deployment(tmp_path):
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    qmodel = prepare_by_platform(UnusedText().eval(), "tensorrt", {"concrete_args": {"text": None}})
    enable_calibration(qmodel)
    with torch.no_grad():
        qmodel(x)  # the fixed argument defaults to its value
    enable_quantization(qmodel)
    result = convert_deploy(qmodel, "tensorrt", dummy_input=x, output_path=tmp_path)
    assert len(result.input_names) == 1 and len(onnx.load(result.artifacts["onnx"]).graph.input) == 1
    assert verify_deploy(qmodel, result, x, host=False).passed
    unfixed = prepare_by_platform(UnusedText().eval(), "tensorrt")
    with pytest.raises(TypeError):  # without it the argument is required, as in the model
        unfixed(x)
    with pytest.raises(ValueError, match=r"argument 1 \('text'\) is None.*'concrete_args': \{'text': None\}"):
        convert_deploy(unfixed, "tensorrt", dummy_input=(x, None), output_path=tmp_path / "unfixed")
