"""Where each backend's activation quantizers go, checked edge by edge on small hand-made models.

Every expectation below is written from the product specification of the backend, not read
back from the engine: for each activation quantizer node of the prepared graph, which value it
quantizes and which nodes read the quantized value (``output`` is the graph's output).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import operator
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

from backend_configs import academic_config
from mqbench.backends import ParamsTable, Placement, register_backend
from mqbench.custom_quantizer import ModelQuantizer, register_model_quantizer
from mqbench.fake_quantize import LearnableFakeQuantize
from mqbench.fake_quantize.quantize_base import QuantizeBase
from mqbench.observer import EMAMinMaxObserver
from mqbench.prepare_by_platform import BackendType, prepare_by_platform
from mqbench.utils.state import enable_calibration, enable_quantization

EXPLICIT = ("tensorrt", "qdq", "nnie")
TOTAL_INT = ("snpe", "pplw8a16", "pplcuda", "stpu")


# -- reading a prepared graph ---------------------------------------------------------------------
def quantizer_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    modules = dict(gm.named_modules())
    return [n for n in gm.graph.nodes if n.op == "call_module" and isinstance(modules[str(n.target)], QuantizeBase)]


def quantized_edges(gm: fx.GraphModule) -> dict[str, set[str]]:
    """value name -> names of the nodes that read its quantized copy."""
    edges: dict[str, set[str]] = {}
    for node in quantizer_nodes(gm):
        assert str(node.target).endswith("_post_act_fake_quantizer"), node.target
        (value,) = node.args
        assert isinstance(value, fx.Node)
        assert value.name not in edges, f"{value.name} is quantized twice"
        edges[value.name] = {user.name for user in node.users}
    return edges


def quantizer_of(gm: fx.GraphModule, value: str) -> QuantizeBase:
    for node in quantizer_nodes(gm):
        if node.args[0].name == value:
            return gm.get_submodule(str(node.target))
    raise AssertionError(f"{value} is not quantized")


def quant_ranges(gm: fx.GraphModule) -> dict[str, tuple[int, int]]:
    ranges = {}
    for node in quantizer_nodes(gm):
        quantizer = gm.get_submodule(str(node.target))
        ranges[node.args[0].name] = (quantizer.quant_min, quantizer.quant_max)
    return ranges


def calibrate(gm: fx.GraphModule, *inputs: object) -> None:
    enable_calibration(gm)
    with torch.no_grad():
        gm(*inputs)
    enable_quantization(gm)


# -- models ---------------------------------------------------------------------------------------
class ResBlock(nn.Module):
    """conv -> relu -> maxpool -> (add with a strided 1x1 skip) -> relu -> flatten -> linear."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.relu = nn.ReLU()
        self.pool = nn.MaxPool2d(2)
        self.down = nn.Conv2d(3, 4, 1, stride=2)
        self.relu2 = nn.ReLU()
        self.fc = nn.Linear(4 * 4 * 4, 5)

    def forward(self, x):
        y = self.pool(self.relu(self.conv(x))) + self.down(x)
        return self.fc(torch.flatten(self.relu2(y), 1))

    @staticmethod
    def inputs():
        return (torch.randn(2, 3, 8, 8),)


class SEBlock(nn.Module):
    """Squeeze-excitation with a residual: out(h * sigmoid(fc(pool(h))) + y)."""

    def __init__(self, mul_has_two_users: bool = False) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Conv2d(4, 4, 1)
        self.out = nn.Conv2d(4, 4, 1)
        self.mul_has_two_users = mul_has_two_users

    def forward(self, x, y):
        h = self.conv(x)
        scaled = h * torch.sigmoid(self.fc(self.pool(h)))
        out = self.out(scaled + y)
        if self.mul_has_two_users:
            return out, scaled.mean()
        return out

    @staticmethod
    def inputs():
        return torch.randn(2, 4, 5, 5), torch.randn(2, 4, 5, 5)


class ElementwiseOps(nn.Module):
    """mul, interpolate and concat between ops no backend runs in integers (sigmoid aside)."""

    def forward(self, x):
        m = torch.sigmoid(x) * torch.tanh(x)
        u = F.interpolate(m, scale_factor=2.0)
        return torch.cat([u, torch.tanh(u)], 1)

    @staticmethod
    def inputs():
        return (torch.randn(2, 3, 4, 4),)


