"""The OpenVINO FakeQuantize model: its semantics, its placement, and OpenVINO against the Q/DQ model on onnxruntime."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from mqbench.backends import resolve_backend
from mqbench.convert_deploy import DeployContext, convert_onnx, deployable_copy
from mqbench.deploy.qdq import insert_qdq
from mqbench.deploy.table import QParamTable, TensorQParams
from mqbench.deploy.writers.openvino import (
    FAKE_QUANTIZE_DOMAIN,
    fake_quantize_as_onnx,
    fake_quantize_outputs,
    run_openvino,
    to_openvino,
    write,
)
from mqbench.models import DigitsCNN, resnet18
from mqbench.prepare_by_platform import prepare_by_platform
from mqbench.utils.host import int8_pairs_saturate
from mqbench.utils.state import enable_calibration, enable_quantization
from onnx_helpers import model_of, run_exposing

RNG = np.random.default_rng(0)
# OpenVINO's int8 kernels on a CPU without VNNI sum u8 x s8 product pairs in saturating 16-bit registers:
# there, OpenVINO itself is compared on 7-bit weights (which cannot saturate), the artifact's formula everywhere.
SATURATES = int8_pairs_saturate()


@pytest.fixture(autouse=True)
def _same_data_whatever_runs_first():
    RNG.bit_generator.state = np.random.default_rng(0).bit_generator.state


def act(scale: float, zero_point: int, low: int, high: int, consumers=None) -> TensorQParams:
    return TensorQParams(np.array([scale]), np.array([zero_point]), low, high, consumers=consumers)


def save(model: onnx.ModelProto, path) -> str:
    onnx.save(model, str(path))  # (no checker: these test graphs leave output shapes open)
    return str(path)


def lsb_diff(a: np.ndarray, b: np.ndarray, entry: TensorQParams) -> np.ndarray:
    return np.rint(np.abs(a.astype(np.float64) - b) / float(entry.scale[0])).astype(np.int64)


# -- FakeQuantize semantics ----------------------------------------------------------------------


@pytest.mark.parametrize(("low", "high"), [(0, 255), (-128, 127), (-127, 127), (0, 15)])
def test_fake_quantize_rounds_half_to_even_from_input_low(tmp_path, low, high):
    """round((x - il) / (ih - il) * (levels - 1)) with ties to even: the Q/DQ value except at odd-offset ties."""
    scale = 0.25  # a power of two: every tie below is exact in float32 on both runtimes
    x = (np.arange(-600, 600) * 0.125).astype(np.float32)  # steps of scale / 2: every other value is a tie
    model = model_of([helper.make_node("Identity", ["x"], ["y"], name="id")], {"x": x}, ["y"], {})
    entry = act(scale, 0, low, high)
    table = QParamTable({"x": entry})
    fq_model, quantized = to_openvino(model, table)
    path = save(fq_model, tmp_path / "fq.onnx")
    got = run_openvino(path, {"x": x}, [quantized["x"]])[quantized["x"]]
    steps = np.clip(np.rint((x - low * scale) / scale), 0, high - low)  # half to even from input_low
    np.testing.assert_array_equal(got, ((steps + low) * scale).astype(np.float32))
    qdq, dequantized = insert_qdq(model, table)
    reference = run_exposing(qdq, {"x": x}, [dequantized["x"]])[dequantized["x"]]
    diff = lsb_diff(got, reference, entry)
    ties = np.abs(x / scale - np.round(x / scale)) == 0.5
    assert diff.max() <= 1 and not diff[~ties].any()
    assert diff.any() == (low % 2 == 1)  # the parity of a tie flips with an odd quant_min - zero_point


# -- placement -----------------------------------------------------------------------------------------


def test_placement_follows_consumers_per_channel_limits_and_output_names():
    x, w = RNG.standard_normal((1, 2, 4, 4)), RNG.standard_normal((3, 2, 1, 1))
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("Conv", ["r", "w"], ["c"], name="conv"),
        helper.make_node("ReduceMean", ["r"], ["m"], name="mean", axes=[1], keepdims=1),
        helper.make_node("Add", ["c", "m"], ["y"], name="add"),
    ]
    model = model_of(nodes, {"x": x}, ["y"], {"w": w})
    weight = TensorQParams(np.array([0.01, 0.02, 0.03]), np.zeros(3), -128, 127, axis=0, kind="weight")
    table = QParamTable({"r": act(0.02, 0, 0, 255, consumers=("conv",)), "w": weight, "y": act(0.05, 0, -128, 127)})
    fq_model, quantized = to_openvino(model, table)
    by_name = {n.name: n for n in fq_model.graph.node}
    assert by_name["conv"].input[:] == [quantized["r"], quantized["w"]]
    assert by_name["mean"].input[0] == "r"  # not a consumer: reads the float value
    assert quantized["y"] == "y" and by_name["add"].output[0] != "y"  # the output keeps its name, quantized
    fakes = [n for n in fq_model.graph.node if n.op_type == "FakeQuantize"]
    assert {n.domain for n in fakes} == {FAKE_QUANTIZE_DOMAIN} and len(fakes) == 3
    assert FAKE_QUANTIZE_DOMAIN in {o.domain for o in fq_model.opset_import}
    inits = {i.name: numpy_helper.to_array(i) for i in fq_model.graph.initializer}
    weight_fq = next(n for n in fakes if n.input[0] == "w")
    assert helper.get_attribute_value(weight_fq.attribute[0]) == 256
    low, high = inits[weight_fq.input[1]], inits[weight_fq.input[2]]
    assert low.shape == high.shape == (3, 1, 1, 1)
    np.testing.assert_allclose(low.reshape(-1), [-1.28, -2.56, -3.84], rtol=1e-6)
    assert weight_fq.input[3] == weight_fq.input[1] and weight_fq.input[4] == weight_fq.input[2]
    assert fake_quantize_outputs(fq_model, table) == quantized


def test_unsupported_entries_are_rejected():
    model = model_of([helper.make_node("Relu", ["x"], ["y"], name="relu")], {"x": np.zeros(4)}, ["y"], {})
    log = TensorQParams(np.array([0.1]), np.array([0]), -127, 127, grid="log", data_max=4.0)
    with pytest.raises(ValueError, match="linear grids"):
        to_openvino(model, QParamTable({"x": log}))
    with pytest.raises(ValueError, match="does not have"):
        to_openvino(model, QParamTable({"nope": act(0.1, 0, 0, 255)}))


def test_run_openvino_exposes_intermediate_tensors(tmp_path):
    x = RNG.standard_normal((2, 3)).astype(np.float32)
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"), helper.make_node("Neg", ["r"], ["y"], name="neg")]
    path = save(model_of(nodes, {"x": x}, ["y"], {}), tmp_path / "m.onnx")
    out = run_openvino(path, {"x": x}, ["r", "y"], threads=1, precision=None)
    np.testing.assert_array_equal(out["r"], np.maximum(x, 0))
    np.testing.assert_array_equal(out["y"], -np.maximum(x, 0))
    assert list(run_openvino(path, {"x": x})) == ["y"]
    with pytest.raises(ValueError, match="no tensors named"):
        run_openvino(path, {"x": x}, ["missing"])


# -- OpenVINO against the Q/DQ model on onnxruntime -------------------------------------------------------


def deployed(
    factory, shape: list[int], seed: int = 0, reduce_range: bool = False
) -> tuple[onnx.ModelProto, QParamTable]:
    torch.manual_seed(seed)
    qmodel = prepare_by_platform(factory().eval(), "openvino", {"reduce_range": reduce_range})
    enable_calibration(qmodel)
    with torch.no_grad():
        for _ in range(3):
            qmodel(torch.randn(8, *shape[1:]))
    enable_quantization(qmodel)
    float_model, table, _, _ = convert_onnx(deployable_copy(qmodel), {"x": shape})
    return float_model, table


def _run(runtime: str, path, feeds: dict, names: list[str]) -> dict[str, np.ndarray]:
    """``"openvino"``: OpenVINO's CPU plugin; ``"formula"``: the FakeQuantize formula in standard ops on onnxruntime."""
    if runtime == "openvino":
        return run_openvino(path, feeds, names)
    return run_exposing(fake_quantize_as_onnx(onnx.load(str(path))), feeds, names)


