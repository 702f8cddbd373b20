"""Every quantizer prepare creates carries its role (the layer whose weight, or the values, it quantizes), read
back here against the prepared graph itself, and kept by copying, freezing and the deployed file's names."""

from __future__ import annotations

import copy

import onnx
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mqbench.convert_deploy import convert_deploy
from mqbench.fake_quantize import LearnableFakeQuantize
from mqbench.fake_quantize.quantize_base import QuantizeBase
from mqbench.prepare_by_platform import prepare_by_platform
from mqbench.utils.role import ROLE_ATTRIBUTE, QuantizerRole, role_of
from mqbench.utils.state import enable_calibration, enable_quantization


class Branches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Conv2d(3, 4, 1), nn.Conv2d(3, 4, 1), nn.Conv2d(8, 2, 1)

    def forward(self, x):
        return self.c(torch.cat([self.a(x), F.relu(self.b(x))], 1))


@pytest.mark.parametrize("backend", ["tensorrt", "vitis", "openvino", "snpe"])
def test_each_quantizer_s_role_is_what_the_graph_shows(backend):
    qmodel = prepare_by_platform(Branches().eval(), backend)
    modules = dict(qmodel.named_modules())
    read: dict[str, set[str]] = {}  # activation quantizer -> the values its calls read
    for node in qmodel.graph.nodes:
        if node.op == "call_module" and isinstance(modules[str(node.target)], QuantizeBase):
            read.setdefault(str(node.target), set()).add(node.args[0].name)
    quantizers = {n: m for n, m in modules.items() if isinstance(m, QuantizeBase)}
    assert quantizers
    for name, quantizer in quantizers.items():
        role = getattr(quantizer, ROLE_ATTRIBUTE)
        assert isinstance(role, QuantizerRole), name
        if role.kind == "weight":
            assert modules[role.layer].weight_fake_quant is quantizer
        else:
            assert set(role.values) == read[name], (name, role)
    if backend == "vitis":  # concat inputs share one quantizer: one role naming both values
        assert any(len(getattr(q, ROLE_ATTRIBUTE).values) == 2 for q in quantizers.values())


def test_roles_survive_copying_and_name_the_deployed_tensors(tmp_path):
    qmodel = prepare_by_platform(Branches().eval(), "tensorrt")
    x = torch.randn(2, 3, 5, 5)
    enable_calibration(qmodel)
    qmodel(x)
    enable_quantization(qmodel)
    copied = copy.deepcopy(qmodel)
    roles = {n: role_of(n, m) for n, m in copied.named_modules() if isinstance(m, QuantizeBase)}
    assert roles == {n: role_of(n, m) for n, m in qmodel.named_modules() if isinstance(m, QuantizeBase)}
    result = convert_deploy(qmodel, "tensorrt", dummy_input=x, output_path=tmp_path)
    subjects = {role.subject for role in roles.values()} - {"x"}  # the network input is the file's input_0
    assert set(result.table) == subjects | set(result.input_names)  # the file's tensors are named by the roles
    graph = onnx.load(result.artifacts["onnx"]).graph
    assert subjects <= {v for n in graph.node for v in n.input}


def test_a_quantizer_prepare_did_not_create_is_read_from_where_it_sits():
    quantizer = LearnableFakeQuantize()
    assert role_of("features.3.weight_fake_quant", quantizer) == QuantizerRole("weight", layer="features.3")
    assert role_of("gate", quantizer) == QuantizerRole("activation", values=("gate",))
