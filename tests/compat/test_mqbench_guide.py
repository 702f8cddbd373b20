"""MQBench's "add a backend" guide, followed as it is written, with MQBench's names.

The guide's steps: a fake-quantize autograd function with an ONNX ``symbolic``, a ``QuantizeBase``
subclass whose ``forward`` reads the switches itself, an ``ObserverBase`` subclass, the backend added
to ``BackendType``, its scheme to ``ParamsTable`` and its classes to ``FakeQuantizeDict``, a
``ModelQuantizer`` registered with ``register_model_quantizer``, and deploy functions registered with
``register_deploy_function`` (``convert_merge_bn``, ``convert_onnx``, and a step calling
``remove_fakequantize_and_collect_params``). The backend is then prepared, calibrated, deployed and
verified, and the files are checked against the affine formula written here.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn.parameter import Parameter

from mqbench.convert_deploy import convert_deploy, convert_merge_bn, convert_onnx
from mqbench.custom_quantizer import ModelQuantizer
from mqbench.deploy import remove_fakequantize_and_collect_params
from mqbench.deploy.onnx_graph import ort_session
from mqbench.deploy.verify import verify_deploy
from mqbench.fake_quantize.quantize_base import QuantizeBase
from mqbench.observer import ObserverBase
from mqbench.prepare_by_platform import BackendType, FakeQuantizeDict, ObserverDict, ParamsTable, prepare_by_platform
from mqbench.scheme import QuantizeScheme
from mqbench.utils.registry import (
    BACKEND_DEPLOY_FUNCTION,
    DEFAULT_MODEL_QUANTIZER,
    register_deploy_function,
    register_model_quantizer,
)
from mqbench.utils.state import enable_calibration, enable_quantization


# -- FakeQuantize, Observer and quantization scheme (the guide's first section) ------------------------
class ExampleQuant(torch.autograd.Function):
    """Affine fake quantization: clamp(round(x / s) + z, n, p), then back to floats; straight-through."""

    @staticmethod
    def forward(ctx, x, s, z, n, p):
        q = torch.clamp(torch.round(x / s) + z, n, p)
        ctx.save_for_backward(x, s, z)
        ctx.bounds = (n, p)
        return (q - z) * s

    @staticmethod
    def backward(ctx, grad_outputs):
        x, s, z = ctx.saved_tensors
        n, p = ctx.bounds
        inside = ((x / s + z) >= n) & ((x / s + z) <= p)
        return grad_outputs * inside, None, None, None, None

    @staticmethod
    def symbolic(g, x, scale, zero_point, quant_min, quant_max):
        return g.op("::ExampleQuant", x, scale, zero_point, quant_min_i=quant_min, quant_max_i=quant_max)


class ExampleFakeQuantize(QuantizeBase):
    def __init__(self, observer, scale=1.0, zero_point=0.0, use_grad_scaling=True, **observer_kwargs):
        super().__init__(observer, **observer_kwargs)
        self.scale = Parameter(torch.tensor([scale]))
        self.zero_point = Parameter(torch.tensor([zero_point]))

    def forward(self, X):  # noqa: N803  (the guide's code)
        if self.observer_enabled[0] == 1:
            self.activation_post_process(X.detach())
            _scale, _zero_point = self.activation_post_process.calculate_qparams()
            self.scale.data.copy_(_scale)
            self.zero_point.data.copy_(_zero_point.float())
        if self.fake_quant_enabled[0] == 1:
            X = ExampleQuant.apply(X, self.scale, self.zero_point, self.quant_min, self.quant_max)
        return X


class ExampleObserver(ObserverBase):
    """The running range of x, written the guide's way (``forward`` records, ``calculate_qparams`` answers)."""

    def __init__(
        self,
        dtype=torch.quint8,
        qscheme=torch.per_tensor_affine,
        reduce_range=False,
        quant_min=None,
        quant_max=None,
        ch_axis=-1,
        pot_scale=False,
        factory_kwargs=None,
    ):
        super().__init__(dtype, qscheme, reduce_range, quant_min, quant_max, ch_axis, pot_scale, factory_kwargs)

    def forward(self, x_orig):
        x = x_orig.to(self.min_val.dtype)
        self.min_val = torch.minimum(self.min_val, x.min())
        self.max_val = torch.maximum(self.max_val, x.max())
        return x

    def calculate_qparams(self):
        lo, hi = torch.clamp(self.min_val, max=0.0), torch.clamp(self.max_val, min=0.0)
        if self.qscheme in (torch.per_tensor_symmetric, torch.per_channel_symmetric):
            scale = torch.clamp(torch.maximum(-lo, hi) / ((self.quant_max - self.quant_min) / 2), min=1e-8)
            return scale.reshape(1), torch.zeros(1)
        scale = torch.clamp((hi - lo) / (self.quant_max - self.quant_min), min=1e-8)
        zero_point = torch.clamp(self.quant_min - torch.round(lo / scale), self.quant_min, self.quant_max)
        return scale.reshape(1), zero_point.reshape(1)


