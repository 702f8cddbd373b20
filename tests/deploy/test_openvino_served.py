"""The ``openvino_onnx`` artifact as OpenVINO's CPU plugin serves it: layouts it computes exactly, and the
file compiled as written.

Each case is a graph the plugin once served wrongly: ``k * relu(x)`` with a negative ``k`` after an int8
convolution or matrix product (the constant folded into the output scale before the Relu), and a padded
AveragePool that counts its padding over a signed tensor an int8 convolution wrote (padded with the
tensor's shifted zero, -128 steps). The independent reference is the standard Q/DQ model on onnxruntime.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx import helper
from torch import nn

from backend_configs import host_config
from fuzz.grammar import generate
from fuzz.harness import calibrate
from mqbench.convert_deploy import convert_deploy
from mqbench.deploy.qdq import insert_qdq
from mqbench.deploy.verify import verify_deploy
from mqbench.deploy.writers import openvino as openvino_writer
from mqbench.deploy.writers import openvino_layout
from mqbench.deploy.writers.openvino import (
    fake_quantize_as_onnx,
    run_openvino_file,
    run_openvino_isolated,
    to_openvino,
)
from mqbench.prepare_by_platform import prepare_by_platform
from mqbench.qparams import QParamTable, TensorQParams
from mqbench.utils.state import enable_calibration, enable_quantization
from onnx_helpers import model_of, run_exposing

C = 8


def act(scale: float, low: int, high: int) -> TensorQParams:
    return TensorQParams(np.array([scale]), np.array([0]), low, high)


def per_channel(w: np.ndarray) -> TensorQParams:
    span = np.abs(w).reshape(len(w), -1).max(1)
    # no weight lands on a rounding tie (FakeQuantize and QuantizeLinear may round a tie apart)
    return TensorQParams(span / 120, np.zeros(len(w)), -128, 127, axis=0, kind="weight")


def served_and_reference(model: onnx.ModelProto, table: QParamTable, x: np.ndarray, tmp_path):
    """The network output of the FakeQuantize model compiled from its file, and of the Q/DQ model on onnxruntime."""
    fq_model, _ = to_openvino(model, table)
    path = tmp_path / "fq.onnx"
    onnx.save(fq_model, str(path))
    served = run_openvino_file(path, {"x": x})["y"]
    qdq, _ = insert_qdq(model, table)
    return served, run_exposing(qdq, {"x": x}, ["y"])["y"], fq_model


def _scalings(rng):
    k = -(rng.random((1, C, 1, 1)) + 0.5)
    mixed = k.copy()
    mixed[0, ::2] *= -1
    return {"negative": k, "mixed signs": mixed, "negative scalar": np.array(-0.7)}


@pytest.mark.parametrize("layer", ["conv", "depthwise", "gemm"])
@pytest.mark.parametrize("scaling", ["negative", "mixed signs", "negative scalar", "divide by negative"])
def test_relu_then_a_negative_scaling_is_served_as_written(tmp_path, layer, scaling):
    """int8 layer (no bias) -> Relu -> Mul / Div by a constant with negative elements: k * relu(x), not relu(k x)."""
    rng = np.random.default_rng(0)
    if layer == "gemm":
        x, w = rng.standard_normal((4, 24)), rng.standard_normal((C, 24))
        nodes = [helper.make_node("Gemm", ["x", "w"], ["c"], name="gemm", transB=1)]
        k = -(rng.random((1, C)) + 0.5)
    else:
        groups = C if layer == "depthwise" else 1
        x, w = rng.standard_normal((2, C, 8, 8)), rng.standard_normal((C, C // groups, 3, 3))
        nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1], group=groups)]
        k = _scalings(rng)["negative" if scaling == "divide by negative" else scaling]
    op = "Div" if scaling == "divide by negative" else "Mul"
    nodes += [
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
        helper.make_node(op, ["r", "k"], ["y"], name="scale"),
    ]
    model = model_of(nodes, {"x": x}, ["y"], {"w": w, "k": k})
    table = QParamTable({"x": act(0.03, -128, 127), "w": per_channel(w)})
    x = (np.clip(np.rint(x / 0.03), -128, 127) * 0.03).astype(np.float32)  # on its grid: no rounding ties
    served, reference, fq_model = served_and_reference(model, table, x, tmp_path)
    # the same quantized products, summed in float32 in another order: a few units of the 7th digit
    np.testing.assert_allclose(served, reference, rtol=0, atol=1e-5 * np.abs(reference).max())
    formula = run_exposing(fake_quantize_as_onnx(fq_model), {"x": x}, ["y"])["y"]
    np.testing.assert_allclose(formula, reference, rtol=0, atol=1e-5 * np.abs(reference).max())
    assert "Relu" not in {n.op_type for n in fq_model.graph.node}  # its one reader now clamps instead


def test_a_normalized_sum_of_float_values_is_read_as_it_is(tmp_path):
    """A transformer's float residual add, r + layer(x) where the layer reads a quantized x: the sum has no scale
    for the plugin to move, so its LayerNormalization reads it without the ``Max`` barrier (which costs a memory
    pass a norm), and OpenVINO still serves it with epsilon, on rows where dropping epsilon shows."""
    rng = np.random.default_rng(2)
    width, epsilon = 64, 1e-5
    x = (rng.standard_normal((4, width)) * np.array([[0.003], [0.01], [0.02], [0.05]])).astype(np.float32)
    w = rng.standard_normal((width, width)) * 0.05
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["m"], name="layer"),
        helper.make_node("Add", ["m", "bias"], ["t"], name="bias_add"),
        helper.make_node("Add", ["r", "t"], ["s"], name="residual"),
        helper.make_node("LayerNormalization", ["s", "g", "b"], ["y"], axis=-1, epsilon=epsilon),
    ]
    inits = {"w": w, "bias": rng.standard_normal(width) * 0.01, "g": np.ones(width), "b": np.zeros(width)}
    r = x[::-1].copy()  # the residual stream: a float input
    model = model_of(nodes, {"x": x, "r": r}, ["y"], inits)
    table = QParamTable({"x": act(0.2 / 255, -128, 127)})
    fq_model, _ = to_openvino(model, table)
    onnx.save(fq_model, str(tmp_path / "fq.onnx"))
    served = run_openvino_file(tmp_path / "fq.onnx", {"x": x, "r": r})["y"]
    assert "Max" not in {node.op_type for node in fq_model.graph.node}
    # the formula: the float sum of x and the layer of the quantized x, normalized with epsilon in the variance
    quantized = np.clip(np.rint(x / (0.2 / 255)), -128, 127) * (0.2 / 255)
    total = r.astype(np.float64) + quantized @ w.astype(np.float32).astype(np.float64) + inits["bias"]
    centered = total - total.mean(-1, keepdims=True)
    formula = centered / np.sqrt((centered**2).mean(-1, keepdims=True) + epsilon)
    assert (centered**2).mean(-1).min() < 100 * epsilon  # rows where dropping epsilon shows
    np.testing.assert_allclose(served, formula, rtol=0, atol=1e-4)


@pytest.mark.parametrize("form", ["LayerNormalization", "ReduceMean"])
def test_a_normalized_sum_of_quantized_values_keeps_its_epsilon(tmp_path, form):
    """A LayerNormalization (or its ReduceMean / Sub / Sqrt form) of an Add of two quantized tensors, on rows whose
    variance is within a few hundred times epsilon: OpenVINO serves it with epsilon, as ONNX and the simulation
    compute it (its CPU plugin used to move the sum's scale past the normalization and drop epsilon: rows off by
    up to 90%)."""
    rng = np.random.default_rng(2)
    width, epsilon = 64, 1e-5
    x = (rng.standard_normal((4, width)) * np.array([[0.003], [0.01], [0.02], [0.05]])).astype(np.float32)
    nodes = [helper.make_node("Mul", ["x", "k"], ["t"], name="scale"), helper.make_node("Add", ["x", "t"], ["s"])]
    if form == "LayerNormalization":
        nodes.append(helper.make_node("LayerNormalization", ["s", "g", "b"], ["y"], axis=-1, epsilon=epsilon))
    else:
        nodes += [
            helper.make_node("ReduceMean", ["s"], ["m"], axes=[-1]),
            helper.make_node("Sub", ["s", "m"], ["d"]),
            helper.make_node("Mul", ["d", "d"], ["d2"]),
            helper.make_node("ReduceMean", ["d2"], ["v"], axes=[-1]),
            helper.make_node("Add", ["v", "eps"], ["ve"]),
            helper.make_node("Sqrt", ["ve"], ["root"]),
            helper.make_node("Div", ["d", "root"], ["n"]),
            helper.make_node("Mul", ["n", "g"], ["ng"]),
            helper.make_node("Add", ["ng", "b"], ["y"]),
        ]
    k = -(rng.random((1, width)) + 0.5)
    inits = {"k": k, "g": np.ones(width), "b": np.zeros(width), "eps": np.array(epsilon)}
    model = model_of(nodes, {"x": x}, ["y"], inits)
    table = QParamTable({"x": act(0.2 / 255, -128, 127), "t": act(0.3 / 255, -128, 127)})
    served, reference, _ = served_and_reference(model, table, x, tmp_path)
    # the reference, as a formula: the quantized sum normalized with epsilon added to the variance
    first = np.clip(np.rint(x / (0.2 / 255)), -128, 127) * (0.2 / 255)  # the scaling reads the quantized x
    second = np.clip(np.rint(first * k / (0.3 / 255)), -128, 127) * (0.3 / 255)
    total = first + second
    centered = total - total.mean(-1, keepdims=True)
    formula = centered / np.sqrt((centered**2).mean(-1, keepdims=True) + epsilon)
    assert (centered**2).mean(-1).min() < 100 * epsilon  # rows where dropping epsilon shows
    np.testing.assert_allclose(reference, formula, rtol=0, atol=1e-4)
    np.testing.assert_allclose(served, formula, rtol=0, atol=1e-4)


def test_a_quantized_relu_output_is_left_alone():
    """Where the table quantizes the Relu's output, its FakeQuantize is what the multiply reads: no rewrite."""
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal((2, C, 8, 8)), rng.standard_normal((C, C, 1, 1))
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
        helper.make_node("Mul", ["r", "k"], ["y"], name="scale"),
    ]
    model = model_of(nodes, {"x": x}, ["y"], {"w": w, "k": -np.ones((1, C, 1, 1))})
    table = QParamTable({"x": act(0.03, -128, 127), "w": per_channel(w), "r": act(0.02, 0, 255)})
    fq_model, quantized = to_openvino(model, table)
    by_name = {n.name: n for n in fq_model.graph.node}
    assert by_name["relu"].input[0] == "c" and by_name["scale"].input[0] == quantized["r"]