class PassThrough(nn.Module):
    """add -> relu -> flatten -> linear -> dropout -> linear."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 4, 1)
        self.c2 = nn.Conv2d(3, 4, 1)
        self.relu = nn.ReLU()
        self.fc1 = nn.Linear(4 * 3 * 3, 6)
        self.drop = nn.Dropout(0.5)
        self.fc2 = nn.Linear(6, 2)

    def forward(self, x):
        h = self.relu(self.c1(x) + self.c2(x)).flatten(1)
        return self.fc2(self.drop(self.fc1(h)))

    @staticmethod
    def inputs():
        return (torch.randn(2, 3, 3, 3),)


class ConcatBranches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 4, 1)
        self.b = nn.Conv2d(3, 4, 1)
        self.c = nn.Conv2d(8, 2, 1)

    def forward(self, x):
        return self.c(torch.cat([self.a(x), F.relu(self.b(x))], 1))

    @staticmethod
    def inputs():
        return (torch.randn(2, 3, 5, 5),)


class TinyBertBlock(nn.Module):
    """embeddings sum -> LayerNorm -> q/k/v -> matmul -> + mask -> softmax -> matmul -> Linear -> residual -> LN."""

    def __init__(self, vocab: int = 20, dim: int = 8) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(16, dim)
        self.ln0 = nn.LayerNorm(dim)
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)
        self.ln1 = nn.LayerNorm(dim)

    def forward(self, ids, positions, mask):
        h = self.ln0(self.tok(ids) + self.pos(positions))
        q, k, v = self.q(h), self.k(h), self.v(h)
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(8)
        probs = torch.softmax(scores + mask, -1)
        return self.ln1(self.o(torch.matmul(probs, v)) + h)

    @staticmethod
    def inputs():
        ids = torch.randint(0, 20, (2, 6))
        positions = torch.arange(6).expand(2, 6)
        mask = torch.zeros(2, 6, 6)
        mask[:, :, 4:] = -1e4
        return ids, positions, mask


class TwoHeads(nn.Module):
    """conv -> hardswish -> conv -> (softmax(linear(mean)), sigmoid)."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 4, 1)
        self.hs = nn.Hardswish()
        self.c2 = nn.Conv2d(4, 4, 1)
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        h = self.c2(self.hs(self.c1(x)))
        return torch.softmax(self.fc(h.mean((2, 3))), -1), torch.sigmoid(h)

    @staticmethod
    def inputs():
        return (torch.randn(2, 3, 4, 4),)


def prepared(model: nn.Module, backend: Any, config: dict | None = None) -> fx.GraphModule:
    gm = prepare_by_platform(model.eval(), backend, config)
    gm(*model.inputs())  # the prepared model runs
    return gm


# -- explicit quantization: TensorRT, QDQ, NNIE ---------------------------------------------------
@pytest.mark.parametrize("backend", EXPLICIT)
def test_explicit_quantizes_inputs_of_int8_ops(backend):
    gm = prepared(ResBlock(), backend)
    # conv+relu fused: the relu's input (inside the fused module) is never quantized; relu2 is not an int8 op
    assert quantized_edges(gm) == {
        "x": {"conv", "down"},
        "conv": {"pool"},
        "pool": {"add"},
        "down": {"add"},
        "flatten": {"fc"},
    }
    assert not any(n.name == "relu" for n in gm.graph.nodes)


@pytest.mark.parametrize("backend", EXPLICIT)
def test_explicit_mul_interpolate_concat(backend):
    gm = prepared(ElementwiseOps(), backend)
    # u feeds the concat and a tanh: only the concat reads its quantized copy
    assert quantized_edges(gm) == {
        "sigmoid": {"mul"},
        "tanh": {"mul"},
        "mul": {"interpolate"},
        "interpolate": {"cat"},
        "tanh_1": {"cat"},
    }


@pytest.mark.parametrize("backend", EXPLICIT)
def test_explicit_fused_mul_add_has_no_quantizer_between(backend):
    gm = prepared(SEBlock(), backend)
    assert quantized_edges(gm) == {
        "x": {"conv"},
        "conv": {"pool", "mul"},
        "pool": {"fc"},
        "sigmoid": {"mul"},
        "y": {"add"},
        "add": {"out"},
    }


def test_mul_with_two_users_is_quantized_before_the_add():
    gm = prepared(SEBlock(mul_has_two_users=True), "tensorrt")
    assert quantized_edges(gm)["mul"] == {"add"}


def test_binary_op_with_a_constant_is_not_quantized():
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 3, 1)

        def forward(self, x):
            return self.conv(x * 2.0 + 1.0)

        @staticmethod
        def inputs():
            return (torch.randn(1, 3, 2, 2),)

    assert quantized_edges(prepared(Scale(), "tensorrt")) == {"add": {"conv"}}


