"""The 16-bit pair-saturation model of int8 CPU kernels without VNNI, against hand-computed cases and real runtimes.

Everywhere: the kernels equal a brute-force loop over product pairs written here, and a hand-computed case.
Against onnxruntime and OpenVINO: on a host whose int8 kernels saturate (``host_facts()["int8_pairs_saturate"]``:
x86 with AVX2 and no VNNI) the model reproduces the runtimes' integers; on any other host the runtimes
agree with exact accumulation. Both are asserted on every host, the branch chosen by the host facts.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from mqbench.deploy.onnx_graph import ort_session
from mqbench.deploy.reference import run_reference, saturated_layers
from mqbench.nn.quantized.functional import conv_accumulate
from mqbench.nn.quantized.saturation import (
    ONEDNN_AVX2,
    ORT_MLAS_AVX2,
    PairSaturation,
    conv_saturation_correction,
    pair_saturation_correction,
)
from mqbench.utils.host import host_facts, int8_pairs_saturate

SATURATES = int8_pairs_saturate()


def _sat16(v: int) -> int:
    return max(-32768, min(32767, v))


def _brute_conv(x: np.ndarray, w: np.ndarray, pad: int, fill: int, layout: str, groups: int = 1) -> np.ndarray:
    """Saturating accumulation by explicit loops: each output sums sat16(p0 + p1) over its product pairs."""
    n = x.shape[0]
    o, cg, k, _ = w.shape
    xp = np.pad(x.astype(np.int64), ((0, 0), (0, 0), (pad, pad), (pad, pad)), constant_values=fill)
    out_h = xp.shape[2] - k + 1
    per_group = o // groups
    acc = np.zeros((n, o, out_h, out_h), np.int64)
    for b in range(n):
        for oc in range(o):
            g = oc // per_group
            for i in range(out_h):
                for j in range(out_h):
                    patch = xp[b, g * cg : (g + 1) * cg, i : i + k, j : j + k]
                    weights = w[oc].astype(np.int64)
                    if layout == "flat":  # (kh, kw, c) flattened, pairs across taps
                        products = list((patch.transpose(1, 2, 0) * weights.transpose(1, 2, 0)).reshape(-1))
                        products += [0] * (len(products) % 2)
                        pairs = [(products[t], products[t + 1]) for t in range(0, len(products), 2)]
                    else:  # channel pairs within each tap
                        pairs = []
                        for r in range(k):
                            for s in range(k):
                                tap = list(patch[:, r, s] * weights[:, r, s]) + [0] * (cg % 2)
                                pairs += [(tap[t], tap[t + 1]) for t in range(0, len(tap), 2)]
                    acc[b, oc, i, j] = sum(_sat16(int(a) + int(b_)) for a, b_ in pairs)
    return acc


def test_hand_computed_pair():
    # 200 * 127 + 250 * 127 = 57150 saturates to 32767; 3 * 127 + 4 * 127 = 889 does not
    cols = np.array([[[200, 250]], [[3, 4]]])
    weights = np.array([[[127], [127]]])
    correction = pair_saturation_correction(cols, weights, "flat")
    assert correction[:, 0].tolist() == [32767 - 57150, 0]
    # an odd channel count: "flat" pairs across the two taps, "tap" pads each tap's channels
    cols = np.array([[[255, 255, 255], [255, 255, 255]]])  # one row, 2 taps x 3 channels
    weights = np.full((2, 3, 1), 127)
    flat = int(pair_saturation_correction(cols, weights, "flat")[0, 0])
    tap = int(pair_saturation_correction(cols, weights, "tap")[0, 0])
    assert flat == 3 * (32767 - 2 * 255 * 127)  # three full pairs
    assert tap == 2 * (32767 - 2 * 255 * 127)  # one full pair per tap, the third channel alone


@pytest.mark.parametrize("layout", ["flat", "tap"])
@pytest.mark.parametrize(
    ("channels", "kernel", "pad", "groups"), [(3, 3, 1, 1), (5, 3, 0, 1), (8, 1, 0, 1), (4, 3, 1, 2)]
)
def test_conv_correction_equals_brute_force(layout, channels, kernel, pad, groups):
    rng = np.random.default_rng(channels * 10 + kernel + pad)
    x = rng.integers(0, 256, (2, channels, 5, 5))
    w = rng.choice([-128, -127, -90, 3, 100, 127], size=(4, channels // groups, kernel, kernel))
    fill = 7
    padded_exact = conv_accumulate(
        np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)), constant_values=fill), w, groups=groups
    )
    got = padded_exact + conv_saturation_correction(x, w, padding=pad, groups=groups, fill=fill, layout=layout)
    np.testing.assert_array_equal(got, _brute_conv(x, w, pad, fill, layout, groups))
    assert got.shape == (2, 4, 5 + 2 * pad - kernel + 1, 5 + 2 * pad - kernel + 1)


def test_seven_bit_weights_and_depthwise_never_saturate():
    rng = np.random.default_rng(3)
    x = np.full((1, 6, 4, 4), 255)
    w7 = rng.integers(-64, 64, (5, 6, 3, 3))
    assert not conv_saturation_correction(x, w7, padding=1).any()
    w7[:, :, 0, 0] = -64  # the extremes of [-64, 63]: 2 * 255 * 64 = 32640 < 32767
    assert not conv_saturation_correction(x, w7, padding=1, layout="tap").any()
    depthwise = np.full((6, 1, 3, 3), 127)
    assert not conv_saturation_correction(x, depthwise, padding=1, groups=6).any()
    assert conv_saturation_correction(x, np.full((1, 6, 3, 3), 127), padding=1).any()


def test_layout_is_validated():
    with pytest.raises(ValueError, match="layout"):
        PairSaturation("x", "rows", None)
    with pytest.raises(ValueError, match="layout"):
        pair_saturation_correction(np.zeros((1, 1, 2)), np.zeros((1, 2, 1)), "rows")


# -- real runtimes --------------------------------------------------------------------------------
def _init(name: str, value, dtype) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(value, dtype), name)


def _qdq_conv(
    weight: np.ndarray, channels: int, act_dtype, zero_point: int, group: int = 1, op: str = "Conv"
) -> onnx.ModelProto:
    """Q(x) -> DQ -> Conv/MatMul with DQ(int8 weight) -> Q -> DQ: the pattern onnxruntime fuses into an int8 kernel.

    The output is dequantized, as in a deployment: an int8 graph output keeps onnxruntime from converting
    signed activations to unsigned ones, which its matrix-product kernels need.
    """
    out_zero = 128 if act_dtype == np.uint8 else 0
    inits = [
        _init("xs", 0.02, np.float32),
        _init("xz", zero_point, act_dtype),
        _init("w", weight, np.int8),
        _init("ws", 0.01, np.float32),
        _init("wz", 0, np.int8),
        _init("ys", 0.5, np.float32),
        _init("yz", out_zero, act_dtype),
    ]
    compute = (
        helper.make_node("Conv", ["xd", "wd"], ["c"], pads=[1, 1, 1, 1], group=group)
        if op == "Conv"
        else helper.make_node("MatMul", ["xd", "wd"], ["c"])
    )
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"]),
        helper.make_node("DequantizeLinear", ["w", "ws", "wz"], ["wd"]),
        compute,
        helper.make_node("QuantizeLinear", ["c", "ys", "yz"], ["yq"]),
        helper.make_node("DequantizeLinear", ["yq", "ys", "yz"], ["y"]),
    ]
    shape = [2, channels, 7, 7] if op == "Conv" else [6, channels]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


ORT_CASES = [
    pytest.param(3, np.uint8, 0, 1, "Conv", id="u8-c3"),
    pytest.param(8, np.uint8, 5, 1, "Conv", id="u8-c8-zp5"),
    pytest.param(5, np.uint8, 100, 1, "Conv", id="u8-c5-zp100"),
    pytest.param(8, np.uint8, 0, 2, "Conv", id="u8-grouped"),
    pytest.param(8, np.uint8, 0, 8, "Conv", id="u8-depthwise"),
    pytest.param(4, np.uint8, 0, 4, "Conv", id="u8-depthwise-multiplier4"),
    pytest.param(8, np.int8, 0, 1, "Conv", id="s8-c8"),
    pytest.param(33, np.uint8, 3, 1, "MatMul", id="u8-matmul"),
    pytest.param(33, np.int8, 0, 1, "MatMul", id="s8-matmul"),  # matrix products shift signed activations by 128
]


@pytest.mark.parametrize(("channels", "act_dtype", "zero_point", "group", "op"), ORT_CASES)
def test_onnxruntime_int8_kernels_follow_the_model(channels, act_dtype, zero_point, group, op):
    rng = np.random.default_rng(channels + group)
    outputs = channels if group == channels == 8 else 16  # 8 groups of 8: depthwise; 4 groups to 16: multiplier 4
    shape = (outputs, channels // group, 3, 3) if op == "Conv" else (channels, 10)
    weight = rng.choice([-127, 127, -101, 120, 3], size=shape).astype(np.int8)
    model = _qdq_conv(weight, channels, act_dtype, zero_point, group, op)
    low = 0.0 if act_dtype == np.uint8 else -2.5
    x = rng.uniform(low, low + 5.0, [2, channels, 7, 7] if op == "Conv" else [6, channels]).astype(np.float32)
    out_zero = 128 if act_dtype == np.uint8 else 0

    def integers(session) -> np.ndarray:
        return np.rint(session.run(None, {"x": x})[0] / 0.5).astype(np.int64) + out_zero

    served, written = integers(ort_session(model, optimize=True)), integers(ort_session(model, optimize=False))
    exact = run_reference(model, {"x": x}, ["yq"], rounding="half_even")["yq"].astype(np.int64)
    modelled = run_reference(model, {"x": x}, ["yq"], rounding="half_even", saturation=ORT_MLAS_AVX2)["yq"]
    assert np.abs(exact - written).max() <= 1  # the artifact's arithmetic: host-independent
    predicted = saturated_layers(model, {"x": x}, [ORT_MLAS_AVX2])[0]["onnxruntime"]
    # the prediction is host-independent: depthwise kernels never saturate; signed activations do, shifted by 128
    assert bool(predicted) == (not (group == channels == outputs))
    if SATURATES:
        assert np.abs(modelled.astype(np.int64) - served).max() <= 1
        if predicted:
            assert np.abs(exact - served).max() > 1  # the divergence is real on this host, and modelled
    else:
        assert np.abs(exact - served).max() <= 1


def _fake_quantize_conv(weight: np.ndarray, channels: int, signed: bool) -> onnx.ModelProto:
    def fq(x: str, low: str, high: str, out: str, levels: int) -> onnx.NodeProto:
        return helper.make_node(
            "FakeQuantize", [x, low, high, low, high], [out], domain="org.openvinotoolkit", levels=levels
        )

    xs, ws, ys = 0.02, 0.01, 0.5
    low = -128 * xs if signed else 0.0
    inits = [
        _init("al", low, np.float32),
        _init("ah", low + 255 * xs, np.float32),
        _init("w", weight * ws, np.float32),
        _init("wl", -127 * ws, np.float32),
        _init("wh", 127 * ws, np.float32),
        _init("yl", -128 * ys, np.float32),
        _init("yh", 127 * ys, np.float32),
    ]
    nodes = [
        fq("x", "al", "ah", "xq", 256),
        fq("w", "wl", "wh", "wq", 255),
        helper.make_node("Conv", ["xq", "wq"], ["y"], pads=[1, 1, 1, 1]),
        fq("y", "yl", "yh", "yq", 256),
        helper.make_node("Relu", ["yq"], ["out"]),
    ]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("out", "yq")]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, channels, 7, 7])], outputs, inits
    )
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("org.openvinotoolkit", 1)]
    )


@pytest.mark.parametrize(("channels", "signed"), [(3, False), (8, False), (5, False), (8, True)])
def test_openvino_int8_kernels_follow_the_model(channels, signed):
    from mqbench.deploy.writers.openvino import run_openvino

    rng = np.random.default_rng(channels)
    weight = rng.choice([-127, 127, -101, 120, 3], size=(8, channels, 3, 3)).astype(np.float32)
    model = _fake_quantize_conv(weight, channels, signed)
    low = -2.5 if signed else 0.0
    x = rng.uniform(low, low + 5.0, (1, channels, 7, 7)).astype(np.float32)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "fq.onnx"
        onnx.save(model, str(path))
        served = np.rint(run_openvino(path, {"x": x}, ["yq"])["yq"] / 0.5).astype(np.int64)
    # the same layer in integers: q on the activation grid (real value q * 0.02), exact or through the kernel model
    q = np.clip(np.rint(x / 0.02), -128 if signed else 0, 127 if signed else 255).astype(np.int64)
    w = weight.astype(np.int64)
    exact = conv_accumulate(q, w, padding=1)
    raw = ONEDNN_AVX2.raw_activation(q, signed)
    fill = int(ONEDNN_AVX2.raw_activation(np.array(0), signed))
    modelled = exact + conv_saturation_correction(raw, w, padding=1, fill=fill, layout=ONEDNN_AVX2.layout)

    def requantize(acc: np.ndarray) -> np.ndarray:
        return np.clip(np.rint(acc * (0.02 * 0.01 / 0.5)), -128, 127)

    if SATURATES:
        assert np.abs(requantize(modelled) - served).max() <= 1
        assert np.abs(requantize(exact) - served).max() > 1
    else:
        assert np.abs(requantize(exact) - served).max() <= 1


def _brute_matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Batched ``a @ b`` summing sat16 of adjacent product pairs along the reduction, by loops."""
    batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a, b = np.broadcast_to(a, (*batch, *a.shape[-2:])), np.broadcast_to(b, (*batch, *b.shape[-2:]))
    out = np.zeros((*batch, a.shape[-2], b.shape[-1]), np.int64)
    for index in np.ndindex(*batch, a.shape[-2], b.shape[-1]):
        *outer, i, j = index
        products = [int(x) * int(y) for x, y in zip(a[(*outer, i)], b[(*outer, slice(None), j)], strict=True)]
        products += [0] * (len(products) % 2)
        out[index] = sum(_sat16(products[t] + products[t + 1]) for t in range(0, len(products), 2))
    return out


