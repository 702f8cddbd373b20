"""The integer reference executor: fixed-point helpers, a hand-built conv against a formula, onnxruntime parity."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from mqbench.convert_deploy import convert_onnx, deployable_copy
from mqbench.deploy import reference
from mqbench.deploy.onnx_graph import ort_session
from mqbench.deploy.qdq import insert_qdq
from mqbench.deploy.reference import ROUNDINGS, requantize, requantize_multiplier, run_reference
from mqbench.models import DigitsCNN, resnet18
from mqbench.nn.quantized.saturation import ORT_QLINEAR_AVX2, PairSaturation
from mqbench.prepare_by_platform import prepare_by_platform
from mqbench.utils.host import int8_pairs_saturate
from mqbench.utils.state import enable_calibration, enable_quantization


# -- fixed-point helpers -----------------------------------------------------------------------
def test_requantize_multiplier_accuracy_and_range():
    rng = np.random.default_rng(0)
    reals = [0.5, 1.0, 2.0, 2.0**-40, 1 - 2.0**-40, 0.75, 1e-9, 123.456, 2.0**29]
    reals += list(10.0 ** rng.uniform(-12, 8, 500))
    for real in reals:
        m0, shift = requantize_multiplier(real)
        assert isinstance(m0, int) and isinstance(shift, int)
        assert 2**30 <= m0 < 2**31 and shift >= 1
        error = abs(Fraction(m0, 2**shift) - Fraction(real))
        assert error <= Fraction(real) * Fraction(1, 2**31), real


@pytest.mark.parametrize("bad", [0.0, -0.5, math.nan, math.inf, 2.0**31])
def test_requantize_multiplier_rejects(bad):
    with pytest.raises(ValueError, match="multiplier"):
        requantize_multiplier(bad)


def _exact_round(value: Fraction, rounding: str) -> int:
    if rounding == "half_even":
        return round(value)
    if rounding == "half_up":
        return math.floor(value + Fraction(1, 2))
    return int(math.copysign(math.floor(abs(value) + Fraction(1, 2)), value))


@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_requantize_equals_exact_rounding(rounding):
    rng = np.random.default_rng(1)
    acc = np.concatenate([rng.integers(-(2**31), 2**31, 300), rng.integers(-2000, 2000, 300), [0, -(2**31), 2**31 - 1]])
    for real in (0.25, 0.5, 1 / 3, 1.7, 3.1e-4, 2.0**-20):
        m0, shift = requantize_multiplier(real)
        got = requantize(acc, m0, shift, zero_point=0, qmin=-(2**40), qmax=2**40, rounding=rounding)
        expected = [_exact_round(Fraction(int(a) * m0, 2**shift), rounding) for a in acc]
        assert got.tolist() == expected, real
    # ties resolved per mode
    m0, shift = requantize_multiplier(0.5)
    assert requantize(np.array([-3, -1, 1, 3]), m0, shift, rounding=rounding).tolist() == [
        _exact_round(Fraction(v, 2), rounding) for v in (-3, -1, 1, 3)
    ]


def test_requantize_saturates_tiny_multipliers_and_checks_int32():
    m0, shift = requantize_multiplier(2.0**-70)  # shift past 62: everything rounds to the zero point
    assert shift > 62
    assert requantize(np.array([2**31 - 1, -(2**31)]), m0, shift, zero_point=4).tolist() == [4, 4]
    m0, shift = requantize_multiplier(0.5)
    assert requantize(np.array([1000, -1000]), m0, shift, zero_point=10, qmin=0, qmax=255).tolist() == [255, 0]
    with pytest.raises(ValueError, match="int32"):
        requantize(np.array([2**31]), m0, shift)
    with pytest.raises(ValueError, match="rounding"):
        requantize(np.array([1]), m0, shift, rounding="nearest")


# -- a hand-built Q/DQ conv against an integer formula written here -------------------------------
def _const(name: str, value) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(value), name)


def _conv_model(rng, group: int, stride: int, pad: int, dilation: int):
    cin, cout, k = 3, 6, 3
    p = {
        "sx": np.float32(0.05),
        "zx": np.int8(3),
        "wq": rng.integers(-127, 128, (cout, cin // group, k, k)).astype(np.int8),
        "ws": rng.uniform(0.005, 0.02, cout).astype(np.float32),
        "wz": np.zeros(cout, np.int8),
        "b": rng.normal(0, 0.5, cout).astype(np.float32),
        "sy": np.float32(0.03),
        "zy": np.uint8(5),
    }
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "sx", "zx"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "sx", "zx"], ["xd"]),
        helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["wd"], axis=0),
        helper.make_node(
            "Conv",
            ["xd", "wd", "b"],
            ["conv"],
            group=group,
            strides=[stride, stride],
            pads=[pad] * 4,
            dilations=[dilation, dilation],
        ),
        helper.make_node("Relu", ["conv"], ["relu"]),
        helper.make_node("QuantizeLinear", ["relu", "sy", "zy"], ["yq"]),
        helper.make_node("DequantizeLinear", ["yq", "sy", "zy"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, cin, 9, 9])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [_const(name, value) for name, value in p.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), p


def _formula(x: np.ndarray, p: dict, group: int, stride: int, pad: int, dilation: int) -> tuple[np.ndarray, ...]:
    """Integer conv by loops over output positions and an int64 einsum per group, then the requantization."""
    xq = np.clip(np.rint(x / p["sx"]) + int(p["zx"]), -128, 127).astype(np.int64)
    xc = np.pad(xq - int(p["zx"]), ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    wq = p["wq"].astype(np.int64) - p["wz"].astype(np.int64)[:, None, None, None]
    cout, cg, k, _ = wq.shape
    og, span = cout // group, (k - 1) * dilation + 1
    oh = (xc.shape[2] - span) // stride + 1
    ow = (xc.shape[3] - span) // stride + 1
    acc = np.zeros((x.shape[0], cout, oh, ow), np.int64)
    for i in range(oh):
        for j in range(ow):
            window = xc[:, :, i * stride : i * stride + span : dilation, j * stride : j * stride + span : dilation]
            for g in range(group):
                acc[:, g * og : (g + 1) * og, i, j] = np.einsum(
                    "nckl,ockl->no", window[:, g * cg : (g + 1) * cg], wq[g * og : (g + 1) * og]
                )
    acc_scale = float(p["sx"]) * p["ws"].astype(np.float64)
    acc += np.rint(p["b"].astype(np.float64) / acc_scale).astype(np.int64)[None, :, None, None]
    yq = np.zeros_like(acc)
    zy = int(p["zy"])
    for index, value in np.ndenumerate(acc):
        m0, shift = requantize_multiplier(acc_scale[index[1]] / float(p["sy"]))
        y = ((int(value) * m0 + (1 << (shift - 1))) >> shift) + zy  # round half up
        yq[index] = min(max(y, zy, 0), 255)  # Relu is the clamp at the zero point
    return acc, acc_scale, yq


@pytest.mark.parametrize(
    ("group", "stride", "pad", "dilation"), [(1, 1, 0, 1), (1, 2, 1, 1), (3, 1, 1, 1), (1, 1, 2, 2)]
)
def test_tiny_conv_equals_integer_formula(group, stride, pad, dilation):
    rng = np.random.default_rng(group * 100 + stride * 10 + pad + dilation)
    model, p = _conv_model(rng, group, stride, pad, dilation)
    x = rng.normal(0, 2, (2, 3, 9, 9)).astype(np.float32)
    acc, acc_scale, yq = _formula(x, p, group, stride, pad, dilation)
    out = run_reference(model, {"x": x}, ["yq", "y", "conv", "xq"])
    assert out["yq"].dtype == np.uint8
    np.testing.assert_array_equal(out["yq"], yq)
    np.testing.assert_array_equal(out["y"], ((yq - int(p["zy"])) * np.float64(p["sy"])).astype(np.float32))
    # the Conv output is the accumulator's real value
    np.testing.assert_array_equal(out["conv"], (acc * acc_scale[None, :, None, None]).astype(np.float32))
    ort = ort_session(model, optimize=False).run(None, {"x": x})[0]
    assert np.abs(ort - out["y"]).max() <= p["sy"] * 1.0001


def test_integer_add_pools_concat_gemm_and_float_fallback_match_onnxruntime(monkeypatch):
    rng = np.random.default_rng(7)
    s = {n: np.float32(v) for n, v in [("sa", 0.04), ("sb", 0.07), ("sc", 0.05), ("sd", 0.03), ("se", 0.02)]}
    z = {"za": np.int8(-3), "zb": np.int8(2), "zu": np.uint8(128), "z0": np.int8(0)}
    w = rng.integers(-127, 128, (5, 16)).astype(np.int8)

    def qdq(tensor: str, scale: str, zero: str) -> list[onnx.NodeProto]:
        return [
            helper.make_node("QuantizeLinear", [tensor, scale, zero], [f"{tensor}_q"]),
            helper.make_node("DequantizeLinear", [f"{tensor}_q", scale, zero], [f"{tensor}_dq"]),
        ]

    nodes = [
        *qdq("a", "sa", "za"),
        *qdq("b", "sb", "zb"),
        helper.make_node("Add", ["a_dq", "b_dq"], ["sum"]),
        helper.make_node("Relu", ["sum"], ["c"]),
        *qdq("c", "sc", "zu"),
        helper.make_node("MaxPool", ["c_dq"], ["mp"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("AveragePool", ["c_dq"], ["ap"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Concat", ["mp", "mp"], ["cat"], axis=1),
        *qdq("cat", "sc", "zu"),
        *qdq("ap", "sd", "z0"),
        helper.make_node("Flatten", ["cat_dq"], ["flat"]),
        helper.make_node("Sigmoid", ["flat"], ["sig"]),  # no integer form: run in float
        *qdq("sig", "sd", "z0"),
        helper.make_node("DequantizeLinear", ["w", "se", "z0"], ["w_dq"]),
        helper.make_node("Gemm", ["sig_dq", "w_dq"], ["g"], transB=1),
        helper.make_node("GlobalAveragePool", ["c_dq"], ["gap"]),
        *qdq("g", "sb", "zb"),
        *qdq("gap", "sa", "za"),
    ]
    graph = helper.make_graph(
        nodes,
        "mixed",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 2, 4, 4]) for n in ("a", "b")],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("g_dq", "gap_dq", "ap_dq")],
        [_const(n, v) for n, v in {**s, **z, "w": w}.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    feeds = {n: rng.normal(0, 1, (2, 2, 4, 4)).astype(np.float32) for n in ("a", "b")}
    float_ops: list[str] = []
    run_float = reference.run_float

    def counting(node, *args):
        float_ops.append(node.op_type)
        return run_float(node, *args)

    monkeypatch.setattr(reference, "run_float", counting)
    max_lsb, exact, _ = _free_running(model, feeds)
    assert max_lsb <= ONE_LSB
    assert exact >= 0.99
    # only Sigmoid runs in float; Flatten moves the integers through the same evaluator
    assert sorted(set(float_ops)) == ["Flatten", "Sigmoid"]


def test_run_reference_errors():
    model, _ = _conv_model(np.random.default_rng(0), 1, 1, 0, 1)
    x = np.zeros((2, 3, 9, 9), np.float32)
    with pytest.raises(ValueError, match="missing input"):
        run_reference(model, {})
    with pytest.raises(ValueError, match="not inputs"):
        run_reference(model, {"x": x, "extra": x})
    with pytest.raises(ValueError, match="no tensors named"):
        run_reference(model, {"x": x}, ["nope"])
    with pytest.raises(ValueError, match="rounding"):
        run_reference(model, {"x": x}, rounding="nearest")


# -- parity with onnxruntime on deployed models ---------------------------------------------------
def _ort_values(model: onnx.ModelProto, feeds: dict, names: list[str], optimize: bool = False) -> dict[str, np.ndarray]:
    """onnxruntime's values; by default with graph optimizations off (the Q/DQ arithmetic as written, any host)."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    present = {v.name for v in model.graph.output}
    model.graph.output.extend(helper.make_empty_tensor_value_info(n) for n in names if n not in present)
    return dict(zip(names, ort_session(model, optimize=optimize).run(names, feeds), strict=True))


