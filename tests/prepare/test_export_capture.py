"""Capture with torch.export: the same prepared model as torch.fx where both trace, and the models fx cannot."""

from __future__ import annotations

import onnx
import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn

from backend_configs import config_for, host_config
from mqbench.convert_deploy import convert_deploy
from mqbench.deploy.verify import verify_deploy
from mqbench.models import bert_tiny
from mqbench.models.zoo import zoo_model
from mqbench.prepare_by_platform import BackendType, prepare_by_platform
from mqbench.utils.export_capture import CaptureError
from mqbench.utils.state import disable_all, enable_calibration, enable_quantization
from mqbench.utils.tracer import TracingError

BACKENDS = [backend.value for backend in BackendType]


def _calibrated(model: nn.Module, backend: str, config: dict, *inputs: torch.Tensor) -> torch.fx.GraphModule:
    qmodel = prepare_by_platform(model, backend, config)
    enable_calibration(qmodel)
    with torch.no_grad():
        qmodel(*inputs)
    enable_quantization(qmodel)
    return qmodel


def _both(name: str, backend: str) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule, torch.Tensor]:
    zoo = zoo_model(name)
    x = zoo.calibration[:8]
    base = dict(config_for(backend) or {})
    traced = _calibrated(zoo.model, backend, {**base, "capture": "fx"}, x)
    exported = _calibrated(zoo.model, backend, {**base, "capture": "export", "example_inputs": (x,)}, x)
    return traced, exported, zoo.evaluation[:4]


CASES = [("resnet18", b) for b in BACKENDS]
CASES += [("mobilenet_v2", b) for b in ("tensorrt", "openvino", "snpe", "academic", "tengine_u8", "qdq")]
CASES += [(name, b) for name in ("unet", "detector", "vit") for b in ("tensorrt", "openvino", "academic")]


@pytest.mark.parametrize(("name", "backend"), CASES)
def test_export_prepares_the_model_fx_prepares(name, backend):
    """Where both capture a zoo model, the prepared models have the same modules (BatchNorm folded into the same
    convolutions, the same weight quantizers) and compute the same values bit for bit after the same calibration.
    Activation quantizers are named after the node they follow: those after module calls are the same; after a
    slice, the counter of torch.fx's ``getitem`` names may differ (fx also names its shape lookups so)."""
    traced, exported, x = _both(name, backend)
    assert exported.mqbench_capture == "export" and traced.mqbench_capture == "fx"
    fx_modules = {n for n, _ in traced.named_modules() if "getitem" not in n}
    export_modules = {n for n, _ in exported.named_modules() if "getitem" not in n}
    assert fx_modules == export_modules, (sorted(fx_modules ^ export_modules))[:6]
    fx_types, export_types = dict(traced.named_modules()), dict(exported.named_modules())
    assert all(type(fx_types[n]) is type(export_types[n]) for n in fx_modules if n), "a module of another type"
    with torch.no_grad():
        expected, got = pytree.tree_leaves(traced(x)), pytree.tree_leaves(exported(x))
    assert all(torch.equal(e, g) for e, g in zip(expected, got, strict=True))


@pytest.mark.parametrize("backend", ["openvino", "snpe"])  # the runtimes whose depthwise kernels need care
def test_an_exported_depthwise_network_deploys_and_verifies(backend, tmp_path):
    zoo = zoo_model("mobilenet_v2")
    x = zoo.calibration[:8]
    config = {**(host_config(backend) or {}), "capture": "export", "example_inputs": (x,)}
    qmodel = _calibrated(zoo.model, backend, config, x)
    result = convert_deploy(qmodel, backend, dummy_input=x[:2], output_path=tmp_path)
    dims = onnx.load(result.artifacts["deploy_onnx"]).graph.input[0].type.tensor_type.shape.dim
    assert [d.dim_param or d.dim_value for d in dims] == ["batch", 3, 32, 32]  # the batch export kept dynamic
    report = verify_deploy(qmodel, result, zoo.evaluation[:3])  # deployed for 2 images, verified on 3
    assert report.passed, report.failures()