def parity(
    float_model: onnx.ModelProto, table: QParamTable, x: np.ndarray, folder, local: bool, runtime: str = "openvino"
):
    """Per activation (max LSB difference, exact fraction, differences off a tie) of the FakeQuantize model
    vs onnxruntime's Q/DQ model.

    End to end, or with ``local`` each FakeQuantize output computed from onnxruntime's quantized values
    of the tensors before it (one layer's own difference); on OpenVINO or as the formula (``runtime``).
    A difference is at a tie when the Q/DQ model's input to that quantizer lies within 1e-3 step of a
    half step: there FakeQuantize's and QuantizeLinear's roundings may part (see the first test).
    """
    qdq, dequantized = insert_qdq(float_model, table)
    fq_model, quantized = to_openvino(float_model, table)
    acts = [t for t in table if table[t].kind == "activation"]
    reference = run_exposing(qdq, {"x": x}, [dequantized[t] for t in acts] + acts)
    if not local:
        path = save(fq_model, folder / "fq.onnx")
        got = _run(runtime, path, {"x": x}, [quantized[t] for t in acts])
    else:
        got = {}
        producers = {n.output[0]: n for n in fq_model.graph.node}
        fakes = {}  # quantized name -> its FakeQuantize (a graph output is an Identity of it)
        for name in quantized.values():
            node = producers[name]
            while node.op_type == "Identity":
                node = producers[node.input[0]]
            fakes[name] = node
        sources = {fakes[quantized[t]].input[0]: t for t in acts}  # the float tensor each quantizes
        for tensor in acts:
            stops = set(sources) - {fakes[quantized[tensor]].input[0]}
            inputs = _inputs_of(fq_model, quantized[tensor], stops)
            feeds = {n: reference[dequantized[sources[n]]] if n in sources else x for n in inputs}
            sub = _subgraph(fq_model, quantized[tensor], feeds)
            path = save(sub, folder / f"local_{len(got)}.onnx")
            got[quantized[tensor]] = _run(runtime, path, feeds, [quantized[tensor]])[quantized[tensor]]
    result = {}
    for t in acts:
        entry = table[t]
        diff = lsb_diff(got[quantized[t]], reference[dequantized[t]], entry)
        steps = reference[t].astype(np.float64) / float(entry.scale[0]) + float(entry.zero_point[0])
        tie = np.abs(steps - np.floor(steps) - 0.5) < 1e-3
        result[t] = int(diff.max()), float((diff == 0).mean()), int(((diff > 0) & ~tie).sum())
    return result