# Both sides are float32 roundings of (q - z) * s with |q - z| <= 255: their difference, in steps of s,
# is a whole number up to 2 * 255 * 2**-24 (one float32 rounding each).
ONE_LSB = 1.0 + 2 * 255 * 2.0**-24


def _lsb(diff: np.ndarray, scale: np.ndarray, axis: int) -> np.ndarray:
    scale = np.asarray(scale, np.float64)
    if scale.size > 1:
        shape = [1] * diff.ndim
        shape[axis] = -1
        scale = scale.reshape(shape)
    return np.abs(diff) / scale


def _free_running(model: onnx.ModelProto, feeds: dict) -> tuple[float, float, dict[str, float]]:
    """Every DequantizeLinear output, reference vs onnxruntime: (max LSB, exact fraction, max LSB per tensor)."""
    dqs = [n for n in model.graph.node if n.op_type == "DequantizeLinear"]
    ref = run_reference(model, feeds, sorted({n.output[0] for n in dqs} | {n.input[1] for n in dqs}))
    ort = _ort_values(model, feeds, [n.output[0] for n in dqs])
    constants = {i.name for i in model.graph.initializer}
    per_tensor, equal, total, act_equal, act_total = {}, 0, 0, 0, 0
    for node in dqs:
        mine, theirs = ref[node.output[0]], ort[node.output[0]]
        axis = next((a.i for a in node.attribute if a.name == "axis"), 1)
        per_tensor[node.output[0]] = float(_lsb(mine.astype(np.float64) - theirs, ref[node.input[1]], axis).max())
        equal += int((mine == theirs).sum())
        total += mine.size
        if node.input[0] not in constants and not node.input[0].endswith("weight_quantized"):
            act_equal, act_total = act_equal + int((mine == theirs).sum()), act_total + mine.size
    print(f"activations only: {act_equal / max(act_total, 1):.6f} exact of {act_total}", end="; ")
    return max(per_tensor.values()), equal / total, per_tensor