@pytest.mark.parametrize("backend", EXPLICIT)
def test_square_is_a_binary_op(backend):
    class Square(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 3, 1)
            self.conv2 = nn.Conv2d(3, 3, 1)

        def forward(self, x):
            h = self.conv(x)
            return self.conv2(h * h + h)

        @staticmethod
        def inputs():
            return (torch.randn(1, 3, 2, 2),)

    gm = prepared(Square(), backend)
    assert quantized_edges(gm) == {"x": {"conv"}, "conv": {"mul", "add"}, "add": {"conv2"}}


class WrittenActivations(nn.Module):
    """Activation functions written as arithmetic: tanh GELU (as GPT-2 writes it), erf GELU, x * sigmoid(x)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.conv2, self.conv3, self.conv4 = (nn.Conv2d(3, 3, 1) for _ in range(4))

    def forward(self, x):
        h = self.conv(x)
        h = 0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * torch.pow(h, 3.0))))
        h = self.conv2(h)
        h = h * 0.5 * (1.0 + torch.erf(h / math.sqrt(2.0)))
        h = self.conv3(h)
        return self.conv4(h * torch.sigmoid(h))

    @staticmethod
    def inputs():
        return (torch.randn(1, 3, 2, 2),)


@pytest.mark.parametrize("backend", [*EXPLICIT, "openvino"])
def test_an_activation_written_as_arithmetic_is_one_op(backend):
    """A runtime computes such a function as one op (fused, in float): no quantizer goes between its ops (the
    products and sums inside are of one tensor, through a non-linear op), only at the layers' inputs."""
    gm = prepared(WrittenActivations(), backend)
    readers = sorted(sorted(r) for r in quantized_edges(gm).values())
    assert readers == [["conv"], ["conv2"], ["conv3"], ["conv4"]], quantized_edges(gm)


# -- all-integer: SNPE, PPLW8A16, PPLCUDA, STPU ---------------------------------------------------
@pytest.mark.parametrize("backend", TOTAL_INT)
def test_total_int_quantizes_inputs_and_outputs(backend):
    gm = prepared(ResBlock(), backend)
    # the add's output quantizer moves past relu2 and flatten
    assert quantized_edges(gm) == {
        "x": {"conv", "down"},
        "conv": {"pool"},
        "pool": {"add"},
        "down": {"add"},
        "flatten": {"fc"},
        "fc": {"output"},
    }


@pytest.mark.parametrize("backend", TOTAL_INT)
def test_total_int_moves_past_relu_flatten_dropout(backend):
    gm = prepared(PassThrough(), backend)
    assert quantized_edges(gm) == {
        "x": {"c1", "c2"},
        "c1": {"add"},
        "c2": {"add"},
        "flatten": {"fc1"},
        "drop": {"fc2"},
        "fc2": {"output"},
    }


def test_total_int_stays_put_when_the_relu_is_not_the_only_user():
    class Branch(nn.Module):
        def forward(self, x, y):
            s = x + y
            return F.relu(s), torch.tanh(s)

    gm = prepare_by_platform(Branch(), "snpe")
    assert quantized_edges(gm) == {"x": {"add"}, "y": {"add"}, "add": {"relu", "tanh"}}


@pytest.mark.parametrize("backend", TOTAL_INT)
def test_total_int_mul_interpolate_concat(backend):
    gm = prepared(ElementwiseOps(), backend)
    assert quantized_edges(gm) == {
        "sigmoid": {"mul"},
        "tanh": {"mul"},
        "mul": {"interpolate"},
        "interpolate": {"cat", "tanh_1"},
        "tanh_1": {"cat"},
        "cat": {"output"},
    }


# -- ONNX QLinear ---------------------------------------------------------------------------------
def test_onnx_qnn_conv_relu_linear_add_pool():
    gm = prepared(ResBlock(), "onnx_qnn")
    assert quantized_edges(gm) == {
        "x": {"conv", "down"},
        "conv": {"pool"},
        "pool": {"add"},
        "down": {"add"},
        "flatten": {"fc"},
        "fc": {"output"},
    }
    assert type(gm.conv).__name__ == "ConvReLU2d"  # conv + relu merged (QLinearConv with fused relu)


def test_onnx_qnn_has_no_qlinear_mul_or_resize():
    gm = prepared(ElementwiseOps(), "onnx_qnn")
    assert quantized_edges(gm) == {"interpolate": {"cat"}, "tanh_1": {"cat"}, "cat": {"output"}}