class ExampleMod(nn.Module):
    """A module the example backend quantizes the input of (the guide's ``ExampleMod``)."""

    def forward(self, x):
        return torch.sigmoid(x) * 2.0


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU()
        self.example = ExampleMod()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        x = self.example(self.relu(self.bn(self.conv(x))))
        return self.fc(x.mean(dim=(2, 3)))


@pytest.fixture
def example_backend():
    """The guide's registrations, removed afterwards (the registries are the package's, shared by every test)."""
    yield
    ParamsTable.unregister("example")
    BackendType.remove("Example")
    BACKEND_DEPLOY_FUNCTION.pop("example", None)
    FakeQuantizeDict.unregister("ExampleFakeQuantize")
    ObserverDict.unregister("ExampleObserver")


def register_example_backend() -> type:
    # "Define your backend at the enumeration of BackendType" (here at run time), its scheme in ParamsTable,
    # the classes in FakeQuantizeDict / ObserverDict.
    BackendType.add("Example")
    FakeQuantizeDict["ExampleFakeQuantize"] = ExampleFakeQuantize
    ObserverDict["ExampleObserver"] = ExampleObserver
    ParamsTable[BackendType.Example] = dict(
        qtype="affine",
        w_qscheme=QuantizeScheme(symmetry=True, per_channel=False, pot_scale=False, bit=8),
        a_qscheme=QuantizeScheme(symmetry=False, per_channel=False, pot_scale=False, bit=8),
        default_weight_quantize=ExampleFakeQuantize,
        default_act_quantize=ExampleFakeQuantize,
        default_weight_observer=ExampleObserver,
        default_act_observer=ExampleObserver,
    )

    # "Add Quantization Node into models": extend the TensorRT-style rules with ExampleMod.
    @register_model_quantizer(BackendType.Example)
    class ExampleQuantizer(ModelQuantizer):
        def __init__(self, extra_quantizer_dict, extra_fuse_dict):
            super().__init__(extra_quantizer_dict, extra_fuse_dict)

        @property
        def module_type_to_quant_input(self) -> tuple:
            return (*super().module_type_to_quant_input, ExampleMod, *self.additional_module_type)

    # "Deploy Models for the backend": merge BN, ONNX, remove the fake quantizers and collect the params.
    register_deploy_function(BackendType.Example)(convert_merge_bn)
    register_deploy_function(BackendType.Example)(convert_onnx)

    @register_deploy_function(BackendType.Example)
    def deploy_qparams_example(model, onnx_model_path, model_name, **kwargs):
        remove_fakequantize_and_collect_params(onnx_model_path, model_name, backend="example")

    return ExampleQuantizer


def calibrated(model: nn.Module, backend, images: torch.Tensor) -> nn.Module:
    qmodel = prepare_by_platform(model, backend, {"leaf_module": [ExampleMod]})  # traced whole, as in MQBench
    enable_calibration(qmodel)
    with torch.no_grad():
        for batch in images.split(8):
            qmodel(batch)
    enable_quantization(qmodel)
    return qmodel