def test_batched_product_correction_equals_brute_force():
    from mqbench.deploy.reference import _matmul_correction

    rng = np.random.default_rng(5)
    a = rng.integers(0, 256, (2, 1, 3, 7))  # broadcast against b's second batch axis; odd reduction
    b = rng.choice([-128, -100, 5, 120, 127], size=(1, 3, 7, 4))
    got = a @ b + _matmul_correction(a, b, "flat")
    np.testing.assert_array_equal(got, _brute_matmul(a, b))
    assert (got != a @ b).any()


ACTIVATION_PRODUCTS = [(False, True, 8), (True, True, 8), (True, False, 8), (True, True, 7)]


def _activation_product(a_signed: bool, b_signed: bool, b_bits: int):
    """Q/DQ and FakeQuantize models of y = a @ b, both computed at run time (attention), with grid-exact inputs."""
    from mqbench.deploy.qdq import insert_qdq
    from mqbench.deploy.table import QParamTable, TensorQParams

    rng = np.random.default_rng(int(a_signed) * 4 + int(b_signed) * 2 + b_bits)
    a_low, a_high = (-128, 127) if a_signed else (0, 255)
    b_high = (1 << (b_bits - 1 if b_signed else b_bits)) - 1
    b_low = -b_high - 1 if b_signed else 0
    qa = rng.integers(a_low, a_high + 1, (1, 2, 6, 32))
    qb = rng.integers(b_low, b_high + 1, (1, 2, 32, 5))
    qa[..., :6], qb[..., :6, :] = a_high, b_high  # aligned large products: pairs beyond int16 if b is 8-bit
    sa, sb, sy = 0.05, 0.04, 2.0
    nodes = [helper.make_node("MatMul", ["a", "b"], ["y"], name="product")]
    values = [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in (("a", qa.shape), ("b", qb.shape))]
    graph = helper.make_graph(nodes, "g", values, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])

    def entry(scale: float, low: int, high: int) -> TensorQParams:
        return TensorQParams(np.array([scale]), np.array([0]), low, high)

    table = QParamTable({"a": entry(sa, a_low, a_high), "b": entry(sb, b_low, b_high), "y": entry(sy, -128, 127)})
    feeds = {"a": (qa * sa).astype(np.float32), "b": (qb * sb).astype(np.float32)}
    qdq, dequantized = insert_qdq(model, table)
    return model, table, qdq, dequantized["y"], feeds, (qa, qb, sa * sb / sy)