def _layerwise(
    model: onnx.ModelProto, feeds: dict, optimize: bool = False, saturation: PairSaturation | None = None
) -> tuple[int, float]:
    """Each activation QuantizeLinear computed from onnxruntime's own quantized inputs: (max LSB, exact fraction).

    Every activation Q output is cut out of the graph and fed from onnxruntime's values, so
    one layer's near-tie does not propagate and each tensor is compared on equal inputs.
    ``optimize``: onnxruntime as it serves the model (int8 kernels), compared with the reference
    computing as ``saturation``'s kernels do (None: exact int32 accumulation).
    """
    constants = {i.name for i in model.graph.initializer}
    quantized = [n.output[0] for n in model.graph.node if n.op_type == "QuantizeLinear" and n.input[0] not in constants]
    ort = _ort_values(model, feeds, quantized, optimize)
    cut = onnx.ModelProto.FromString(model.SerializeToString())
    for node in cut.graph.node:
        if node.op_type == "QuantizeLinear" and node.output[0] in ort:
            name = node.output[0]
            node.output[0] = f"{name}__reference"
            dtype = helper.np_dtype_to_tensor_dtype(ort[name].dtype)
            cut.graph.input.append(helper.make_tensor_value_info(name, dtype, ort[name].shape))
    ref = run_reference(cut, {**feeds, **ort}, [f"{name}__reference" for name in quantized], saturation=saturation)
    worst, equal, total = 0, 0, 0
    for name in quantized:
        diff = np.abs(ref[f"{name}__reference"].astype(np.int64) - ort[name].astype(np.int64))
        worst, equal, total = max(worst, int(diff.max())), equal + int((diff == 0).sum()), total + diff.size
    return worst, equal / total