def _walk(model: onnx.ModelProto, target: str, stops: set[str]) -> tuple[dict[int, onnx.NodeProto], list[str]]:
    """The nodes computing ``target`` from the ``stops``, the graph inputs and constants; and the inputs reached."""
    producers = {o: n for n in model.graph.node for o in n.output}
    constants = {i.name for i in model.graph.initializer}
    nodes: dict[int, onnx.NodeProto] = {}
    inputs: list[str] = []
    stack = [target]
    while stack:
        name = stack.pop()
        if not name or name in constants or name in inputs or id(producers.get(name)) in nodes:
            continue
        if name in stops or name not in producers:
            inputs.append(name)
            continue
        nodes[id(producers[name])] = producers[name]
        stack.extend(producers[name].input)
    return nodes, inputs


def _inputs_of(model: onnx.ModelProto, target: str, stops: set[str]) -> list[str]:
    return _walk(model, target, stops)[1]


def _subgraph(model: onnx.ModelProto, target: str, feeds: dict[str, np.ndarray]) -> onnx.ModelProto:
    """``target`` computed from the tensors in ``feeds`` (which become the graph inputs)."""
    nodes, _ = _walk(model, target, set(feeds))
    constants = {i.name: i for i in model.graph.initializer}
    graph = helper.make_graph(
        [n for n in model.graph.node if id(n) in nodes],
        "local",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(v.shape)) for n, v in feeds.items()],
        [helper.make_empty_tensor_value_info(target)],
        list({i: constants[i] for n in nodes.values() for i in n.input if i in constants}.values()),
    )
    return helper.make_model(graph, opset_imports=list(model.opset_import))