class SamePadding(nn.Module):
    """A stride-2 convolution with padding worked out from the input size, as TensorFlow's "SAME" (timm's
    ``tf_`` models): torch.fx cannot trace the control flow on the size."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, stride=2)
        self.bn = nn.BatchNorm2d(8)
        self.act = nn.ReLU6()
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        height, width = x.shape[-2:]
        pad_h = max((-(height // -2) - 1) * 2 + 3 - height, 0)
        pad_w = max((-(width // -2) - 1) * 2 + 3 - width, 0)
        if pad_h > 0 or pad_w > 0:
            x = F.pad(x, [pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2])
        return self.fc(F.adaptive_avg_pool2d(self.act(self.bn(self.conv(x))), 1).flatten(1))


def _same_padding() -> SamePadding:
    torch.manual_seed(0)
    model = SamePadding()
    with torch.no_grad():
        model.bn.running_mean.uniform_(-0.5, 0.5)
        model.bn.running_var.uniform_(0.5, 2.0)
    return model.eval()


def test_without_example_inputs_the_fx_error_names_export():
    with pytest.raises(TracingError, match=r"example_inputs.*torch\.export where torch\.fx fails"):
        prepare_by_platform(_same_padding(), "tensorrt")


@pytest.mark.parametrize("backend", ["tensorrt", "openvino", "snpe"])
def test_auto_captures_what_fx_cannot_with_export_and_it_verifies(backend, tmp_path):
    model = _same_padding()
    x = torch.randn(8, 3, 17, 17, generator=torch.Generator().manual_seed(1))
    qmodel = _calibrated(model, backend, {**(host_config(backend) or {}), "example_inputs": x}, x)
    assert qmodel.mqbench_capture == "export"
    assert type(qmodel.get_submodule("conv")).__name__.startswith("ConvBn") or not hasattr(qmodel, "bn")
    assert not any(isinstance(m, nn.BatchNorm2d) for m in qmodel.modules())  # folded into the convolution
    assert hasattr(qmodel.get_submodule("conv"), "weight_fake_quant")
    with torch.no_grad():
        enable_quantization(qmodel)
        float_out = model(x)
        rel = (qmodel(x) - float_out).norm() / float_out.norm()
    assert rel < 0.05, float(rel)
    result = convert_deploy(qmodel, backend, dummy_input=x[:2], output_path=tmp_path)
    report = verify_deploy(qmodel, result, x[:2])
    assert report.passed, report.failures()


def test_an_exported_encoder_takes_keyword_inputs_other_shapes_and_verifies(tmp_path):
    """A dict of keyword inputs (as a Hugging Face model is called); batch and sequence length stay dynamic, so
    the prepared model runs on other shapes; with padding in the mask it deploys and verifies."""
    torch.manual_seed(0)
    model = bert_tiny(vocab_size=50, dim=32, depth=2, heads=2, max_len=16).eval()
    ids = torch.randint(0, 50, (4, 12), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(4, 12, dtype=torch.long)
    mask[1, 8:] = 0
    config = {"capture": "export", "example_inputs": {"input_ids": ids, "attention_mask": mask}}
    qmodel = _calibrated(model, "tensorrt_nlp", config, ids, mask)
    other_ids, other_mask = ids[:3, :9], mask[:3, :9]
    with torch.no_grad():
        assert qmodel(other_ids, other_mask).shape == (3, 2)
        rel = (qmodel(ids, mask) - model(ids, mask)).norm() / model(ids, mask).norm()
    assert rel < 0.1, float(rel)
    result = convert_deploy(qmodel, "tensorrt_nlp", dummy_input=(ids, mask), output_path=tmp_path)
    report = verify_deploy(qmodel, result, (ids, mask))
    assert report.passed, report.failures()


def test_an_exported_model_trains_with_batchnorm_that_follows_the_mode():
    """Captured from a model in training mode: the BatchNorm is the model's module again (export bakes the mode
    into its graph), folded for QAT; it updates its statistics in train() and uses them in eval(), and a QAT
    step computes the same as on the torch.fx capture."""
    zoo = zoo_model("resnet18")
    x = zoo.calibration[:8]
    results = []
    for capture in ("fx", "export"):
        model = zoo.model.train()
        config = {"capture": capture, "example_inputs": (x,)}
        qmodel = _calibrated(model, "tensorrt", config, x)
        qmodel.train()
        conv = qmodel.get_submodule("conv1")
        assert hasattr(conv, "bn") and hasattr(conv, "weight_fake_quant"), type(conv)
        before = conv.bn.running_mean.clone()
        optimizer = torch.optim.SGD(qmodel.parameters(), lr=0.01)
        torch.manual_seed(3)
        loss = F.cross_entropy(qmodel(x), torch.arange(8) % 10)
        loss.backward()
        optimizer.step()
        assert not torch.equal(before, conv.bn.running_mean)
        qmodel.eval()
        with torch.no_grad():
            results.append((float(loss), qmodel(x)))
    zoo.model.eval()
    assert results[0][0] == results[1][0]
    assert torch.equal(results[0][1], results[1][1])


def test_capture_settings_that_cannot_work_are_named():
    model = _same_padding()
    x = torch.randn(2, 3, 17, 17)
    with pytest.raises(ValueError, match="needs prepare_custom_config_dict\\['example_inputs'\\]"):
        prepare_by_platform(model, "tensorrt", {"capture": "export"})
    with pytest.raises(ValueError, match="must be one of"):
        prepare_by_platform(model, "tensorrt", {"capture": "dynamo", "example_inputs": x})
    with pytest.raises(ValueError, match=r"concrete_args are torch\.fx's"):
        prepare_by_platform(model, "tensorrt", {"capture": "export", "example_inputs": x, "concrete_args": {"y": 1}})
    with pytest.raises(ValueError, match="a tensor, a tuple"):
        prepare_by_platform(model, "tensorrt", {"capture": "export", "example_inputs": 3})


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # a branch on the values: neither capture can keep it
            return self.conv(x)
        return x


def test_a_model_neither_capture_can_take_gets_both_reasons_and_the_fixes():
    with pytest.raises(CaptureError) as caught:
        prepare_by_platform(DataDependent(), "tensorrt", {"example_inputs": torch.randn(1, 3, 4, 4)})
    message = str(caught.value)
    assert "torch.fx could not trace" in message and "torch.export could not capture DataDependent" in message
    assert "leaf_module" in message


def test_prepare_fx_captures_what_fx_cannot_with_export_and_it_deploys(tmp_path):
    """The BackendConfig front end: prepare_fx falls back to torch.export on its example inputs, and the result
    quantizes the layers prepare_by_platform's export capture quantizes, then deploys and verifies."""
    from mqbench.backend_config import get_backend_config, get_qconfig_mapping, prepare_fx

    model = _same_padding()
    x = torch.randn(8, 3, 17, 17, generator=torch.Generator().manual_seed(1))
    prepared = prepare_fx(model, get_qconfig_mapping("tensorrt"), (x,), backend_config=get_backend_config("tensorrt"))
    assert hasattr(prepared.get_submodule("conv"), "weight_fake_quant")
    assert not any(isinstance(m, nn.BatchNorm2d) for m in prepared.modules())
    with torch.no_grad():
        prepared(x)
    enable_quantization(prepared)
    result = convert_deploy(prepared, "tensorrt", dummy_input=x[:2], output_path=tmp_path)
    report = verify_deploy(prepared, result, x[:2])
    assert report.passed, report.failures()