# -- Tengine --------------------------------------------------------------------------------------
def test_tengine_adds_hardswish_sigmoid_and_network_outputs():
    gm = prepared(TwoHeads(), "tengine_u8")
    assert quantized_edges(gm) == {
        "x": {"c1"},
        "c1": {"hs"},
        "hs": {"c2"},
        "c2": {"mean", "sigmoid"},
        "mean": {"fc"},
        "fc": {"softmax"},
        "softmax": {"output"},  # a network output, though softmax is not a Tengine int8 op
        "sigmoid": {"output"},
    }
    # for contrast, plain all-integer leaves softmax and sigmoid float
    snpe = quantized_edges(prepared(TwoHeads(), "snpe"))
    assert "softmax" not in snpe
    assert "sigmoid" not in snpe
    assert snpe["c1"] == {"hs"}


def test_tengine_elementwise_ops():
    gm = prepared(ElementwiseOps(), "tengine_u8")
    assert quantized_edges(gm) == {
        "x": {"sigmoid"},
        "sigmoid": {"mul"},
        "tanh": {"mul"},
        "mul": {"interpolate"},
        "interpolate": {"cat", "tanh_1"},
        "tanh_1": {"cat"},
        "cat": {"output"},
    }


# -- OpenVINO -------------------------------------------------------------------------------------
class ReluProducers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 4, 1)
        self.c2 = nn.Conv2d(4, 4, 1)
        self.c3 = nn.Conv2d(4, 4, 1)
        self.c4 = nn.Conv2d(4, 4, 1)

    def forward(self, x):
        a = F.relu(self.c1(x))  # fused: ConvReLU
        s = self.c2(a) + a
        return self.c4(self.c3(torch.relu(s)))

    @staticmethod
    def inputs():
        return (torch.randn(4, 3, 5, 5),)


def test_openvino_network_inputs_and_int8_op_inputs_unsigned_after_relu():
    gm = prepared(ReluProducers(), "openvino")
    assert quantized_edges(gm) == {
        "x": {"c1"},
        "c1": {"c2", "add"},
        "c2": {"add"},
        "relu_1": {"c3"},
        "c3": {"c4"},
    }
    signed, unsigned = (-128, 127), (0, 255)
    assert quant_ranges(gm) == {"x": signed, "c1": unsigned, "c2": signed, "relu_1": unsigned, "c3": signed}
    calibrate(gm, *ReluProducers.inputs())
    fq = quantizer_of(gm, "c1")
    peak = fq.activation_post_process.max_val
    assert torch.allclose(fq.scale.detach(), peak / 255, rtol=1e-3)  # the full unsigned grid is used
    assert int(fq.zero_point.detach().round().item()) == 0


def test_openvino_quantizes_the_items_of_a_dict_input():
    class DictInput(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 1)

        def forward(self, batch: dict):
            return self.conv(batch["image"]) + batch["bias"]

    batch = {"image": torch.randn(2, 3, 4, 4), "bias": torch.randn(2, 4, 1, 1)}
    for backend in ("openvino", "vitis"):
        gm = prepare_by_platform(DictInput().eval(), backend)
        edges = quantized_edges(gm)
        assert "batch" not in edges
        assert {"getitem", "getitem_1"} <= set(edges)
        assert gm(batch).shape == (2, 4, 4, 4)


# -- Vitis ----------------------------------------------------------------------------------------
def test_vitis_quantizes_op_outputs():
    gm = prepared(ResBlock(), "vitis")
    # relu2 is both an output-quantized op and the add's pass-through: one quantizer after it
    assert quantized_edges(gm) == {
        "x": {"conv", "down"},
        "conv": {"pool"},
        "pool": {"add"},
        "down": {"add"},
        "relu2": {"flatten"},
        "fc": {"output"},
    }


def test_vitis_concat_inputs_share_one_quantizer_module():
    gm = prepared(ConcatBranches(), "vitis")
    assert quantized_edges(gm) == {"x": {"a", "b"}, "a": {"cat"}, "b": {"cat"}, "cat": {"c"}, "c": {"output"}}
    cat = next(n for n in gm.graph.nodes if n.target is torch.cat)
    feeding = {str(arg.target) for arg in cat.args[0]}
    assert len(feeding) == 1, f"concat inputs use {feeding}"
    targets = {str(n.target) for n in quantizer_nodes(gm)}
    assert len(targets) == 4  # x, the shared a/b, cat, c
    calibrate(gm, *ConcatBranches.inputs())
    assert gm(*ConcatBranches.inputs()).shape == (2, 2, 5, 5)