@pytest.mark.parametrize(("a_signed", "b_signed", "b_bits"), ACTIVATION_PRODUCTS)
def test_activation_products_on_both_runtimes(a_signed, b_signed, b_bits):
    """onnxruntime multiplies two run-time values exactly; OpenVINO on its saturating kernels, b in the weights'
    place."""
    from mqbench.deploy.writers.openvino import run_openvino, to_openvino

    model, table, qdq, y, feeds, (qa, qb, multiplier) = _activation_product(a_signed, b_signed, b_bits)
    exact = np.clip(np.rint((qa @ qb) * multiplier), -128, 127)
    shift = 128 if a_signed else 0  # oneDNN shifts signed activations into u8 and subtracts the shift's share
    saturating = _brute_matmul(qa + shift, qb) - shift * qb.sum(-2, keepdims=True)
    # an unsigned right operand is not in the signed weights' place: u8 x u8 products do not saturate
    modelled = np.clip(np.rint((saturating if b_signed else qa @ qb) * multiplier), -128, 127)
    can_saturate = b_signed and b_bits == 8
    assert (modelled != exact).any() == can_saturate  # the case is built to saturate where it can
    predicted = saturated_layers(qdq, feeds, [ORT_MLAS_AVX2, ONEDNN_AVX2])[0]
    assert predicted["onnxruntime"] == {}
    assert bool(predicted["OpenVINO"]) == can_saturate
    reference = run_reference(qdq, feeds, [y], rounding="half_even", saturation=ONEDNN_AVX2)[y]
    np.testing.assert_array_equal(np.rint(reference / 2.0), modelled)

    served = ort_session(qdq, optimize=True).run([y], feeds)[0]
    assert np.abs(np.rint(served / 2.0) - exact).max() <= 1
    fq_model, quantized = to_openvino(model, table)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "fq.onnx"
        onnx.save(fq_model, str(path))
        openvino = np.rint(run_openvino(path, feeds, [quantized["y"]])[quantized["y"]] / 2.0)
    assert np.abs(openvino - (modelled if SATURATES else exact)).max() <= 1
    if SATURATES and can_saturate:
        assert np.abs(openvino - exact).max() > 1