@pytest.mark.parametrize("runtime", ["formula", "openvino"])
def test_one_layer_within_one_lsb(tmp_path, runtime):
    """Conv (per-channel int8 weights; 7-bit on OpenVINO where its kernels saturate) + Relu with unsigned output."""
    x, w, b = RNG.standard_normal((4, 3, 8, 8)), RNG.standard_normal((8, 3, 3, 3)) * 0.3, RNG.standard_normal(8) * 0.1
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["y"], name="relu"),
    ]
    model = model_of(nodes, {"x": x}, ["y"], {"w": w, "b": b})
    span = np.abs(w).reshape(8, -1).max(1)
    low, high = (-64, 63) if runtime == "openvino" and SATURATES else (-128, 127)
    # every weight inside the grid: Q/DQ's int8 cannot clamp at a 7-bit bound (deployed weights lie on their grid)
    weight = TensorQParams(span / high, np.zeros(8), low, high, axis=0, kind="weight")
    table = QParamTable({"x": act(0.03, 0, -128, 127), "w": weight, "y": act(0.02, 0, 0, 255)})
    # each quantizer from the Q/DQ model's quantized inputs: a tie of x rounded apart would move y by
    # up to max|w| * 0.03 / 0.02 steps end to end, which says nothing of the layer's own arithmetic
    result = parity(model, table, x.astype(np.float32), tmp_path, local=True, runtime=runtime)
    assert max(v[0] for v in result.values()) <= 1
    assert sum(v[2] for v in result.values()) == 0, result


@pytest.mark.parametrize(
    ("network", "shape"),
    [(DigitsCNN, [4, 1, 8, 8]), pytest.param(lambda: resnet18(num_classes=10), [1, 3, 32, 32], marks=pytest.mark.slow)],
    ids=["digits", "resnet18"],
)
@pytest.mark.parametrize("runtime", ["formula", "openvino"])
def test_network_layers_within_one_lsb(tmp_path, network, shape, runtime):
    float_model, table = deployed(network, shape, reduce_range=runtime == "openvino" and SATURATES)
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    local = parity(float_model, table, x, tmp_path, local=True, runtime=runtime)
    assert max(v[0] for v in local.values()) <= 1  # each layer on onnxruntime's quantized inputs
    # ties: unsigned ReLU outputs requantized to a signed grid of about twice the scale (ResNet's max pool, the
    # flattened pooled features) land on exact halves, which FakeQuantize's (x - low) * (levels - 1) /
    # (high - low) rounds apart from x / scale. Everywhere else each layer is exact.
    assert sum(v[2] for v in local.values()) == 0, {t: v for t, v in local.items() if v[2]}
    if shape[1] == 1:  # end to end on the small network (deeper ones pass 1-LSB steps on with gains above 1)
        end_to_end = parity(float_model, table, x, tmp_path, local=False, runtime=runtime)
        assert max(v[0] for v in end_to_end.values()) <= 2


def test_write(tmp_path):
    float_model, table = deployed(DigitsCNN, [1, 1, 8, 8], reduce_range=SATURATES)
    qdq, _ = insert_qdq(float_model, table)
    context = DeployContext(resolve_backend("openvino"), "m", tmp_path, float_model, qdq, table, ["x"], ["output"])
    path = write(context)
    assert path == tmp_path / "m_openvino.onnx"
    saved = onnx.load(str(path))
    assert fake_quantize_outputs(saved, table) == to_openvino(float_model, table)[1]
    assert len(fake_quantize_outputs(saved, table)) == len(table)
    x = np.random.default_rng(2).standard_normal((1, 1, 8, 8)).astype(np.float32)
    reference = run_exposing(qdq, {"x": x}, ["output"])["output"]
    for out in (run_openvino(path, {"x": x})["output"], _run("formula", path, {"x": x}, ["output"])["output"]):
        np.testing.assert_allclose(out, reference, atol=0.05 * np.abs(reference).max())