def test_explicit_concat_inputs_keep_their_own_quantizers():
    gm = prepared(ConcatBranches(), "tensorrt")
    cat = next(n for n in gm.graph.nodes if n.target is torch.cat)
    assert len({str(arg.target) for arg in cat.args[0]}) == 2


def test_vitis_scales_are_powers_of_two():
    torch.manual_seed(0)
    model = ResBlock()
    gm = prepared(model, "vitis")
    calibrate(gm, torch.randn(4, 3, 8, 8) * 3)
    quantizers = [m for m in gm.modules() if isinstance(m, QuantizeBase)]
    weights = [name for name, m in gm.named_modules() if name.endswith("weight_fake_quant")]
    assert len(weights) == 3
    assert len(quantizers) == 3 + 6
    for quantizer in quantizers:
        scale, _ = quantizer.export_qparams()
        exponent = torch.log2(scale)
        assert torch.equal(exponent, exponent.round()), (quantizer, scale)


# -- transformers ---------------------------------------------------------------------------------
# MQBench's TensorRT NLP placement: residual adds 8-bit too
TENSORRT_NLP_INT8_RESIDUAL = dataclasses.replace(
    ParamsTable["tensorrt_nlp"],
    placement=Placement(inputs_of={"linear", "matmul", "add"}, add_needs_activations=True),
)


def test_tensorrt_nlp_quantizes_linear_and_matmul_inputs_and_keeps_residual_adds_float():
    gm = prepared(TinyBertBlock(), "tensorrt_nlp")
    assert quantized_edges(gm) == {
        "ln0": {"q", "k", "v"},  # the residual add reads the float LayerNorm output
        "q": {"matmul"},
        "transpose": {"matmul"},
        "softmax": {"matmul_1"},
        "v": {"matmul_1"},
        "matmul_1": {"o"},
    }


def test_tensorrt_nlp_with_int8_residual_adds_quantizes_the_residual_add_only():
    gm = prepared(TinyBertBlock(), TENSORRT_NLP_INT8_RESIDUAL)
    assert quantized_edges(gm) == {
        "ln0": {"q", "k", "v", "add_2"},  # q/k/v inputs and one input of the residual add
        "q": {"matmul"},
        "transpose": {"matmul"},
        "softmax": {"matmul_1"},
        "v": {"matmul_1"},
        "matmul_1": {"o"},
        "o": {"add_2"},
    }
    adds = [n.name for n in gm.graph.nodes if n.target is operator.add]
    assert adds == ["add", "add_1", "add_2"]  # embedding sum, mask, residual: only the last quantized


def test_academic_nlp_quantizes_linear_and_matmul():
    gm = prepared(TinyBertBlock(), "academic_nlp", academic_config(4))
    assert quantized_edges(gm) == {
        "ln0": {"q", "k", "v"},
        "q": {"matmul"},
        "transpose": {"matmul"},
        "softmax": {"matmul_1"},
        "v": {"matmul_1"},
        "matmul_1": {"o"},
    }


@pytest.mark.parametrize("int8_residual", [False, True])
def test_hf_bert_tensorrt_nlp_matches_float(int8_residual):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("transformers.utils.fx", reason="HFTracer: transformers 4.x (make test runs it on 4.57)")
    from transformers.utils.fx import HFTracer

    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        attn_implementation="eager",
    )
    model = transformers.BertModel(config).eval()
    used = ("input_ids", "attention_mask", "token_type_ids")
    concrete = {name: None for name in inspect.signature(model.forward).parameters if name not in used}
    backend = TENSORRT_NLP_INT8_RESIDUAL if int8_residual else "tensorrt_nlp"
    gm = prepare_by_platform(model, backend, {"concrete_args": concrete}, custom_tracer=HFTracer())

    modules = dict(gm.named_modules())
    quantizer_outputs = set(quantizer_nodes(gm))
    linears = [n for n in gm.graph.nodes if n.op == "call_module" and isinstance(modules[n.target], nn.Linear)]
    assert len(linears) == 2 * 6 + 1  # q, k, v, attention output, intermediate, output per layer; pooler
    for node in linears:
        assert node.args[0] in quantizer_outputs, node.name
    matmuls = [n for n in gm.graph.nodes if n.target in (torch.matmul, operator.matmul)]
    assert len(matmuls) == 4
    for node in matmuls:
        assert all(a in quantizer_outputs for a in node.args[:2]), node.name
    adds = [n for n in gm.graph.nodes if n.target in (operator.add, torch.add) and len(n.all_input_nodes) == 2]

    def residual(add: fx.Node) -> bool:  # feeds an encoder layer's LayerNorm
        return any(
            u.op == "call_module" and str(u.target).startswith("encoder.") and str(u.target).endswith("LayerNorm")
            for u in add.users
        )

    residuals = [a for a in adds if residual(a)]
    assert len(residuals) == 4
    for add in adds:
        inputs_quantized = [a in quantizer_outputs for a in add.all_input_nodes]
        assert all(inputs_quantized) if residual(add) and int8_residual else not any(inputs_quantized), add.name

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 100, (4, 12), generator=g)
    mask = torch.ones(4, 12, dtype=torch.long)
    mask[:, 9:] = 0
    kwargs = {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids)}
    calibrate_kwargs(gm, kwargs)
    with torch.no_grad():
        quantized_out = gm(**kwargs)["last_hidden_state"]
        float_out = model(**kwargs).last_hidden_state
    cosine = F.cosine_similarity(quantized_out.flatten(), float_out.flatten(), dim=0)
    assert cosine > 0.99