def test_host_facts_shape():
    facts = host_facts()
    assert set(facts) >= {"machine", "processor", "isa", "vnni", "int8_pairs_saturate", "runtimes"}
    assert facts["runtimes"]["onnxruntime"]
    if facts["int8_pairs_saturate"]:
        assert "avx2" in facts["isa"] and not facts["vnni"]


def test_cpu_check_finds_saturating_weight_pairs_and_warns_only_where_it_matters():
    from mqbench.deploy.cpu_check import cpu_warning, saturating_weights
    from mqbench.deploy.table import QParamTable, TensorQParams

    def entry(low: int, high: int) -> TensorQParams:
        return TensorQParams(np.array([0.5]), np.array([0]), low, high, kind="weight")

    # conv (out, in, kh, kw): pairs along (kh, kw, in) flattened: channels 0 and 1 of tap (0, 0) pair up
    full = np.zeros((1, 2, 1, 2), np.float32)
    full[0, :, 0, 0] = [0.5 * 100, 0.5 * 29]  # |100| + |29| = 129 > 128: can saturate
    safe = full.copy()
    safe[0, 1, 0, 0] = 0.5 * 28  # 128: 255 * 128 = 32640 fits
    table = QParamTable({"a": entry(-128, 127), "b": entry(-128, 127), "c": entry(-64, 63), "u": entry(0, 255)})
    weights = {"a": full, "b": safe, "c": full, "u": full}
    assert saturating_weights(table, weights) == ["a"]  # 7-bit and unsigned grids never saturate
    saturating = {"int8_pairs_saturate": True}
    message = cpu_warning(["onnx", "openvino_onnx"], False, table, weights, saturating)
    assert message is not None and "reduce_range" in message and "openvino_onnx" in message and "a" in message
    assert "qlinear_weight_type" in cpu_warning(["qlinear_onnx"], False, table, weights, saturating)
    assert cpu_warning(["onnx"], False, table, weights, saturating) is None  # a Q/DQ model no CPU serves
    assert cpu_warning(["onnx"], True, table, weights, saturating) is not None
    assert cpu_warning(["openvino_onnx"], True, table, weights, {"int8_pairs_saturate": False}) is None