def test_the_report_says_the_model_was_captured_with_export():
    from mqbench.backend_config import quantization_report

    x = torch.randn(2, 3, 17, 17)
    exported = prepare_by_platform(_same_padding(), "tensorrt", {"example_inputs": x})
    traced = prepare_by_platform(zoo_model("resnet18").model, "tensorrt")
    assert quantization_report(exported).splitlines()[-1] == "captured with torch.export"
    assert "torch.export" not in quantization_report(traced)


class FunctionalDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.dropout(F.relu(self.fc1(x)), 0.5, self.training))


@pytest.mark.parametrize("training", [True, False])
def test_a_functional_dropout_follows_the_mode_after_export(training):
    """export bakes ``self.training`` into a functional dropout; the prepared model's dropout follows train() /
    eval() as the model's own code does, whichever mode it was captured in."""
    torch.manual_seed(0)
    model = FunctionalDropout().train(training)
    x = torch.randn(64, 16)
    qmodel = prepare_by_platform(model, "tensorrt", {"capture": "export", "example_inputs": x})
    enable_calibration(qmodel)
    with torch.no_grad():
        qmodel.eval()(x)
        qmodel.train()
        dropped = qmodel(x) - qmodel(x)  # two draws of the dropout mask
        qmodel.eval()
        assert torch.equal(qmodel(x), qmodel(x)) and torch.allclose(qmodel(x), model.eval()(x), atol=1e-6)
    assert dropped.abs().max() > 0