def calibrate_kwargs(gm: fx.GraphModule, kwargs: dict) -> None:
    enable_calibration(gm)
    with torch.no_grad():
        gm(**kwargs)
    enable_quantization(gm)


# -- Academic -------------------------------------------------------------------------------------
class FourLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3)
        self.conv2 = nn.Conv2d(4, 4, 3)
        self.fc1 = nn.Linear(4 * 2 * 2, 6)
        self.fc2 = nn.Linear(6, 2)

    def forward(self, x):
        h = F.relu(self.conv2(F.relu(self.conv1(x))))
        return self.fc2(self.fc1(h.flatten(1)))

    @staticmethod
    def inputs():
        return (torch.randn(2, 3, 6, 6),)


def test_academic_first_and_last_layer_8bit_others_4bit():
    gm = prepared(FourLayers(), "academic", academic_config(4))
    assert quantized_edges(gm) == {"x": {"conv1"}, "conv1": {"conv2"}, "flatten": {"fc1"}, "fc1": {"fc2"}}
    assert quant_ranges(gm) == {"x": (0, 255), "conv1": (0, 15), "flatten": (0, 15), "fc1": (0, 255)}
    weight_ranges = {
        name: (gm.get_submodule(name).weight_fake_quant.quant_min, gm.get_submodule(name).weight_fake_quant.quant_max)
        for name in ("conv1", "conv2", "fc1", "fc2")
    }
    assert weight_ranges == {"conv1": (-128, 127), "conv2": (-8, 7), "fc1": (-8, 7), "fc2": (-128, 127)}
    # the quantizers are the ones the configuration names
    act = quantizer_of(gm, "conv1")
    assert isinstance(act, LearnableFakeQuantize)
    assert isinstance(act.activation_post_process, EMAMinMaxObserver)
    weight = gm.conv2.weight_fake_quant
    assert isinstance(weight, LearnableFakeQuantize)
    assert weight.is_per_channel
    assert weight.ch_axis == 0


def test_academic_missing_qconfig_keys_are_listed():
    config = academic_config(4)["extra_qconfig_dict"]
    partial = {k: v for k, v in config.items() if k not in ("w_qscheme", "a_observer")}
    with pytest.raises(ValueError, match="extra_qconfig_dict") as info:
        prepare_by_platform(FourLayers().eval(), "academic", {"extra_qconfig_dict": partial})
    assert "w_qscheme" in str(info.value)
    assert "a_observer" in str(info.value)
    with pytest.raises(ValueError) as info:
        prepare_by_platform(FourLayers().eval(), BackendType.Academic)
    for key in ("w_observer", "w_fakequantize", "w_qscheme", "a_observer", "a_fakequantize", "a_qscheme"):
        assert key in str(info.value)


# -- extra_quantizer_dict -------------------------------------------------------------------------
class ExtraOps(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 1)
        self.act = nn.Hardswish()
        self.conv2 = nn.Conv2d(4, 4, 1)
        self.head = nn.Sequential(nn.Linear(4, 2))

    def forward(self, x):
        a = self.conv1(x)
        c = torch.tanh(a + self.conv2(self.act(a)))
        return self.head(c.mean((2, 3)))

    @staticmethod
    def inputs():
        return (torch.randn(2, 3, 4, 4),)


EXTRA_BASE = {"x": {"conv1"}, "conv1": {"add"}, "act": {"conv2"}, "conv2": {"add"}, "mean": {"head_0"}}