def _large_weight_model(reduce_range: bool, backend: str):
    import torch

    from mqbench.prepare_by_platform import prepare_by_platform
    from mqbench.utils.state import enable_calibration, enable_quantization

    torch.manual_seed(0)
    conv = torch.nn.Conv2d(8, 4, 3, padding=1)
    with torch.no_grad():  # every weight at its channel's maximum: channels 0 and 1 pair up to 2 * 127
        conv.weight.fill_(-0.05)
        conv.weight[:, :2] = 0.05
    # the second conv makes every backend quantize the first one's output
    model = torch.nn.Sequential(torch.nn.ReLU(), conv, torch.nn.ReLU(), torch.nn.Conv2d(4, 2, 1)).eval()
    qmodel = prepare_by_platform(model, backend, {"reduce_range": reduce_range})
    enable_calibration(qmodel)
    x = torch.rand(4, 8, 6, 6) * 0.5  # channels 0 and 1 near the top of the activation grid, the rest small
    x[:, :2] += 3.5
    qmodel(x)
    enable_quantization(qmodel)
    return qmodel, x


def test_convert_deploy_warns_on_this_cpu_and_the_remedies_serve_as_simulated(tmp_path):
    import warnings

    from mqbench.convert_deploy import convert_deploy
    from mqbench.deploy.verify import verify_deploy

    qmodel, x = _large_weight_model(False, "openvino")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        convert_deploy(qmodel, "openvino", {"x": [4, 8, 6, 6]}, output_path=tmp_path / "a")
    cpu = [w for w in caught if "VNNI" in str(w.message)]
    assert len(cpu) == (1 if SATURATES else 0)
    if cpu:
        assert "reduce_range" in str(cpu[0].message) and "openvino_onnx" in str(cpu[0].message)
    # remedy 1: 7-bit weights, no warning, every served artifact within 1 LSB on this host
    qmodel, x = _large_weight_model(True, "openvino")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = convert_deploy(qmodel, "openvino", {"x": [4, 8, 6, 6]}, output_path=tmp_path / "b")
    assert not [w for w in caught if "VNNI" in str(w.message)]
    assert verify_deploy(qmodel, result, x).passed
    # remedy 2 for the QLinear graph: uint8 weights (u8 x u8 kernels); the 8-bit int8 graph would saturate here
    qmodel, x = _large_weight_model(False, "qdq")
    shape = {"x": [4, 8, 6, 6]}
    result = convert_deploy(qmodel, "qdq", shape, output_path=tmp_path / "c", deploy_to_qlinear=True)
    report = verify_deploy(qmodel, result, x, artifacts=["qlinear_onnx"], predict=True)
    assert report.artifacts["qlinear_onnx"].host.predicted  # predicted on any host
    assert (report.artifacts["qlinear_onnx"].host.max_lsb_diff > 1) == SATURATES
    result = convert_deploy(
        qmodel, "qdq", shape, output_path=tmp_path / "d", deploy_to_qlinear=True, qlinear_weight_type="uint8"
    )
    report = verify_deploy(qmodel, result, x, artifacts=["qlinear_onnx"])
    assert report.passed, report.failures()
    with pytest.raises(ValueError, match="qlinear_weight_type"):
        convert_deploy(qmodel, "qdq", shape, output_path=tmp_path / "e", qlinear_weight_type="int4")
