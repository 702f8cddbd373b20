"""ConvTranspose in the integer reference (groups, strides, dilations, asymmetric pads): formula, onnxruntime, torch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from mqbench.deploy.reference import requantize_multiplier, run_reference
from onnx_helpers import run_exposing

CIN, COUT, K = 4, 4, 3


def _model(p: dict, group: int, attrs: dict, quantized_weight: bool = True):
    """x -> Q/DQ -> ConvTranspose(DQ(w) or float w, bias) -> Q/DQ; weights per output column (axis 1)."""
    weight = ["w_dq"] if quantized_weight else ["w_float"]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "sx", "zx"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "sx", "zx"], ["xd"]),
        helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["w_dq"], axis=1),
        helper.make_node("ConvTranspose", ["xd", *weight, "b"], ["deconv"], group=group, **attrs),
        helper.make_node("QuantizeLinear", ["deconv", "sy", "zy"], ["yq"]),
        helper.make_node("DequantizeLinear", ["yq", "sy", "zy"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "deconv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, CIN, 5, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.asarray(v), n) for n, v in p.items() if any(n in m.input for m in nodes)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _params(rng: np.random.Generator, group: int) -> dict:
    columns = COUT // group
    return {
        "sx": np.float32(0.05),
        "zx": np.uint8(120),
        "wq": rng.integers(-127, 128, (CIN, columns, K, K)).astype(np.int8),
        "ws": rng.uniform(0.005, 0.02, columns).astype(np.float32),
        "wz": np.zeros(columns, np.int8),
        "w_float": rng.normal(0, 0.5, (CIN, columns, K, K)).astype(np.float32),
        "b": rng.normal(0, 0.3, COUT).astype(np.float32),
        "sy": np.float32(0.03),
        "zy": np.uint8(128),
    }


def _formula(x: np.ndarray, p: dict, group: int, stride: int, pads: tuple[int, int], dilation: int, extra: int):
    """The transposed convolution by scattering every input sample over its window, in exact integers."""
    xq = np.clip(np.rint(x / p["sx"]) + int(p["zx"]), 0, 255).astype(np.int64) - int(p["zx"])
    wq = p["wq"].astype(np.int64)
    n, _, h, w = x.shape
    cg, og = CIN // group, COUT // group
    full = [(size - 1) * stride + (K - 1) * dilation + 1 + extra for size in (h, w)]
    acc = np.zeros((n, COUT, *full), np.int64)
    for c in range(CIN):
        g = c // cg
        for i in range(h):
            for j in range(w):
                for a in range(K):
                    for b in range(K):
                        acc[:, g * og : (g + 1) * og, i * stride + a * dilation, j * stride + b * dilation] += (
                            xq[:, c, i, j, None] * wq[c, :, a, b][None]
                        )
    acc = acc[:, :, pads[0] : full[0] - pads[1], pads[0] : full[1] - pads[1]]
    acc_scale = np.float64(p["sx"]) * np.tile(p["ws"].astype(np.float64), group)
    acc = acc + np.rint(p["b"].astype(np.float64) / acc_scale).astype(np.int64)[None, :, None, None]
    yq = np.zeros_like(acc)
    for index, value in np.ndenumerate(acc):
        m0, shift = requantize_multiplier(acc_scale[index[1]] / float(p["sy"]))
        yq[index] = min(max(((int(value) * m0 + (1 << (shift - 1))) >> shift) + int(p["zy"]), 0), 255)
    return acc, acc_scale, yq


CASES = {  # group, stride, (begin, end) pads on both axes, dilation, output_padding
    "plain": (1, 1, (0, 0), 1, 0),
    "grouped-strided": (2, 2, (1, 0), 1, 1),
    "depthwise-dilated": (4, 2, (0, 1), 2, 0),
    "grouped-wide-stride": (2, 3, (1, 2), 1, 2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_integer_conv_transpose_equals_formula_and_onnxruntime(case):
    group, stride, pads, dilation, extra = CASES[case]
    rng = np.random.default_rng(len(case))
    p = _params(rng, group)
    attrs = {"strides": [stride] * 2, "pads": [pads[0]] * 2 + [pads[1]] * 2, "dilations": [dilation] * 2}
    model = _model(p, group, {**attrs, "output_padding": [extra] * 2})
    x = rng.normal(0, 2, (2, CIN, 5, 4)).astype(np.float32)
    acc, acc_scale, yq = _formula(x, p, group, stride, pads, dilation, extra)
    out = run_reference(model, {"x": x}, ["yq", "deconv"])
    np.testing.assert_array_equal(out["yq"], yq)  # integer accumulation and fixed-point requantization
    np.testing.assert_array_equal(out["deconv"], (acc * acc_scale[None, :, None, None]).astype(np.float32))
    ort = run_exposing(model, {"x": x}, ["yq"])["yq"]  # the float graph
    assert np.abs(ort.astype(np.int64) - yq).max() <= 1


@pytest.mark.parametrize("case", ["grouped-strided", "grouped-wide-stride"])
def test_float_conv_transpose_with_groups_equals_torch(case):
    """A float weight (no DequantizeLinear): the reference's own float kernel, against torch's conv_transpose2d."""
    group, stride, _, dilation, _ = CASES[case]
    rng = np.random.default_rng(3)
    p = _params(rng, group)
    model = _model(p, group, {"strides": [stride] * 2, "dilations": [dilation] * 2}, quantized_weight=False)
    x = rng.normal(0, 2, (2, CIN, 5, 4)).astype(np.float32)
    out = run_reference(model, {"x": x}, ["deconv", "xd"])
    expected = torch.nn.functional.conv_transpose2d(
        torch.from_numpy(out["xd"]).double(),
        torch.from_numpy(p["w_float"]).double(),
        torch.from_numpy(p["b"]).double(),
        stride=stride,
        dilation=dilation,
        groups=group,
    )
    np.testing.assert_allclose(out["deconv"], expected.numpy(), rtol=1e-6, atol=1e-6)


def test_output_shape_sets_the_pads_as_onnxruntime_does():
    rng = np.random.default_rng(5)
    p = _params(rng, 2)
    model = _model(p, 2, {"strides": [2, 2], "output_shape": [10, 9]})
    x = rng.normal(0, 2, (2, CIN, 5, 4)).astype(np.float32)
    out = run_reference(model, {"x": x}, ["yq"])
    ort = run_exposing(model, {"x": x}, ["yq"])["yq"]
    assert out["yq"].shape == ort.shape == (2, COUT, 10, 9)
    assert np.abs(ort.astype(np.int64) - out["yq"].astype(np.int64)).max() <= 1