@pytest.mark.parametrize(
    ("extra", "changes"),
    [
        ({"additional_module_type": (nn.Hardswish,)}, {"conv1": {"add", "act"}}),
        ({"additional_function_type": [torch.tanh]}, {"add": {"tanh"}}),
        ({"additional_function_type": ["mean"]}, {"tanh": {"mean"}}),
        ({"additional_node_name": ["tanh"]}, {"add": {"tanh"}}),
        ({"exclude_module_name": ["conv2"]}, {"act": None}),
        ({"exclude_module_name": ["head"]}, {"mean": None}),
        ({"exclude_function_type": [operator.add]}, {"conv1": None, "conv2": None}),
        ({"exclude_node_name": ["add", "conv1"]}, {"x": None, "conv1": None, "conv2": None}),
    ],
    ids=[
        "module_type",
        "function_type",
        "method_name",
        "node_name",
        "exclude_module",
        "exclude_module_prefix",
        "exclude_function",
        "exclude_node",
    ],
)
@pytest.mark.parametrize("capture", ["fx", "export"])
def test_extra_quantizer_dict(extra, changes, capture):
    """The user's additions and exclusions mean the same whichever capture took the model (export writes
    ``x.tanh()`` and ``torch.tanh`` alike, and ``x.mean()`` as ``torch.mean``)."""
    config = {"extra_quantizer_dict": extra, "capture": capture, "example_inputs": ExtraOps.inputs()}
    gm = prepared(ExtraOps(), "tensorrt", config)
    expected = {k: set(v) for k, v in EXTRA_BASE.items()}
    for value, consumers in changes.items():
        if consumers is None:
            expected.pop(value)
        else:
            expected[value] = consumers
    assert quantized_edges(gm) == expected


def test_extra_quantizer_dict_excluded_modules_stay_float():
    gm = prepared(ExtraOps(), "tensorrt", {"extra_quantizer_dict": {"exclude_module_name": ["conv2", "head"]}})
    assert type(gm.conv2) is nn.Conv2d
    assert type(gm.get_submodule("head.0")) is nn.Linear
    assert not hasattr(gm.conv2, "weight_fake_quant")
    assert hasattr(gm.conv1, "weight_fake_quant")
    gm = prepared(ExtraOps(), "tensorrt", {"extra_quantizer_dict": {"exclude_node_name": ["conv1"]}})
    assert not hasattr(gm.conv1, "weight_fake_quant")


def test_extra_quantizer_dict_unknown_key():
    with pytest.raises(ValueError, match="exclude_node_names") as info:
        prepare_by_platform(ExtraOps(), "tensorrt", {"extra_quantizer_dict": {"exclude_node_names": ["add"]}})
    for key in ("additional_function_type", "additional_module_type", "exclude_node_name", "exclude_function_type"):
        assert key in str(info.value)


# -- custom backends and ModelQuantizer subclasses -------------------------------------------------
@pytest.fixture
def mynpu(monkeypatch):
    """A tensorrt clone registered as ``mynpu``; the registry is restored afterwards."""
    monkeypatch.setattr(ParamsTable, "_entries", dict(ParamsTable._entries))
    register_backend("mynpu", dataclasses.replace(ParamsTable["tensorrt"], name="mynpu"))
    return "mynpu"


def test_registered_model_quantizer_overrides_module_types(mynpu):
    calls = []

    @register_model_quantizer(mynpu)
    class HardswishNPU(ModelQuantizer):
        @property
        def module_type_to_quant_input(self):
            calls.append(type(self))
            return (*super().module_type_to_quant_input, nn.Hardswish)

    assert ParamsTable[mynpu].model_quantizer is HardswishNPU
    assert ParamsTable["tensorrt"].model_quantizer is None
    gm = prepared(ExtraOps(), mynpu)
    assert calls
    assert quantized_edges(gm) == {**EXTRA_BASE, "conv1": {"add", "act"}}
    assert quantized_edges(prepared(ExtraOps(), "tensorrt")) == EXTRA_BASE


def test_model_quantizer_subclass_can_drop_module_types(mynpu):
    @register_model_quantizer(mynpu)
    class LinearOnly(ModelQuantizer):
        @property
        def module_type_to_quant_input(self):
            return (nn.Linear,)

    gm = prepared(ExtraOps(), mynpu)
    assert quantized_edges(gm) == {"conv1": {"add"}, "conv2": {"add"}, "mean": {"head_0"}}
    assert hasattr(gm.conv1, "weight_fake_quant")  # weights are still quantized