def test_the_guide_adds_a_backend_that_prepares_deploys_and_verifies(example_backend, tmp_path):
    quantizer = register_example_backend()
    assert DEFAULT_MODEL_QUANTIZER[BackendType.Example] is quantizer
    assert BackendType("example") is BackendType.Example
    torch.manual_seed(0)
    model = Net().eval()
    images = torch.randn(32, 3, 8, 8)
    qmodel = calibrated(model, BackendType.Example, images)

    # The scheme, the classes and the quantizer's rules are the ones registered.
    weight_fq = qmodel.conv.weight_fake_quant
    assert type(weight_fq) is ExampleFakeQuantize and type(weight_fq.activation_post_process) is ExampleObserver
    assert (weight_fq.quant_min, weight_fq.quant_max) == (-128, 127)
    acts = {n: m for n, m in qmodel.named_modules() if n.endswith("_post_act_fake_quantizer")}
    assert acts and all(
        type(m) is ExampleFakeQuantize and (m.quant_min, m.quant_max) == (0, 255) for m in acts.values()
    )
    example_inputs = [n for n in qmodel.graph.nodes if n.op == "call_module" and n.target == "example"]
    assert str(example_inputs[0].args[0].target).endswith("_post_act_fake_quantizer")  # ExampleMod's input

    # The simulation against the affine formula on the calibrated parameters, for the first quantizer.
    x = images[:4]
    first = next(iter(acts.values()))
    s, z = float(first.scale.detach()), float(first.zero_point.detach())
    expected = (torch.clamp(torch.round(x / s) + z, 0, 255) - z) * s
    torch.testing.assert_close(first(x), expected, rtol=0, atol=1e-6)

    result = convert_deploy(qmodel, BackendType.Example, {"x": [1, 3, 8, 8]}, output_path=tmp_path, model_name="net")
    assert (tmp_path / "net.onnx").is_file() and (tmp_path / "net_deploy_model.onnx").is_file()
    clip_ranges = tmp_path / "net_clip_ranges.json"
    assert result.artifacts["clip_ranges"] == str(clip_ranges)
    params = json.loads(clip_ranges.read_text())["example"]
    # every quantized tensor with the scale, zero point and range the platform needs
    assert set(params) == set(result.table)
    for tensor, entry in params.items():
        assert {"scale", "zero_point", "quant_min", "quant_max", "round_mode"} <= set(entry), tensor
        assert entry["scale"] == pytest.approx(float(result.table[tensor].scale[0]), rel=1e-7)
    weights = [t for t, e in params.items() if e["kind"] == "weight"]
    assert weights and all(params[t]["quant_min"] == -128 and params[t]["zero_point"] == 0 for t in weights)

    report = verify_deploy(qmodel, result, images[:1])
    assert report.passed, report.failures()
    assert set(report.artifacts) >= {"onnx", "clip_ranges"}

    # Independently: the Q/DQ file on onnxruntime against the prepared model.
    # graph optimizations off: the Q/DQ ops as written (fused int8 kernels may saturate on CPUs without VNNI)
    session = ort_session(result.artifacts["onnx"], optimize=False)
    with torch.no_grad():
        simulated = qmodel(images[:1]).numpy()
    served = session.run(None, {result.input_names[0]: images[:1].numpy()})[0]
    # fc's input is quantized: the two may differ by one step of it where a float sum lands on a rounding tie,
    # which moves an output by at most that step times the row's largest weight magnitude
    fc_input = next(n for n in qmodel.graph.nodes if n.op == "call_module" and n.target == "fc").args[0]
    step = float(qmodel.get_submodule(str(fc_input.target)).scale.detach())
    bound = step * float(qmodel.fc.weight.abs().max()) + 1e-5
    assert np.abs(served - simulated).max() <= bound


def test_merge_bn_happens_in_place_and_the_model_still_simulates(tmp_path):
    """MQBench's ``convert_merge_bn(model)``: the model given is merged (its ImageNet example evaluates it after)."""
    torch.manual_seed(0)
    model = Net().train()
    qmodel = prepare_by_platform(model, BackendType.Tensorrt)  # QAT: BN folded while training
    images = torch.randn(32, 3, 8, 8)
    enable_calibration(qmodel)
    with torch.no_grad():
        qmodel(images)
    enable_quantization(qmodel)
    qmodel.eval()
    with torch.no_grad():
        before = qmodel(images)
    assert any("Bn" in type(m).__name__ for m in qmodel.modules())
    assert convert_merge_bn(qmodel) is qmodel
    assert not any("Bn" in type(m).__name__ for m in qmodel.modules())
    with torch.no_grad():
        after = qmodel(images)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    result = convert_deploy(qmodel, BackendType.Tensorrt, {"x": [1, 3, 8, 8]}, output_path=tmp_path)
    assert verify_deploy(qmodel, result, images[:1]).passed