class ReluTimesNegative(nn.Module):
    """``torch.relu(conv(x)) * k`` with a buffer ``k < 0`` of shape [1, C, 1, 1]."""

    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, C, 3, padding=1, bias=bias)
        self.register_buffer("k", -torch.rand(1, C, 1, 1) - 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv(x)) * self.k


class PaddedAveragePool(nn.Module):
    """A signed conv output read by a padded 3x3 average pool (count_include_pad) and by a second conv."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, C, 3, padding=1)
        self.pool = nn.AvgPool2d(3, stride=1, padding=1)
        self.branch = nn.Conv2d(C, 4, 1)
        self.other = nn.Conv2d(C, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.stem(x)
        return torch.cat([self.branch(self.pool(y)), self.other(y)], 1)


class PoolOnly(nn.Module):
    """The padded pool is the only reader of its (unsigned) input: its FakeQuantize has no other reader."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, C, 3, padding=1)
        self.pool = nn.AvgPool2d(3, stride=1, padding=1)
        self.head = nn.Conv2d(C, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.pool(torch.relu(self.stem(x))))


class Grouped(nn.Module):
    """A signed conv output read by a depthwise or grouped 3x3 conv (and by a second conv), then a 1x1 conv."""

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, C, 3, padding=1)
        self.grouped = nn.Conv2d(C, C, 3, padding=1, groups=groups)
        self.head = nn.Conv2d(C, 4, 1)
        self.other = nn.Conv2d(C, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.stem(x)
        return torch.cat([self.head(torch.relu(self.grouped(y))), self.other(y)], 1)


class ClipOfPool(nn.Module):
    """``hardtanh`` of a quantized tensor's max pool: OpenVINO clips int8 values on their integers, the bounds cut
    to whole steps of their grid, unless the clip is the range of the FakeQuantize that reads it."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Conv2d(3, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.hardtanh(F.max_pool2d(x, 3, 2), -0.7, 1.0))


class PaddedCeilPool(nn.Module):
    """A padded ceil-mode average pool (a window past the padding) and a zero ``F.pad`` of a signed tensor: both
    become a Pad of the float tensor before its FakeQuantize."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, C, 3, padding=1)
        self.pool = nn.AvgPool2d(3, 2, padding=1, ceil_mode=True)
        self.head, self.other = nn.Conv2d(C, 4, 2, stride=2), nn.Conv2d(C, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # 16 -> 18 -> 9; 16 -> 9 (the last window is 16..18)
        y = self.stem(x)
        return torch.cat([self.head(F.pad(y, (1, 1, 1, 1))), self.other(self.pool(y))], 1)


class ScaledPool(nn.Module):
    """A scaling of an average pool's output before its FakeQuantize (``-0.5 * avg_pool2d``): OpenVINO rounds an int8
    average to the input's grid unless the FakeQuantize takes it directly."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.head = nn.Conv2d(3, C, 3, padding=1), nn.Conv2d(C, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.avg_pool2d(-0.5 * F.avg_pool2d(self.stem(x), 3, 1, 1), 3, 1))


class PoolReadTwice(nn.Module):
    """An average pool of a quantized tensor read by a quantized layer and by a float op: OpenVINO rounds an int8
    average to the input's grid unless one FakeQuantize alone takes it."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.head = nn.Conv2d(3, C, 3, padding=1), nn.Conv2d(C, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled = F.avg_pool2d(torch.relu(self.stem(x)), 3, 2, ceil_mode=True)
        return self.head(pooled) * pooled.mean((1, 2, 3), keepdim=True)


class ClipThenPaddedConv(nn.Module):
    """``hardtanh`` read by a padded convolution: the clip folded into its FakeQuantize narrows the grid (-1 rounds
    to -127 steps of a 2/255 grid), which the convolution must still read as the full int8 grid."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.head = nn.Conv2d(3, C, 3, padding=1), nn.Conv2d(C, 4, 3, padding=2, dilation=2)
        with torch.no_grad():
            self.stem.weight.mul_(4)  # beyond [-1, 1]: the hardtanh output spans it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.hardtanh(F.interpolate(self.stem(x), scale_factor=0.5, mode="nearest")))


class TokenMean(nn.Module):
    """Tokens through a Linear, scaled, averaged over the sequence (``mean(dim=1)``, ``keepdims=0``), then a Linear:
    OpenVINO serves the mean's FakeQuantize steps off unless the reduction keeps its dimensions."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Linear(3, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.embed(x.flatten(2).transpose(1, 2))
        return self.head((tokens * 0.5).mean(dim=1))


def deployed(model: nn.Module, tmp_path):
    torch.manual_seed(0)
    qmodel = prepare_by_platform(model.eval(), "openvino", host_config("openvino"))
    enable_calibration(qmodel)
    with torch.no_grad():
        for _ in range(3):
            qmodel(torch.randn(4, 3, 16, 16))
    enable_quantization(qmodel)
    return qmodel, convert_deploy(qmodel, "openvino", {"x": [2, 3, 16, 16]}, output_path=tmp_path, model_name="m")


CASES = {
    "relu times negative": lambda: ReluTimesNegative(bias=False),
    "relu times negative, bias": lambda: ReluTimesNegative(bias=True),
    "padded average pool": PaddedAveragePool,
    "padded average pool, its only reader": PoolOnly,
    "depthwise": lambda: Grouped(C),
    "grouped": lambda: Grouped(2),
    "clip of a quantized pool": ClipOfPool,
    "padded ceil-mode pool and zero pad": PaddedCeilPool,
    "scaled average pool": ScaledPool,
    "average pool read twice": PoolReadTwice,
    "clip then padded conv": ClipThenPaddedConv,
    "mean over tokens": TokenMean,
}


@pytest.mark.parametrize("case", list(CASES))
def test_verify_passes_and_the_file_serves_the_simulation(tmp_path, case):
    torch.manual_seed(0)
    qmodel, result = deployed(CASES[case](), tmp_path)
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    report = verify_deploy(qmodel, result, x)
    assert report.passed, report.failures()
    host = report.artifacts["openvino_onnx"].host
    assert host is not None and host.max_lsb_diff <= 1, host.diverging(1)
    # independently of verify: the file as written against its FakeQuantize formula in standard ops on onnxruntime
    # (the Q/DQ model rounds inputs near a tie apart from the formula: end to end that says nothing of OpenVINO)
    feeds = {"x": x.numpy()}
    path = result.artifacts["openvino_onnx"]
    served = run_openvino_file(path, feeds)
    name = result.output_names[0]
    reference = run_exposing(fake_quantize_as_onnx(onnx.load(path)), feeds, [name])[name]
    entry = next((e for e in result.table.values() if name in e.extra.get("outputs", ())), None)
    # a float output: the same quantized products summed in another order; a quantized one: the same grid value
    step = 1e-5 * np.abs(reference).max() if entry is None else 0.01 * float(np.min(entry.scale))
    close = np.abs(served[name] - reference) <= step
    # a rounding tie decided the other way moves a few values on; a wrong layout moves whole borders or channels
    assert close.mean() >= 0.99, close.mean()


def test_the_writer_pads_average_pools_explicitly(tmp_path):
    torch.manual_seed(0)
    _, result = deployed(PaddedAveragePool(), tmp_path)
    model = onnx.load(result.artifacts["openvino_onnx"])
    pools = [n for n in model.graph.node if n.op_type == "AveragePool"]
    assert len(pools) == 1 and not any(a.name == "pads" for a in pools[0].attribute)
    producers = {o: n for n in model.graph.node for o in n.output}
    fake = producers[pools[0].input[0]]  # the padded float tensor, quantized on the pool input's grid
    assert fake.op_type == "FakeQuantize" and producers[fake.input[0]].op_type == "Pad"


def test_the_explicit_pad_reads_the_quantized_value_its_pool_read():
    """An entry whose consumers name the pool: the pool reads the padded float tensor quantized on that entry's
    grid, the other readers the float value; a ceil-mode pool keeps its own padding."""
    x = np.random.default_rng(2).standard_normal((1, 2, 6, 6))
    nodes = [
        helper.make_node(
            "AveragePool", ["x"], ["p"], name="pool", kernel_shape=[3, 3], pads=[1, 1, 1, 1], count_include_pad=1
        ),
        helper.make_node(
            "AveragePool",
            ["x"],
            ["c"],
            name="ceil",
            kernel_shape=[3, 3],
            pads=[1, 1, 1, 1],
            count_include_pad=1,
            ceil_mode=1,
            strides=[2, 2],
        ),
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
    ]
    model = model_of(nodes, {"x": x}, ["p", "c", "r"], {})
    entry = TensorQParams(np.array([0.03]), np.array([0]), -128, 127, consumers=("pool",))
    fq_model, quantized = to_openvino(model, QParamTable({"x": entry}))
    by_name = {n.name: n for n in fq_model.graph.node}
    producers = {o: n for n in fq_model.graph.node for o in n.output}
    fake, original = producers[by_name["pool"].input[0]], producers[quantized["x"]]
    assert (
        fake.op_type == "FakeQuantize" and fake.input[1:] == original.input[1:] and fake.attribute == original.attribute
    )
    assert producers[fake.input[0]].op_type == "Pad" and producers[fake.input[0]].input[0] == "x"
    assert by_name["relu"].input[0] == "x" and by_name["ceil"].input[0] == "x"
    assert {a.name for a in by_name["ceil"].attribute} >= {"pads", "count_include_pad"}
    formula = run_exposing(fake_quantize_as_onnx(fq_model), {"x": x.astype(np.float32)}, ["p"])["p"]
    q = np.clip(np.rint(x / 0.03), -128, 127) * 0.03  # no ties: x is random
    padded = np.pad(q, ((0, 0), (0, 0), (1, 1), (1, 1)))
    windows = np.lib.stride_tricks.sliding_window_view(padded, (3, 3), axis=(2, 3))
    np.testing.assert_allclose(formula, windows.mean(axis=(-1, -2)), rtol=0, atol=1e-6)


def test_verify_runs_the_file_as_written(tmp_path, monkeypatch):
    """The host verdict's outputs come from the artifact's own path, compiled as a user loads it."""
    torch.manual_seed(0)
    qmodel, result = deployed(ReluTimesNegative(bias=False), tmp_path)
    compiled: list[str] = []

    def spy(path, inputs, copies, *args, **kwargs):
        compiled.append(str(path))
        served, exposed = run_openvino_isolated(path, inputs, copies, *args, **kwargs)
        assert set(served) == set(result.output_names)  # the file's own outputs, nothing added
        assert all(set(values) >= set(names) for values, names in zip(exposed, copies, strict=True))
        return served, exposed

    monkeypatch.setattr(openvino_writer, "run_openvino_isolated", spy)
    report = verify_deploy(qmodel, result, torch.randn(2, 3, 16, 16))
    assert compiled == [str(result.artifacts["openvino_onnx"])]
    assert report.passed, report.failures()


def test_a_file_openvino_cannot_run_is_an_error_naming_it(tmp_path):
    path = tmp_path / "broken.onnx"
    node = helper.make_node("NoSuchOp", ["x"], ["y"], name="bad", domain="org.example")
    model = model_of([node], {"x": np.zeros((1, 2))}, ["y"], {})
    model.opset_import.append(helper.make_opsetid("org.example", 1))
    onnx.save(model, str(path))
    with pytest.raises(RuntimeError, match=r"exit status .* compiling or running .*broken\.onnx"):
        run_openvino_file(path, {"x": np.zeros((1, 2), np.float32)})


def test_verify_fails_where_openvino_serves_a_float_output_wrongly(tmp_path, monkeypatch):
    """The artifact written without the clamp layout (Relu -> Mul by k < 0): OpenVINO builds may fold the Mul into
    the convolution ahead of the Relu and compute relu(k * x), every nonzero value of the float output wrong. What
    this host's OpenVINO serves is measured here directly (the file run as written against the simulation): where
    it is wrong, the host verdict must fail naming the output; where it is right, verify must pass."""
    torch.manual_seed(0)
    qmodel, result = deployed(ReluTimesNegative(bias=False), tmp_path)
    monkeypatch.setattr(openvino_layout, "_scale_before_relu", lambda graph, table: None)
    plain, _ = to_openvino(onnx.load(result.artifacts["deploy_onnx"]), result.table)
    assert [n.op_type for n in plain.graph.node if n.domain != "org.openvinotoolkit"] == ["Conv", "Relu", "Mul"]
    onnx.save(plain, result.artifacts["openvino_onnx"])
    x = torch.randn(2, 3, 16, 16)
    (served,) = run_openvino_file(result.artifacts["openvino_onnx"], {"x": x.numpy()}).values()
    with torch.no_grad():
        simulated = qmodel(x).numpy()
    sign_lost = float(np.abs(served - simulated).max()) > 0.5 * float(np.abs(simulated).max())
    report = verify_deploy(qmodel, result, x)
    art = report.artifacts["openvino_onnx"]
    assert art.max_lsb_diff == 0 and not art.diverging(1)  # the file's arithmetic is right
    if not sign_lost:  # this host's OpenVINO keeps the Relu ahead of the Mul: the file is served right
        assert report.passed, report.failures()
        return
    assert not report.passed
    (line,) = report.failures()
    assert line.startswith("openvino_onnx: OpenVINO CPU") and "output 'output'" in line, line
    local = art.host.local_outputs["output"]
    assert local.max_abs_diff > 0.5 * local.magnitude  # not rounding: a sign lost


def test_verify_fails_on_a_file_openvino_cannot_compile(tmp_path):
    """A file OpenVINO refuses (an output FakeQuantize of one level): the host verdict fails and says the file does
    not run, naming it, instead of ending the process."""
    torch.manual_seed(0)
    qmodel, result = deployed(Grouped(2), tmp_path)
    model = onnx.load(result.artifacts["openvino_onnx"])
    last = [n for n in model.graph.node if n.op_type == "FakeQuantize"][-1]
    for attribute in last.attribute:
        if attribute.name == "levels":
            attribute.i = 1
    onnx.save(model, result.artifacts["openvino_onnx"])
    report = verify_deploy(qmodel, result, torch.randn(2, 3, 16, 16))
    host = report.artifacts["openvino_onnx"].host
    assert not report.passed and host.missing == list(result.output_names)
    assert host.cause is not None and host.cause.startswith("the file as written does not run"), host.cause
    assert "m_openvino.onnx" in host.cause


class NormAct(nn.BatchNorm2d):
    """A batch norm with its ReLU6, kept whole (a leaf module): a float batch norm after each convolution."""

    def __init__(self, channels: int) -> None:
        super().__init__(channels)
        self.act = nn.ReLU6()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(super().forward(x))


class DepthwiseThenNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem, self.bn = nn.Conv2d(3, 16, 3, 2, 1, bias=False), NormAct(16)
        self.dw, self.bn_dw = nn.Conv2d(16, 16, 3, 1, 1, groups=16, bias=False), NormAct(16)
        self.head = nn.Conv2d(16, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.bn_dw(self.dw(self.bn(self.stem(x)))))


def test_a_batch_norm_after_a_depthwise_convolution_verifies(tmp_path):
    """A float batch norm after an int8 depthwise convolution: a copy of the file that shows the convolution's
    weights computes it wrongly (the plugin folds the norm into the shown weights), the file itself does not.
    verify reads the file as written and quantized activations only, and the ReLU6 folded into each FakeQuantize
    still names the tensor it quantizes."""
    torch.manual_seed(0)
    config = {**(host_config("openvino") or {}), "leaf_module": [NormAct]}
    qmodel = prepare_by_platform(DepthwiseThenNorm().eval(), "openvino", config)
    enable_calibration(qmodel)
    with torch.no_grad():
        for _ in range(3):
            qmodel(torch.randn(4, 3, 32, 32))
    enable_quantization(qmodel)
    result = convert_deploy(qmodel, "openvino", {"x": [2, 3, 32, 32]}, output_path=tmp_path, model_name="m")
    path = result.artifacts["openvino_onnx"]
    assert "BatchNormalization" in {n.op_type for n in onnx.load(path).graph.node}  # kept: the case under test
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    report = verify_deploy(qmodel, result, x)
    assert report.passed, report.failures()
    host = report.artifacts["openvino_onnx"].host
    activations = [name for name, entry in result.table.items() if entry.kind != "weight"]
    assert host is not None and set(activations) <= set(host.per_tensor), (activations, list(host.per_tensor))
    feeds = {"x": x.numpy()}
    served = run_openvino_file(path, feeds)["output"]
    reference = run_exposing(fake_quantize_as_onnx(onnx.load(path)), feeds, ["output"])["output"]
    np.testing.assert_allclose(served, reference, rtol=0, atol=1e-5 * np.abs(reference).max())


def test_a_deconvolution_that_openvino_serves_differently_from_run_to_run_is_named_with_its_remedy(tmp_path):
    """A stride-2 int8 ``ConvTranspose2d`` after GELU: on two threads OpenVINO 2026.4 computes it differently from
    run to run (1.5% of it 178 steps off in about 40% of the runs), the copies that show tensors and the file alike;
    on one thread it is the same every time and what the simulation computes. The copies run on one thread, so
    they never fail a right file; the file is served as a user serves it (two threads), and where that parts from
    the simulation the report names the race and serving on one thread as the remedy."""
    graph = generate(1106, "image")
    qmodel = calibrate(graph, prepare_by_platform(graph.build(), "openvino", host_config("openvino")))
    result = convert_deploy(qmodel, "openvino", dummy_input=graph.batch(0), output_path=tmp_path)
    path = result.artifacts["openvino_onnx"]
    assert "ConvTranspose" in {n.op_type for n in onnx.load(path).graph.node}
    inputs = graph.verify_inputs(1.0)
    for _ in range(3):
        report = verify_deploy(qmodel, result, inputs)
        host = report.artifacts["openvino_onnx"].host
        assert host is not None
        shown = {name: d.max_lsb_diff for name, d in host.per_tensor.items() if d.max_lsb_diff is not None}
        assert shown and max(shown.values()) <= report.tolerance, shown
        if not report.passed:
            assert "run to run" in (host.cause or "") or "on 2 threads" in (host.cause or ""), report.failures()
            assert host.remedy is not None and "INFERENCE_NUM_THREADS" in host.remedy, report.failures()
    feeds = {value.name: x.numpy() for value, x in zip(onnx.load(path).graph.input, inputs, strict=True)}
    reference = run_exposing(fake_quantize_as_onnx(onnx.load(path)), feeds, result.output_names)
    for _ in range(3):
        single = run_openvino_file(path, feeds, threads=1)
        for name in result.output_names:
            scale = np.abs(reference[name]).max()
            np.testing.assert_allclose(single[name], reference[name], rtol=0, atol=1e-5 * scale)


def test_outputs_that_change_with_openvino_threads_are_named_and_one_thread_is_the_remedy(tmp_path, monkeypatch):
    """The diagnosis of a thread race, made certain: OpenVINO stands in, serving the file's outputs shifted on two
    threads (by another amount each run) and right on one. verify fails the file, says its outputs changed from
    run to run and that one thread computes the simulation, and gives serving on one thread as the remedy; served
    the same wrong way every time on two threads, the cause says it depends on the threads. A file wrong on one
    thread too is not put on the threads."""
    graph = generate(1106, "image")
    qmodel = calibrate(graph, prepare_by_platform(graph.build(), "openvino", host_config("openvino")))
    result = convert_deploy(qmodel, "openvino", dummy_input=graph.batch(0), output_path=tmp_path)
    inputs = graph.verify_inputs(1.0)
    real_isolated = openvino_writer.run_openvino_isolated
    calls = {"n": 0}

    def shifted(outputs, amount):
        return {name: value + np.float32(amount) * np.abs(value).max() for name, value in outputs.items()}

    def isolated(path, feeds, copies, *args, **kwargs):
        served, exposed = real_isolated(path, feeds, copies, threads=1)
        return shifted(served, 0.1), exposed

    def served_file(varying, right_on_one):
        def run(path, feeds, threads=2, **kwargs):
            calls["n"] += 1
            outputs = real_isolated(path, feeds, [], threads=1)[0]
            if threads == 1 and right_on_one:
                return outputs
            return shifted(outputs, 0.1 + 0.05 * calls["n"] * varying)

        return run

    monkeypatch.setattr(openvino_writer, "run_openvino_isolated", isolated)
    for varying, right_on_one, said in ((1, True, "run to run"), (0, True, "on 2 threads"), (0, False, None)):
        monkeypatch.setattr(openvino_writer, "run_openvino_file", served_file(varying, right_on_one))
        report = verify_deploy(qmodel, result, inputs)
        host = report.artifacts["openvino_onnx"].host
        assert not report.passed and host is not None
        if said is None:
            assert "one thread" not in (host.cause or "") and host.remedy is None, report.failures()
        else:
            assert said in host.cause and "on one thread it computes what the simulation" in host.cause, host.cause
            assert host.remedy is not None and "'INFERENCE_NUM_THREADS': 1" in host.remedy
