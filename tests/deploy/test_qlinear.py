"""The QLinear (integer operator) form: integer formulas, op by op against the Q/DQ model, whole networks."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import pytest
import torch
from onnx import helper, numpy_helper

from mqbench.backends import resolve_backend
from mqbench.convert_deploy import DeployContext, convert_onnx, deployable_copy
from mqbench.deploy.qdq import insert_qdq
from mqbench.deploy.qlinear import CONTRIB_DOMAIN, exposed_tensors, float_ops, to_qlinear, write
from mqbench.deploy.qlinear_qdq import qlinear_as_qdq
from mqbench.deploy.reference import run_reference
from mqbench.deploy.table import QParamTable, TensorQParams
from mqbench.models import DigitsCNN, mobilenet_v2, resnet18
from mqbench.nn.quantized.saturation import ORT_QLINEAR_AVX2
from mqbench.prepare_by_platform import prepare_by_platform
from mqbench.utils.host import int8_pairs_saturate
from mqbench.utils.state import enable_calibration, enable_quantization
from onnx_helpers import model_of, run_exposing

RNG = np.random.default_rng(0)


def run_qlinear(model: onnx.ModelProto, feeds: dict, names: list[str], served: bool = False) -> dict[str, np.ndarray]:
    """What the QLinear graph computes: its arithmetic through the integer reference (the same on every host).

    With ``served`` (single operators), also onnxruntime serving it on this host, which must agree within 1 LSB
    with the reference computing as this host's int8 kernels do (16-bit pair sums on a CPU without VNNI).
    """
    as_qdq = qlinear_as_qdq(model)
    values = run_reference(as_qdq, feeds, names, rounding="half_even")
    if served:
        kernels = ORT_QLINEAR_AVX2 if int8_pairs_saturate() else None
        modelled = run_reference(as_qdq, feeds, names, rounding="half_even", saturation=kernels)
        on_host = run_exposing(model, feeds, names, optimize=True)
        for name in names:
            if np.issubdtype(on_host[name].dtype, np.integer):
                diff = np.abs(on_host[name].astype(np.int64) - modelled[name].astype(np.int64))
                assert diff.max(initial=0) <= 1, name
    return values


@pytest.fixture(autouse=True)
def _same_data_whatever_runs_first():
    RNG.bit_generator.state = np.random.default_rng(0).bit_generator.state


def act(scale: float, zero_point: int, low: int, high: int) -> TensorQParams:
    return TensorQParams(np.array([scale]), np.array([zero_point]), low, high)


def weight(values: np.ndarray, low: int, high: int, per_channel: bool, axis: int = 0) -> TensorQParams:
    """Symmetric (signed) or mid-range (unsigned) weight quantization covering ``values``."""
    reduce = tuple(i for i in range(values.ndim) if i != axis) if per_channel else None
    span = np.abs(values).max(axis=reduce).reshape(-1) if per_channel else np.array([np.abs(values).max()])
    zero = np.full(span.shape, 0 if low < 0 else (low + high + 1) // 2)
    return TensorQParams(span / ((high - low) / 2), zero, low, high, axis=axis if per_channel else None, kind="weight")


def integer_parity(model: onnx.ModelProto, table: QParamTable, feeds: dict, local: bool = False, **options: str):
    """QLinear vs Q/DQ on onnxruntime over every integer tensor: (QLinear model, max LSB difference, exact fraction).

    End to end by default; with ``local`` each QLinear tensor is computed from the Q/DQ model's integer
    inputs instead (one operator's own error, without what earlier operators passed on).
    """
    qdq, dequantized = insert_qdq(model, table)
    qlinear, integers = to_qlinear(qdq, table, **options)
    producers = {o: n for n in qdq.graph.node for o in n.output}
    inits = {i.name: numpy_helper.to_array(i) for i in qdq.graph.initializer}
    reference: dict[str, tuple[str, int]] = {}  # tensor -> (its integer tensor in the Q/DQ model, zero point)
    for tensor in integers:
        node = producers[dequantized[tensor]]
        node = producers[node.input[0]] if node.op_type == "Identity" else node  # a quantized network output
        reference[tensor] = node.input[0], int(inits[node.input[2]]) if table[tensor].kind == "activation" else 0
    acts = [t for t in integers if table[t].kind == "activation"]
    outputs = [v.name for v in qdq.graph.output]
    ref = run_exposing(qdq, feeds, outputs + [reference[t][0] for t in acts])
    got = run_qlinear(qlinear, feeds, outputs + [integers[t][0] for t in acts])
    if local:
        got = _local_values(
            qlinear,
            integers,
            acts,
            {t: ref[reference[t][0]].astype(np.int32) - reference[t][1] for t in acts},
            feeds,
            got,
        )
    worst, exact, total = 0, 0, 0
    for tensor in acts:
        name, _, zero = integers[tensor]
        expected = ref[reference[tensor][0]].astype(np.int32) - reference[tensor][1]
        diff = np.abs(got[name].astype(np.int32) - zero - expected)
        worst, exact, total = max(worst, int(diff.max())), exact + int((diff == 0).sum()), total + diff.size
    for name in outputs if not local else []:
        if name in table:
            worst = max(worst, int(np.rint(np.abs(ref[name] - got[name]) / float(table[name].scale[0])).max()))
        else:  # a float output (a float op after the last quantizer): one input LSB moves it a little
            np.testing.assert_allclose(got[name], ref[name], atol=0.05 * float(np.abs(ref[name]).max()) + 1e-6)
    return qlinear, worst, exact / max(total, 1)


def _local_values(qlinear, integers, acts, centred, feeds, full) -> dict[str, np.ndarray]:
    """Each integer tensor of ``qlinear`` computed by its own subgraph from the reference integers before it."""
    producers = {o: n for n in qlinear.graph.node for o in n.output}
    constants = {i.name: i for i in qlinear.graph.initializer}
    mapped = {integers[t][0]: t for t in acts}
    values = {}
    for tensor in acts:
        target = integers[tensor][0]
        nodes, inputs, stack = {}, set(), [target]
        while stack:
            name = stack.pop()
            if not name or name in constants or id(producers.get(name)) in nodes:
                continue
            if (name in mapped and name != target) or name not in producers:
                inputs.add(name)
                continue
            nodes[id(producers[name])] = producers[name]
            stack.extend(producers[name].input)
        local_feeds = {}
        for name in inputs:
            source = mapped.get(name)
            value = feeds[name] if source is None else (centred[source] + integers[source][2]).astype(full[name].dtype)
            local_feeds[name] = value
        graph = helper.make_graph(
            [n for n in qlinear.graph.node if id(n) in nodes],
            "local",
            [
                helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
                for n, v in local_feeds.items()
            ],
            [helper.make_empty_tensor_value_info(target)],
            list({i: constants[i] for n in nodes.values() for i in n.input if i in constants}.values()),
        )
        sub = helper.make_model(graph, opset_imports=list(qlinear.opset_import))
        values[target] = run_qlinear(sub, local_feeds, [target], served=True)[target]
    return values


def op_counts(model: onnx.ModelProto) -> Counter:
    return Counter(n.op_type for n in model.graph.node)


# -- QLinearConv against the integer formula --------------------------------------------------


def reference_conv(x, x_entry, w, w_entry, bias, y_entry, relu):
    """int32 accumulation of zero-point-centred integers (3x3, pad 1), int32 bias, float64 requantization."""
    quantize = lambda v, e, shape: np.clip(  # noqa: E731
        np.rint(v.astype(np.float32) / e.scale.reshape(shape)) + e.zero_point.reshape(shape), e.quant_min, e.quant_max
    )
    xq = quantize(x, x_entry, (1,)) - x_entry.zero_point[0]
    wq = quantize(w, w_entry, (-1, 1, 1, 1) if w_entry.axis is not None else (1,))
    wq = wq - w_entry.zero_point.reshape(-1, 1, 1, 1)
    padded = np.pad(xq, ((0, 0), (0, 0), (1, 1), (1, 1))).astype(np.int64)
    _, c, h, wd = x.shape
    windows = np.stack([padded[:, :, i : i + h, j : j + wd] for i in range(3) for j in range(3)], axis=-1)
    acc = np.einsum("nchwk,ock->nohw", windows, wq.reshape(wq.shape[0], c, 9).astype(np.int64))
    acc_scale = np.float64(x_entry.scale[0]) * w_entry.scale.astype(np.float64)
    acc_scale = np.broadcast_to(acc_scale, (w.shape[0],))
    acc += np.rint(bias.astype(np.float64) / acc_scale).astype(np.int64).reshape(1, -1, 1, 1)
    y = np.rint(acc * acc_scale.reshape(1, -1, 1, 1) / np.float64(y_entry.scale[0])) + y_entry.zero_point[0]
    low = max(y_entry.quant_min, int(y_entry.zero_point[0])) if relu else y_entry.quant_min
    assert np.abs(acc).max() < 2**31
    return np.clip(y, low, y_entry.quant_max).astype(np.int64)


CONV_CASES = {
    "u8-act_s8-per-channel": (act(0.05, 7, 0, 255), (-127, 127, True), act(0.1, 0, 0, 255)),
    "s8-act_u8-weights": (act(0.04, -3, -128, 127), (0, 255, False), act(0.08, 5, -128, 127)),
    "narrow-symmetric": (act(0.03, 0, -127, 127), (-127, 127, True), act(0.07, 0, -127, 127)),
}


@pytest.mark.parametrize("relu", [True, False])
@pytest.mark.parametrize("activation_type", ["uint8", "int8"])
@pytest.mark.parametrize("case", list(CONV_CASES))
def test_qlinear_conv_matches_integer_formula(case, activation_type, relu):
    x_entry, (low, high, per_channel), y_entry = CONV_CASES[case]
    w = RNG.standard_normal((5, 3, 3, 3)).astype(np.float32) * 0.3
    bias = RNG.standard_normal(5).astype(np.float32) * 0.2
    w_entry = weight(w, low, high, per_channel)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1], kernel_shape=[3, 3])]
    nodes.append(
        helper.make_node("Relu", ["c"], ["y"], name="relu") if relu else helper.make_node("Identity", ["c"], ["y"])
    )
    x = RNG.standard_normal((2, 3, 6, 6)).astype(np.float32) * 2
    model = model_of(nodes, {"x": x}, ["y"], {"w": w, "b": bias})
    table = QParamTable({"x": x_entry, "w": w_entry, "y": y_entry})
    qlinear, integers = to_qlinear(insert_qdq(model, table)[0], table, activation_type=activation_type)
    counts = op_counts(qlinear)
    assert counts["QLinearConv"] == 1 and counts["Conv"] == 0 and counts["Relu"] == 0
    name, scale, zero = integers["y"]
    got = run_qlinear(qlinear, {"x": x}, [name], served=True)[name].astype(np.int64) - zero
    expected = reference_conv(x, x_entry, w, w_entry, bias, y_entry, relu) - int(y_entry.zero_point[0])
    assert scale == pytest.approx(float(y_entry.scale[0]))
    assert np.abs(got - expected).max() <= 1
    assert (got == expected).mean() > 0.99


# -- every operator against the Q/DQ model ------------------------------------------------------


def _unary(op: str, **attrs):
    def build():
        x = RNG.standard_normal((2, 3, 6, 6)).astype(np.float32)
        model = model_of([helper.make_node(op, ["x"], ["y"], name=op, **attrs)], {"x": x}, ["y"], {})
        low = act(0.004, 0, 0, 255) if op == "Sigmoid" else act(0.02, 10, 0, 255)
        return model, {"x": act(0.03, 128, 0, 255), "y": low}, {"x": x}

    return build


def _binary(op: str, broadcast: bool):
    def build():
        a = RNG.standard_normal((2, 3, 4, 4)).astype(np.float32)
        b = RNG.standard_normal((1, 3, 1, 1) if broadcast else (2, 3, 4, 4)).astype(np.float32)
        model = model_of([helper.make_node(op, ["a", "b"], ["y"], name=op)], {"a": a, "b": b}, ["y"], {})
        table = {"a": act(0.03, 0, -128, 127), "b": act(0.02, 100, 0, 255), "y": act(0.05, -7, -128, 127)}
        return model, table, {"a": a, "b": b}

    return build


def _gemm(alpha: float = 1.0, beta: float = 1.0):
    def build():
        x, w, b = RNG.standard_normal((3, 6)), RNG.standard_normal((4, 6)) * 0.5, RNG.standard_normal(4) * 0.1
        node = helper.make_node("Gemm", ["x", "w", "b"], ["y"], name="fc", transB=1, alpha=alpha, beta=beta)
        model = model_of([node], {"x": x}, ["y"], {"w": w, "b": b})
        table = {"x": act(0.03, 0, -128, 127), "w": weight(w, -128, 127, True), "y": act(0.06, 3, -128, 127)}
        return model, table, {"x": x.astype(np.float32)}

    return build


def _matmul(constant: bool):
    def build():
        a = RNG.standard_normal((2, 3, 6)).astype(np.float32)
        b = (RNG.standard_normal((6, 4)) if constant else RNG.standard_normal((2, 6, 4))).astype(np.float32)
        model = model_of(
            [helper.make_node("MatMul", ["a", "b"], ["y"], name="mm")],
            {"a": a, **({} if constant else {"b": b})},
            ["y"],
            {"b": b} if constant else {},
        )
        b_entry = weight(b, -128, 127, True, axis=1) if constant else act(0.03, 0, -128, 127)
        table = {"a": act(0.03, 5, 0, 255), "b": b_entry, "y": act(0.1, 128, 0, 255)}
        return model, table, {"a": a, **({} if constant else {"b": b})}

    return build


def _concat():
    x = [RNG.standard_normal((1, c, 4, 4)).astype(np.float32) for c in (2, 3)]
    model = model_of(
        [helper.make_node("Concat", ["a", "b"], ["y"], name="cat", axis=1)], {"a": x[0], "b": x[1]}, ["y"], {}
    )
    return (
        model,
        {"a": act(0.03, 0, 0, 255), "b": act(0.02, 0, 0, 255), "y": act(0.03, 0, 0, 255)},
        {"a": x[0], "b": x[1]},
    )


def _average_pool(count_include_pad: int):
    def build():
        x = RNG.standard_normal((1, 3, 7, 7)).astype(np.float32)
        node = helper.make_node(
            "AveragePool",
            ["x"],
            ["y"],
            name="pool",
            kernel_shape=[3, 3],
            pads=[1, 1, 1, 1],
            strides=[2, 2],
            count_include_pad=count_include_pad,
        )
        return (
            model_of([node], {"x": x}, ["y"], {}),
            {"x": act(0.03, 0, -128, 127), "y": act(0.01, 0, -128, 127)},
            {"x": x},
        )

    return build


def _chain():
    """Conv -> Relu -> MaxPool -> Flatten -> Gemm: the Relu fuses, MaxPool and Flatten run on integers."""
    x, w, fc = RNG.standard_normal((2, 2, 6, 6)), RNG.standard_normal((4, 2, 3, 3)), RNG.standard_normal((5, 36))
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv", kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
        helper.make_node("MaxPool", ["r"], ["p"], name="pool", kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Flatten", ["p"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "fc"], ["y"], name="fc", transB=1),
    ]
    model = model_of(nodes, {"x": x}, ["y"], {"w": w, "fc": fc})
    table = {"x": act(0.05, 0, -127, 127), "w": weight(w, -127, 127, True), "f": act(0.04, 0, -127, 127),
             "fc": weight(fc, -127, 127, True), "y": act(0.2, 0, -127, 127)}  # fmt: skip
    return model, table, {"x": x.astype(np.float32)}


def _resize():
    x = RNG.standard_normal((1, 2, 3, 3)).astype(np.float32)
    scales = np.array([1, 1, 2, 2], np.float32)
    nodes = [helper.make_node("Resize", ["x", "", "scales"], ["r"], name="up", mode="nearest"),
             helper.make_node("Add", ["r", "r2"], ["y"], name="add")]  # fmt: skip
    r2 = RNG.standard_normal((1, 2, 6, 6)).astype(np.float32)
    model = model_of(nodes, {"x": x, "r2": r2}, ["y"], {"scales": scales})
    table = {"r": act(0.03, 0, 0, 255), "r2": act(0.02, 128, 0, 255), "y": act(0.05, 128, 0, 255)}
    return model, table, {"x": x, "r2": r2}


OPS = {
    "QLinearGlobalAveragePool": _unary("GlobalAveragePool"),
    "QLinearLeakyRelu": _unary("LeakyRelu", alpha=0.1),
    "QLinearSigmoid": _unary("Sigmoid"),
    "QLinearAdd": _binary("Add", broadcast=False),
    "QLinearAdd-broadcast": _binary("Add", broadcast=True),
    "QLinearMul": _binary("Mul", broadcast=False),
    "QGemm": _gemm(),
    "QGemm-alpha-beta": _gemm(alpha=0.5, beta=2.0),
    "QLinearMatMul-per-column": _matmul(constant=True),
    "QLinearMatMul-two-activations": _matmul(constant=False),
    "QLinearConcat": _concat,
    "QLinearAveragePool": _average_pool(0),
    "QLinearAveragePool-include-pad": _average_pool(1),
    "QLinearConv+QGemm-chain": _chain,
    "QLinearAdd-after-resize": _resize,
}


@pytest.mark.parametrize("activation_type", ["uint8", "int8"])
@pytest.mark.parametrize("case", list(OPS))
def test_operator_matches_qdq_within_one_lsb(case, activation_type):
    model, entries, feeds = OPS[case]()
    table = QParamTable(entries)
    qlinear, worst, exact = integer_parity(model, table, feeds, activation_type=activation_type)
    counts = op_counts(qlinear)
    for op in case.split("-")[0].split("+"):
        assert counts[op] >= 1, counts
    float_ops = {"Conv", "Gemm", "MatMul", "Add", "Mul", "Concat", "AveragePool", "GlobalAveragePool", "Relu"}
    float_ops |= {"LeakyRelu", "Sigmoid"}
    assert not float_ops & set(counts), counts
    assert counts["DequantizeLinear"] == 1  # the network output only
    assert worst <= 1 and exact > 0.9  # 1-LSB steps: float requantization vs integer kernels at near ties
    if any(n.domain == CONTRIB_DOMAIN for n in qlinear.graph.node):
        assert CONTRIB_DOMAIN in {o.domain for o in qlinear.opset_import}


def test_unquantized_operands_stay_float_and_run():
    """A Conv whose output is not quantized, and an Add with a float operand, keep DQ before and float math."""
    x, w, extra = (
        RNG.standard_normal((1, 2, 5, 5)),
        RNG.standard_normal((3, 2, 3, 3)),
        RNG.standard_normal((1, 3, 3, 3)),
    )
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
        helper.make_node("Add", ["c", "e"], ["a"], name="add"),
        helper.make_node("Softmax", ["a"], ["y"], name="softmax", axis=1),
    ]
    model = model_of(nodes, {"x": x, "e": extra}, ["y"], {"w": w})
    table = QParamTable({"x": act(0.03, 0, -128, 127), "w": weight(w, -128, 127, True), "a": act(0.1, 0, -128, 127)})
    qdq, _ = insert_qdq(model, table)
    feeds = {"x": x.astype(np.float32), "e": extra.astype(np.float32)}
    qlinear, _, _ = integer_parity(model, table, feeds)
    counts = op_counts(qlinear)
    assert counts["Conv"] == 1 and counts["Add"] == 1 and counts["QLinearConv"] == 0
    np.testing.assert_array_equal(run_exposing(qlinear, feeds, ["y"])["y"], run_exposing(qdq, feeds, ["y"])["y"])


def test_options_and_errors():
    model, entries, feeds = _gemm()()
    table = QParamTable(entries)
    qdq, _ = insert_qdq(model, table)
    with pytest.raises(ValueError, match="activation_type"):
        to_qlinear(qdq, table, activation_type="int16")
    with pytest.raises(ValueError, match="weight_type"):
        to_qlinear(qdq, table, weight_type="float")
    with pytest.raises(ValueError, match="does not have"):
        to_qlinear(qdq, QParamTable({**entries, "missing": act(0.1, 0, 0, 255)}))
    old = onnx.ModelProto.FromString(qdq.SerializeToString())
    old.opset_import[0].version = 11
    with pytest.raises(ValueError, match="opset 13"):
        to_qlinear(old, table)
    # weights moved to the other 8-bit type give the same integers
    assert integer_parity(model, table, feeds, weight_type="uint8")[1] <= 1


# -- whole networks ---------------------------------------------------------------------------------


def deployed(factory, backend: str, shape: list[int], seed: int = 0) -> tuple[onnx.ModelProto, QParamTable]:
    """The float model and table of a (seeded) ``factory()`` network prepared for ``backend``, calibrated."""
    torch.manual_seed(seed)
    qmodel = prepare_by_platform(factory().eval(), backend)
    enable_calibration(qmodel)
    with torch.no_grad():
        for _ in range(3):
            qmodel(torch.randn(8, *shape[1:]))
    enable_quantization(qmodel)
    float_model, table, _, _ = convert_onnx(deployable_copy(qmodel), {"x": shape})
    return float_model, table


def quantized_convs(qdq: onnx.ModelProto) -> tuple[int, int]:
    """(Convs, Convs reading a DequantizeLinear whose output reaches a QuantizeLinear through Relu/Clip only)."""
    readers: dict[str, list] = {}
    for node in qdq.graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    producers = {o: n for n in qdq.graph.node for o in n.output}
    total = quantized = 0
    for node in qdq.graph.node:
        if node.op_type != "Conv":
            continue
        total += 1
        source = producers.get(node.input[0])
        tensor, ok = node.output[0], source is not None and source.op_type == "DequantizeLinear"
        while ok and len(readers.get(tensor, [])) == 1 and readers[tensor][0].op_type in ("Relu", "Clip"):
            tensor = readers[tensor][0].output[0]
        outputs = {v.name for v in qdq.graph.output}
        quantized += ok and tensor not in outputs and [n.op_type for n in readers.get(tensor, [])] == ["QuantizeLinear"]
    return total, quantized


NETWORKS = {
    "digits": (DigitsCNN, [1, 1, 8, 8]),
    "resnet18": (lambda: resnet18(num_classes=10), [1, 3, 32, 32]),
    "mobilenet_v2": (lambda: mobilenet_v2(num_classes=10), [1, 3, 32, 32]),
}


@pytest.mark.parametrize(
    ("network", "backend"),
    [("digits", "qdq"), ("digits", "onnx_qnn"), ("digits", "openvino")]
    + [pytest.param(n, b, marks=pytest.mark.slow) for n in ("resnet18", "mobilenet_v2") for b in ("qdq", "onnx_qnn")],
)
def test_network_is_integer_and_within_one_lsb(network, backend):
    factory, shape = NETWORKS[network]
    float_model, table = deployed(factory, backend, shape)
    qdq, _ = insert_qdq(float_model, table)
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    qlinear, worst, exact = integer_parity(float_model, table, {"x": x}, local=True)
    assert worst <= 1 and exact > 0.99  # each operator on the same integer inputs
    if network == "digits":  # end to end as well (deep random networks pass 1-LSB steps on with gains above 1)
        assert integer_parity(float_model, table, {"x": x})[1] <= 1
    total, quantized = quantized_convs(qdq)
    counts = op_counts(qlinear)
    assert quantized == total > 0
    assert counts["QLinearConv"] == quantized and counts["Conv"] == 0
    if backend == "onnx_qnn":  # all-integer placement: the classifier too, one DequantizeLinear at the end
        assert counts["QGemm"] == 1 and counts["DequantizeLinear"] == 1 and counts["QuantizeLinear"] == 1


def test_metadata_and_write(tmp_path):
    float_model, table = deployed(DigitsCNN, "onnx_qnn", [1, 1, 8, 8])
    qdq, _ = insert_qdq(float_model, table)
    context = DeployContext(resolve_backend("onnx_qnn"), "m", tmp_path, float_model, qdq, table, ["x"], ["output"])
    path = write(context)
    assert path == tmp_path / "m_qlinear.onnx"
    saved = onnx.load(str(path))
    _, integers = to_qlinear(qdq, table)
    read = exposed_tensors(saved, table)
    assert set(read) == set(integers) == set(table)  # every tensor, weights included
    for tensor, (name, scale, zero) in integers.items():
        assert read[tensor][0] == name
        np.testing.assert_array_equal(read[tensor][1], scale)
        np.testing.assert_array_equal(read[tensor][2], zero)
    with pytest.raises(ValueError, match="metadata"):
        exposed_tensors(qdq, table)


# -- graphs that read a tensor's shape ---------------------------------------------------------------


def _shape_reader_model(kind: str) -> tuple[onnx.ModelProto, QParamTable]:
    """``x -> Relu -> a``, then ``a`` reshaped to ``(n, -1)``, resized to 6x6 or cut in two along the channels
    (``x.chunk(2, dim=1)``), by sizes read off ``Shape(a)``; the parts added."""
    nodes = [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Shape", ["a"], ["s"])]
    second = "r"
    if kind == "reshape":
        longs = {"zero": np.array(0), "axes": np.array([0]), "flat": np.array([-1])}
        nodes += [
            helper.make_node("Gather", ["s", "zero"], ["n"]),
            helper.make_node("Unsqueeze", ["n", "axes"], ["n1"]),
            helper.make_node("Concat", ["n1", "flat"], ["shape"], axis=0),
            helper.make_node("Reshape", ["a", "shape"], ["r"]),
        ]
    elif kind == "resize":
        longs = {"starts": np.array([0]), "ends": np.array([2]), "spatial": np.array([6, 6])}
        nodes += [
            helper.make_node("Slice", ["s", "starts", "ends"], ["batch_channels"]),
            helper.make_node("Concat", ["batch_channels", "spatial"], ["sizes"], axis=0),
            helper.make_node("Resize", ["a", "", "", "sizes"], ["r"], mode="nearest"),
        ]
    else:
        longs = {"one": np.array([1]), "two": np.array([2]), "zero": np.array([0])}
        nodes += [
            helper.make_node("Gather", ["s", "one"], ["channels"]),
            helper.make_node("Div", ["channels", "two"], ["half"]),
            helper.make_node("Slice", ["a", "zero", "half", "one"], ["r"]),
            helper.make_node("Slice", ["a", "half", "channels", "one"], ["r_1"]),
        ]
        second = "r_1"
    nodes.append(helper.make_node("Add", ["r", second], ["y"]))
    model = model_of(nodes, {"x": np.zeros((2, 4, 4, 4))}, ["y"], {})
    model.graph.initializer.extend(numpy_helper.from_array(v.astype(np.int64), n) for n, v in longs.items())
    grid = act(0.025, 0, 0, 255)
    return model, QParamTable(
        {"x": act(0.05, 128, 0, 255), "a": grid, "r": grid, second: grid, "y": act(0.05, 0, 0, 255)}
    )


@pytest.mark.parametrize("kind", ["reshape", "resize", "chunk"])
def test_shape_of_a_quantized_tensor_is_read_off_its_integers(kind):
    """Shape(DQ(a)) is Shape(a_q): no DequantizeLinear may read the int64 shape, and the file stays valid.

    The data movement after it (Reshape, nearest Resize, the Slices of a chunk) runs on the integers too."""
    model, table = _shape_reader_model(kind)
    feeds = {"x": RNG.standard_normal((2, 4, 4, 4)).astype(np.float32)}
    qlinear, worst, exact = integer_parity(model, table, feeds)
    onnx.shape_inference.infer_shapes(qlinear, check_type=True, strict_mode=True)  # DequantizeLinear takes no int64
    producers = {o: n for n in qlinear.graph.node for o in n.output}
    shape_of = next(n for n in qlinear.graph.node if n.op_type == "Shape")
    assert producers[shape_of.input[0]].op_type in ("QuantizeLinear", "Clip")  # the integers of a
    assert not [n for n in qlinear.graph.node if n.op_type == "DequantizeLinear" and n.input[0] == shape_of.output[0]]
    assert worst <= 1 and exact > 0.99
    assert op_counts(qlinear)["QLinearAdd"] == 1 and float_ops(qlinear) == []


def _interpolate_flatten_gemm(mode: str, size_in: tuple[int, int], size_out: tuple[int, int], **attrs: str):
    """Resize (sizes) -> Flatten -> Gemm between quantized tensors, one axis shrinking and the other growing."""
    x = RNG.standard_normal((2, 2, *size_in)).astype(np.float32)
    fc = RNG.standard_normal((3, 2 * size_out[0] * size_out[1])).astype(np.float32) * 0.1
    sizes = np.array([2, 2, *size_out], np.int64)
    nodes = [
        helper.make_node("Resize", ["x", "", "", "sizes"], ["r"], name="interpolate", mode=mode, **attrs),
        helper.make_node("Flatten", ["r"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "fc"], ["y"], name="fc", transB=1),
    ]
    model = model_of(nodes, {"x": x}, ["y"], {"fc": fc})
    model.graph.initializer.append(numpy_helper.from_array(sizes, "sizes"))  # int64, as ONNX requires
    table = {"x": act(0.03, 0, -127, 127), "f": act(0.025, 0, -127, 127),
             "fc": weight(fc, -127, 127, True), "y": act(0.05, 0, -127, 127)}  # fmt: skip
    return model, table, {"x": x}


@pytest.mark.parametrize(
    "case",
    [
        ("linear", (9, 10), (8, 14), {"coordinate_transformation_mode": "half_pixel"}),
        ("nearest", (14, 16), (18, 11), {"coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"}),
    ],
    ids=["bilinear-9x10-to-8x14", "nearest-14x16-to-18x11"],
)
def test_interpolate_that_shrinks_one_axis_and_grows_another_matches_qdq(case):
    """The QLinear graph's arithmetic (integer reference) against the Q/DQ model on onnxruntime: the Resize
    interpolates (or picks) as onnxruntime does, so the flattened tensor after it agrees within 1 LSB."""
    mode, size_in, size_out, attrs = case
    model, entries, feeds = _interpolate_flatten_gemm(mode, size_in, size_out, **attrs)
    qlinear, worst, exact = integer_parity(model, QParamTable(entries), feeds)
    assert "Resize" in op_counts(qlinear)
    assert worst <= 1 and exact > 0.95