class PositionEncoded(nn.Module):
    """Token embeddings plus a sinusoidal position encoding computed in forward (no sentinel in it), then an
    additive -10000 mask on the scores: ranges like any other, quantized as torch.fx's capture quantizes them."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.q, self.k = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], dtype=torch.float32)[:, None]
        encoding = torch.sin(positions / 10 ** (torch.arange(16) / 16))
        h = self.embed(input_ids) + encoding
        scores = self.q(h) @ self.k(h).transpose(1, 2) + (1.0 - attention_mask[:, None, :].float()) * -10000.0
        return scores.softmax(-1) @ h


def test_a_position_encoding_and_a_finite_mask_are_quantized_as_fx_quantizes_them():
    ids = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids, "attention_mask": torch.ones(2, 6, dtype=torch.long)}
    names = {}
    for capture in ("fx", "export"):
        qmodel = prepare_by_platform(
            PositionEncoded().eval(), "tensorrt", {"capture": capture, "example_inputs": inputs}
        )
        names[capture] = sorted(n for n, _ in qmodel.named_modules() if n.endswith("post_act_fake_quantizer"))
    assert names["fx"] == names["export"] and any(n.startswith("add") for n in names["export"]), names


class WrittenMask(nn.Module):
    """Attention whose padding mask is written into a view of a zero tensor, as OPT builds its mask:
    ``whole`` one slice with a traced end, ``chain`` a slice of a slice, ``select`` one head by an integer."""

    def __init__(self, form: str):
        super().__init__()
        self.form = form
        self.embed = nn.Embedding(20, 16)
        self.qkv = nn.Linear(16, 48)
        self.out = nn.Linear(16, 4)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        length = ids.shape[1]
        bias = torch.zeros(ids.shape[0], 2, length, length)
        padded = (mask[:, None, None, :] == 0).expand(-1, 2, length, -1)
        filled = bias[:, :, :, :length].masked_fill(padded, torch.finfo(x.dtype).min)
        if self.form == "whole":
            bias[:, :, :, :length] = filled
        elif self.form == "chain":
            view = bias[0:]
            view[:, :, 0:] = filled
        else:
            bias[:, 0] = filled[:, 0]
            bias[:, 1] = filled[:, 1]
        scores = (q @ k.transpose(-1, -2)).unsqueeze(1) + bias
        return self.out((scores.softmax(-1) @ v.unsqueeze(1)).mean(1))


@pytest.mark.parametrize("form", ["whole", "chain", "select"])
def test_a_mask_written_into_a_view_reaches_the_deployed_file(form, tmp_path):
    """export records ``bias[...] = filled`` as ATen copies into views, which the ONNX exporter dropped (the file
    had no mask input and attended to padding): capture writes them as one assignment to the base tensor."""
    torch.manual_seed(0)
    model = WrittenMask(form).eval()
    ids = torch.randint(0, 20, (4, 9), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(4, 9, dtype=torch.long)
    mask[1, 5:] = 0
    mask[3, 2:] = 0
    qmodel = _calibrated(model, "tensorrt", {"capture": "export", "example_inputs": (ids, mask)}, ids, mask)
    with torch.no_grad():
        unmasked = model(ids, torch.ones_like(mask))
        assert not torch.allclose(model(ids, mask)[1], unmasked[1])  # the mask changes what a padded row computes
    result = convert_deploy(qmodel, "tensorrt", dummy_input=(ids, mask), output_path=tmp_path)
    inputs = [i.name for i in onnx.load(result.artifacts["deploy_onnx"]).graph.input]
    assert len(inputs) == 2, inputs  # the mask is an input of the file
    report = verify_deploy(qmodel, result, (ids[:3, :7], mask[:3, :7]))
    assert report.passed, report.failures()


def test_a_finfo_min_mask_is_written_finite_and_the_float_model_computes_the_same():
    """``finfo.min`` in mask arithmetic is written as -1e30 (a runtime that divides the mask by a scale keeps it
    finite). With the quantizers off the prepared model computes what the float model computes, bit for bit, also
    for a sequence whose every key is masked (a uniform softmax row with either value)."""
    torch.manual_seed(0)
    model = WrittenMask("whole").eval()
    ids = torch.randint(0, 20, (3, 6), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(3, 6, dtype=torch.long)
    mask[1, :2] = 0
    mask[2] = 0  # every key masked
    qmodel = prepare_by_platform(model, "tensorrt", {"capture": "export", "example_inputs": (ids, mask)})
    literals = [
        v
        for n in qmodel.graph.nodes
        for v in pytree.tree_leaves((n.args, n.kwargs))
        if isinstance(v, float) and abs(v) > 1e29
    ]
    assert literals and all(v == -1e30 for v in literals), literals
    disable_all(qmodel)
    with torch.no_grad():
        assert torch.equal(qmodel(ids, mask), model(ids, mask))


def test_an_exported_model_takes_reconstruction_and_mixed_widths_and_verifies(tmp_path):
    """What comes after prepare works on an exported model as on a traced one: widths set by ``quantizer_bits``
    are built into the plan, AdaRound reconstruction (the layers found in the exported graph) beats rounding to
    nearest on held-out images, and the result deploys and verifies."""
    from mqbench.advanced_ptq import calibrate, ptq_reconstruction
    from mqbench.custom_quantizer.plan import plan_of

    zoo = zoo_model("resnet18")
    calibration = [zoo.calibration[i : i + 16] for i in range(0, 32, 16)]
    held_out = zoo.evaluation[:32]
    scheme = {"symmetry": False, "per_channel": True, "pot_scale": False}
    config = {
        "capture": "export",
        "example_inputs": (calibration[0],),
        "extra_qconfig_dict": {
            "w_observer": "MSEObserver",
            "a_observer": "EMAMSEObserver",
            "w_fakequantize": "AdaRoundFakeQuantize",
            "a_fakequantize": "FixedFakeQuantize",
            "w_qscheme": {"bit": 4, **scheme},
            "a_qscheme": {"bit": 8, **scheme, "per_channel": False},
        },
        "quantizer_bits": {"layer1.0.conv2.weight_fake_quant": 6},
    }
    errors = []
    for reconstruct in (False, True):
        qmodel = calibrate(prepare_by_platform(zoo.model, "academic", config), calibration)
        assert qmodel.mqbench_capture == "export"
        plan = plan_of(qmodel)
        assert plan is not None
        widths = [plan.widths[f"{layer}.weight_fake_quant"] for layer in ("conv1", "layer1.0.conv1", "layer1.0.conv2")]
        assert widths == [8, 4, 6]  # the first layer 8-bit (academic's edge layers), the rest 4, and the one set
        if reconstruct:
            torch.manual_seed(0)
            recipe = {"pattern": "layer", "max_count": 20, "warm_up": 0.2, "weight": 0.01, "progress": False}
            ptq_reconstruction(qmodel, calibration, recipe)
        with torch.no_grad():
            errors.append(float((qmodel(held_out) - zoo.model(held_out)).pow(2).sum(1).mean()))
    assert errors[1] < errors[0], errors
    result = convert_deploy(qmodel, "academic", {"x": [4, *held_out.shape[1:]]}, output_path=tmp_path)
    report = verify_deploy(qmodel, result, held_out[:4])
    assert report.passed, report.failures()


def test_network_outputs_inside_a_model_output_are_quantized():
    """A Hugging Face model returns a ``ModelOutput``: captured with torch.export, the graph rebuilds it from its
    tensors, and a backend that quantizes the network's outputs (Tengine) quantizes those tensors, not the object."""
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3, padding=1)
            self.fc = nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> BaseModelOutputWithPooling:
            hidden = torch.relu(self.conv(x))
            return BaseModelOutputWithPooling(last_hidden_state=hidden, pooler_output=self.fc(hidden.mean((2, 3))))

    torch.manual_seed(0)
    model, x = Encoder().eval(), torch.randn(4, 3, 8, 8)
    qmodel = _calibrated(model, "tengine_u8", {"capture": "export", "example_inputs": (x,)}, x)
    output = next(n for n in qmodel.graph.nodes if n.op == "output")
    leaves = [n for n in output.all_input_nodes[0].all_input_nodes if n.op != "get_attr"]  # in the fields' order
    assert [n.op for n in leaves] == ["call_module", "call_module"], leaves
    with torch.no_grad():
        out = qmodel(x)
    assert isinstance(out, BaseModelOutputWithPooling)
    for name, leaf in zip(("last_hidden_state", "pooler_output"), leaves, strict=True):
        quantizer = qmodel.get_submodule(str(leaf.target))
        codes = out[name] / quantizer.scale + quantizer.zero_point  # on the uint8 grid: integers in [0, 255]
        assert torch.allclose(codes, codes.round(), atol=1e-3), name
        assert float(codes.min()) >= -1e-3 and float(codes.max()) <= 255 + 1e-3, name
