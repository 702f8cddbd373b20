"""The quantization plan: both front ends compile into it, and what it says is what the prepared graph does.

The graph is read here directly (which modules are called on which values, which layers carry
weight quantizers); the deployed artifact is read with onnx. Neither reading goes through the
plan.
"""

from __future__ import annotations

import copy
import operator

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper
from torch import fx, nn

from mqbench.backend_config import (
    BackendConfig,
    BackendPatternConfig,
    DTypeConfig,
    ObservationType,
    convert_fx,
    get_backend_config,
    quantization_report,
)
from mqbench.backends import ParamsTable, register_backend
from mqbench.convert_deploy import convert_deploy
from mqbench.custom_quantizer.plan import EXCLUDED, plan_of
from mqbench.fake_quantize.quantize_base import QuantizeBase
from mqbench.prepare_by_platform import prepare_by_platform
from mqbench.utils.state import enable_calibration, enable_quantization

# backends whose quantizers are built from their own schemes (the Academic ones take the user's)
BUILTIN = sorted(name for name in ParamsTable if ParamsTable[name].weight is not None)


class Net(nn.Module):
    """Conv-BN-ReLU, two branches concatenated, pooled, a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.relu = nn.ReLU()
        self.left = nn.Conv2d(4, 4, 3, padding=1)
        self.right = nn.Conv2d(4, 4, 1)
        self.pool = nn.AdaptiveAvgPool2d(2)
        self.fc = nn.Linear(32, 5)

    def forward(self, x):
        y = self.relu(self.bn(self.conv(x)))
        joined = torch.cat([self.left(y), self.right(y)], 1)
        return self.fc(torch.flatten(self.pool(joined), 1))


def quantizer_calls(gm: fx.GraphModule) -> dict[str, list[fx.Node]]:
    """Activation quantizer module name -> the nodes calling it."""
    modules = dict(gm.named_modules())
    calls: dict[str, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op == "call_module" and isinstance(modules[str(node.target)], QuantizeBase):
            calls.setdefault(str(node.target), []).append(node)
    return calls


@pytest.mark.parametrize("backend", BUILTIN)
def test_the_plan_is_what_the_prepared_graph_does(backend):
    qmodel = prepare_by_platform(Net().eval(), backend)
    plan = plan_of(qmodel)
    assert plan is not None and plan.backend == backend and plan.front_end == "placement"
    calls = quantizer_calls(qmodel)
    assert {q.module for q in plan.activations} == set(calls)
    for quantizer in plan.activations:
        nodes = calls[quantizer.module]
        assert sorted(n.args[0].name for n in nodes) == sorted(quantizer.values)
        readers = sorted({user.name for n in nodes for user in n.users})
        if quantizer.readers is not None:
            assert readers == sorted(quantizer.readers)
        else:  # quantized for every reader: nothing reads the float value any more
            for n in nodes:
                assert set(n.args[0].users) <= set(nodes), quantizer.module
        assert quantizer.scheme.startswith(type(qmodel.get_submodule(quantizer.module)).__name__)
    modules = dict(qmodel.named_modules())
    weighted = {
        n.name
        for n in qmodel.graph.nodes
        if n.op == "call_module"
        and isinstance(getattr(modules[str(n.target)], "weight_fake_quant", None), QuantizeBase)
    }
    assert set(plan.weights) == weighted == {"conv", "left", "right", "fc"}
    assert all(plan.quantized(name) for name in weighted)
    if ParamsTable[backend].fuse:
        assert plan.fused["conv"] == "Conv2d-BatchNorm2d-ReLU"


def concat_input_scales(path: str) -> list[np.ndarray]:
    """The scales of the DequantizeLinear nodes that produce the inputs of the deployed model's Concat."""
    model = onnx.load(path)
    producers = {out: node for node in model.graph.node for out in node.output}
    constants = {init.name: numpy_helper.to_array(init) for init in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Constant":
            constants[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)
    (concat,) = [node for node in model.graph.node if node.op_type == "Concat"]
    scales = []
    for name in concat.input:
        producer = producers[name]
        while producer.op_type != "DequantizeLinear":  # past a Clip of a narrow grid
            producer = producers[producer.input[0]]
        scales.append(constants[producer.input[1]])
    return scales


@pytest.fixture
def declared_vitis():
    register_backend("vitis_declared", get_backend_config("vitis"), replace=True)
    yield "vitis_declared"
    ParamsTable.unregister("vitis_declared")


@pytest.mark.parametrize("front_end", ["placement", "backend_config"])
def test_shared_quantizers_are_a_decision_of_the_plan_and_deploy_as_one(front_end, declared_vitis, tmp_path):
    """Vitis runs a concatenation on one grid: both front ends plan one quantizer for its inputs, and the
    deployed Q/DQ model gives every input of the Concat the same scale."""
    backend = "vitis" if front_end == "placement" else declared_vitis
    torch.manual_seed(0)
    qmodel = prepare_by_platform(Net().eval(), backend)
    plan = plan_of(qmodel)
    assert plan.front_end == front_end
    assert ("left", "right") in plan.shared()
    (shared,) = [q for q in plan.activations if q.values == ("left", "right")]
    assert "shared: the backend requires one quantizer for these values" in shared.reasons
    enable_calibration(qmodel)
    with torch.no_grad():
        for _ in range(4):
            qmodel(torch.randn(8, 1, 8, 8))
    enable_quantization(qmodel)
    result = convert_deploy(qmodel, backend, {"x": [1, 1, 8, 8]}, output_path=tmp_path)
    scales = concat_input_scales(str(result.artifacts["onnx"]))
    assert len(scales) == 2 and np.array_equal(scales[0], scales[1])


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(8, 8)
        self.k = nn.Linear(8, 8)

    def forward(self, x):
        return torch.matmul(self.q(x), self.k(x).transpose(-1, -2))


def signed_npu() -> BackendConfig:
    int8 = DTypeConfig(input_dtype=torch.qint8, output_dtype=torch.qint8, weight_dtype=torch.qint8)
    observed = ObservationType.OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT
    config = BackendConfig("signed_npu")
    for op in (nn.Linear, torch.matmul, operator.matmul):
        config.set_backend_pattern_config(
            BackendPatternConfig(op).set_observation_type(observed).add_dtype_config(int8)
        )
    return config


@pytest.fixture
def declared_signed_npu():
    register_backend("signed_npu", signed_npu(), replace=True)
    yield "signed_npu"
    ParamsTable.unregister("signed_npu")


@pytest.mark.parametrize("backend", ["openvino", "signed_npu"])
def test_reduce_range_means_the_same_whichever_front_end_declared_the_backend(backend, declared_signed_npu):
    """reduce_range puts the signed right operand of a product of two activations on [-64, 63] and leaves
    the left one on [-128, 127], for a built-in backend and for one declared by a BackendConfig."""
    qmodel = prepare_by_platform(Attention().eval(), backend, {"reduce_range": True})
    (matmul,) = [n for n in qmodel.graph.nodes if n.op == "call_function" and n.target is torch.matmul]
    modules = dict(qmodel.named_modules())

    def grid_of(value: fx.Node) -> tuple[int, int]:
        while not (value.op == "call_module" and isinstance(modules[str(value.target)], QuantizeBase)):
            value = value.args[0]  # past the transpose
        quantizer = modules[str(value.target)]
        return int(quantizer.quant_min), int(quantizer.quant_max)

    assert grid_of(matmul.args[0]) == (-128, 127)
    assert grid_of(matmul.args[1]) == (-64, 63)
    reasons = [q.reasons for q in plan_of(qmodel).activations if "right operand of a product" in " ".join(q.reasons)]
    assert len(reasons) == 1


def test_the_report_explains_a_built_in_backends_decisions():
    qmodel = prepare_by_platform(Net().eval(), "tensorrt", {"extra_quantizer_dict": {"exclude_module_name": ["fc"]}})
    report = quantization_report(qmodel)
    lines = {line.split()[0]: line for line in report.splitlines()[1:-1]}
    assert "quantized  weights, inputs and output quantized" in lines["conv"]  # its readers quantize it
    assert EXCLUDED in lines["fc"]
    assert "float" in lines["flatten"] and "Placement rules" in lines["flatten"]
    assert report.splitlines()[-1].endswith("ops quantized")


def test_prepare_warns_when_a_built_in_backend_quantizes_nothing():
    model = nn.Sequential(nn.Linear(4, 4), nn.Sigmoid()).eval()
    with pytest.warns(UserWarning, match=r"backend 'tensorrt' quantizes nothing in this model"):
        prepare_by_platform(model, "tensorrt", {"extra_quantizer_dict": {"exclude_module_name": ["0"]}})


def test_convert_fx_reads_the_plan_and_records_what_it_lowered():
    torch.manual_seed(0)
    qmodel = prepare_by_platform(Net().eval(), "snpe")
    enable_calibration(qmodel)
    with torch.no_grad():
        qmodel(torch.randn(8, 1, 8, 8))
    assert plan_of(copy.deepcopy(qmodel)) == plan_of(qmodel)  # the plan travels with the model
    converted = convert_fx(qmodel)
    decisions = plan_of(converted).decisions
    assert decisions["conv"].reason == "lowered to mqbench.nn.quantized.conv.ConvReLU2d"
    assert decisions["fc"].reason == "lowered to mqbench.nn.quantized.linear.Linear"
    with pytest.raises(ValueError, match="carries no quantization plan"):
        convert_fx(fx.symbolic_trace(Net().eval()))


def test_the_shared_input_flag_is_part_of_a_pattern_config():
    config = BackendPatternConfig(torch.cat).set_shared_input_quantizer(True)
    assert BackendPatternConfig.from_dict(config.to_dict()).shared_input_quantizer
    assert "shared_input_quantizer" not in BackendPatternConfig(torch.cat).to_dict()
    with pytest.raises(ValueError, match="expected True or False"):
        config.set_shared_input_quantizer("yes")
    assert get_backend_config("vitis").config_for(torch.cat).shared_input_quantizer
    assert not get_backend_config("snpe").config_for(torch.cat).shared_input_quantizer