_DEPLOYED: dict[tuple[str, str], tuple[onnx.ModelProto, np.ndarray]] = {}


def _deployed(model_name: str, backend: str) -> tuple[onnx.ModelProto, np.ndarray]:
    """The Q/DQ model convert_deploy writes (merge BN, export, strip, insert Q/DQ) and a test input."""
    key = (model_name, backend)
    if key not in _DEPLOYED:
        torch.manual_seed(0)
        model, shape = (
            (DigitsCNN(), [2, 1, 8, 8]) if model_name == "digits" else (resnet18(num_classes=10), [2, 3, 32, 32])
        )
        qmodel = prepare_by_platform(model.eval(), backend)
        enable_calibration(qmodel)
        qmodel(torch.randn(*shape))
        enable_quantization(qmodel)
        float_model, table, _, _ = convert_onnx(deployable_copy(qmodel), {"x": shape})
        qdq_model, _ = insert_qdq(float_model, table)
        _DEPLOYED[key] = (qdq_model, torch.randn(*shape).numpy())
    return _DEPLOYED[key]


CASES = [
    pytest.param("digits", "qdq", id="digits-qdq"),
    pytest.param("digits", "onnx_qnn", id="digits-onnx_qnn"),
    pytest.param("resnet18", "qdq", id="resnet18-qdq", marks=pytest.mark.slow),
    pytest.param("resnet18", "onnx_qnn", id="resnet18-onnx_qnn", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("model_name", "backend"), CASES)
def test_layerwise_parity_with_onnxruntime(model_name, backend):
    model, x = _deployed(model_name, backend)
    worst, exact = _layerwise(model, {"x": x})
    print(f"{model_name}/{backend} layer-wise: max {worst} LSB, {exact:.6f} exact")
    assert worst <= 1
    assert exact >= 0.99
    # As served (int8 kernels): the reference with this host's kernel model (16-bit pair sums without VNNI).
    # The int8 tensors are graph outputs here, which keeps onnxruntime from converting them to uint8: signed
    # activations then run as in a QLinear graph, on kernels that do not saturate.
    saturation = ORT_QLINEAR_AVX2 if int8_pairs_saturate() else None
    worst, exact = _layerwise(model, {"x": x}, optimize=True, saturation=saturation)
    print(f"served by onnxruntime on this host: max {worst} LSB, {exact:.6f} exact")
    assert worst <= 1
    assert exact >= 0.99


@pytest.mark.parametrize(("model_name", "backend"), CASES)
def test_end_to_end_parity_with_onnxruntime(model_name, backend):
    """Free running, a near-tie decided differently early on moves later tensors by a few LSB."""
    model, x = _deployed(model_name, backend)
    worst, exact, per_tensor = _free_running(model, {"x": x})
    print(f"{model_name}/{backend} end to end: max {worst:.3f} LSB, {exact:.6f} exact")
    assert exact >= 0.99
    if model_name == "digits":
        assert worst <= ONE_LSB
    else:  # the first quantized layers see the same inputs: within 1 LSB there
        first = [name for name in per_tensor if "weight" not in name][:3]
        assert all(per_tensor[name] <= ONE_LSB for name in first), {n: per_tensor[n] for n in first}