def test_register_model_quantizer_rejects_non_subclasses(mynpu):
    with pytest.raises(ValueError, match="ModelQuantizer subclass"):
        register_model_quantizer(mynpu)(object)


# -- every backend --------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", list(BackendType))
def test_every_backend_prepares_and_runs(backend):
    config = academic_config(4) if backend.value.startswith("academic") else None
    model = ResBlock()
    gm = prepared(model, backend.value, config)
    for name in ("conv", "down", "fc"):
        assert hasattr(gm.get_submodule(name), "weight_fake_quant"), name
    assert quantizer_nodes(gm)
    calibrate(gm, *model.inputs())
    assert gm(*model.inputs()).shape == (2, 5)


class ShapeReads(nn.Module):
    """A convolution's output reshaped by sizes read from the tensors themselves, then pooled."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)
        flat = y.view(y.shape[0], 2, -1)
        square = flat.reshape(flat.size(0), flat.shape[1], 6, 6)
        return F.avg_pool2d(square, 2)


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_a_read_of_a_shape_is_not_a_reader_of_the_values(capture):
    """The convolution's output quantizer goes past the data movement to the tensor the pool reads, whether the
    sizes are read from the moved tensors (fx records ``x.shape`` and ``x.size(0)`` as readers of them; export,
    as symbols): one quantizer, on the reshape, on both captures."""
    config: dict[str, Any] = {"capture": capture}
    if capture == "export":
        config["example_inputs"] = torch.randn(2, 2, 6, 6)
    qmodel = prepare_by_platform(ShapeReads().eval(), "snpe", config)
    modules = dict(qmodel.named_modules())
    read = [
        n.args[0]
        for n in qmodel.graph.nodes
        if n.op == "call_module" and isinstance(modules[str(n.target)], QuantizeBase)
    ]
    kinds = [v.op if v.op in ("placeholder", "call_module") else getattr(v.target, "__name__", v.target) for v in read]
    # the network input, then the convolution's output once reshaped (not the view), then the pool's output
    assert kinds == ["placeholder", "reshape", "avg_pool2d"], read


class Rotary(nn.Module):
    """A rotary position embedding between two layers: angles ``position * inv_freq`` from the sequence's length
    and a buffer, as Llama-family models compute them."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(width, width), nn.Linear(width, width)
        self.register_buffer("inv_freq", 1 / 10000 ** (torch.arange(0, width, 2) / width), persistent=False)

    def forward(self, x):
        h = self.inp(x)
        positions = torch.arange(x.shape[1], dtype=torch.float32)
        angles = positions[:, None] * self.inv_freq[None]
        angles = torch.cat([angles, angles], -1)
        half = h.shape[-1] // 2
        rotated = torch.cat([-h[..., half:], h[..., :half]], -1)
        return self.out(h * angles.cos() + rotated * angles.sin())


@pytest.mark.parametrize("capture", ["fx", "export"])
@pytest.mark.parametrize("backend", ["openvino", "tensorrt", "snpe", "vitis", "nnie", "stpu"])
def test_position_arithmetic_stays_float(backend, capture):
    """Rotary angles depend on positions alone (0..255 here): an 8-bit grid over them moves each angle by up to
    half a radian, which turns the queries and keys (a relative error of 0.24 to 0.45 when measured on these
    backends). Left float, what is left is the 8-bit grids of the few activations on the path: a few percent."""
    torch.manual_seed(0)
    model, x = Rotary().eval(), torch.randn(4, 256, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qmodel = prepare_by_platform(model, backend, {"capture": capture, "example_inputs": (x[:1],)})
    for node in quantizer_nodes(qmodel):  # every quantized value is computed from the input's values
        value = node.args[0]
        assert value.op == "placeholder" or any(a.op == "placeholder" for a in _ancestors(value)), value
    calibrate(qmodel, x)
    with torch.no_grad():
        reference, simulated = model(x), qmodel(x)
    assert float((simulated - reference).norm() / reference.norm()) < 0.1


def _ancestors(node: fx.Node) -> set[fx.Node]:
    """The nodes ``node``'s values are computed from (not its shape: export records sizes as symbols of their own)."""
    seen, stack = set(), [node]
    while stack:
        current = stack.pop()
        if current.op == "call_function" and getattr(current.target, "__name__", "") in ("size", "sym_size"):
            continue
        if current.op == "call_function" and current.target is getattr:
            continue
        for value in current.all_input_nodes:
            if value not in seen:
                seen.add(value)
                stack.append(value)
    return seen
