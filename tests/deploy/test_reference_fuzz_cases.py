"""Integer reference cases from the random-graph fuzzer, each against onnxruntime (optimizations off)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from mqbench.deploy.reference import run_reference


def _ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _resize_model(
    shape: list[int],
    attrs: dict[str, object],
    sizes: list[int] | None = None,
    scales: list[float] | None = None,
    dtype: int = TensorProto.FLOAT,
) -> onnx.ModelProto:
    inits, inputs = [], ["x", ""]
    if scales is not None:
        inits.append(numpy_helper.from_array(np.asarray(scales, np.float32), "scales"))
        inputs.append("scales")
    else:
        inputs.append("")
        inits.append(numpy_helper.from_array(np.asarray(sizes, np.int64), "sizes"))
        inputs.append("sizes")
    node = helper.make_node("Resize", inputs, ["y"], **attrs)
    x = helper.make_tensor_value_info("x", dtype, shape)
    graph = helper.make_graph([node], "g", [x], [helper.make_empty_tensor_value_info("y")], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


LINEAR = [
    {"mode": "linear", "coordinate_transformation_mode": "half_pixel"},
    {"mode": "linear", "coordinate_transformation_mode": "pytorch_half_pixel"},
    {"mode": "linear", "coordinate_transformation_mode": "align_corners"},
    {"mode": "linear", "coordinate_transformation_mode": "asymmetric"},
    {"mode": "cubic", "coordinate_transformation_mode": "half_pixel", "cubic_coeff_a": -0.75},
    {"mode": "cubic", "coordinate_transformation_mode": "align_corners", "cubic_coeff_a": -0.5, "exclude_outside": 1},
    {"mode": "nearest", "coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"},
    {"mode": "nearest", "coordinate_transformation_mode": "half_pixel", "nearest_mode": "round_prefer_ceil"},
    {"mode": "nearest", "coordinate_transformation_mode": "align_corners", "nearest_mode": "round_prefer_floor"},
]


@pytest.mark.parametrize("attrs", LINEAR, ids=lambda a: f"{a['mode']}-{a['coordinate_transformation_mode']}")
@pytest.mark.parametrize("sizes", [[2, 2, 8, 14], [2, 2, 1, 3], [2, 2, 19, 5]])
def test_resize_matches_onnxruntime_where_one_axis_shrinks_and_another_grows(attrs, sizes) -> None:
    # The fuzzer's graph: a 9 x 10 map interpolated to 8 x 14 (bilinear) ran in onnx.reference, which
    # parted from onnxruntime and PyTorch by more than 1.3 there; the reference now resizes as ONNX defines.
    x = np.random.default_rng(0).normal(size=(2, 2, 9, 10)).astype(np.float32)
    model = _resize_model([2, 2, 9, 10], attrs, sizes=sizes)
    expected = _ort(model, {"x": x})[0]
    got = run_reference(model, {"x": x})["y"]
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5)  # onnxruntime sums its taps in float32


def test_resize_by_scales_and_of_integers_matches_onnxruntime() -> None:
    x = np.random.default_rng(1).normal(size=(1, 3, 5, 6)).astype(np.float32)
    model = _resize_model([1, 3, 5, 6], LINEAR[0], scales=[1.0, 1.0, 1.6, 0.5])
    np.testing.assert_allclose(run_reference(model, {"x": x})["y"], _ort(model, {"x": x})[0], rtol=0, atol=2e-6)
    q = np.random.default_rng(2).integers(-128, 128, size=(1, 3, 5, 6)).astype(np.int8)
    model = _resize_model([1, 3, 5, 6], LINEAR[6], sizes=[1, 3, 9, 4], dtype=TensorProto.INT8)
    got = run_reference(model, {"x": q})["y"]
    assert got.dtype == np.int8
    np.testing.assert_array_equal(got, _ort(model, {"x": q})[0])


def test_bilinear_interpolate_in_a_qdq_graph_matches_onnxruntime_after_requantization() -> None:
    # DQ -> Resize (linear, 9 x 10 -> 8 x 14) -> Q, as an interpolate between two quantizers exports
    scale, zero = np.float32(0.05), np.int8(0)
    inits = [
        numpy_helper.from_array(np.asarray(scale), "s"),
        numpy_helper.from_array(np.asarray(zero), "z"),
        numpy_helper.from_array(np.asarray([2, 2, 8, 14], np.int64), "sizes"),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"]),
        helper.make_node("Resize", ["xd", "", "", "sizes"], ["r"], **LINEAR[0]),
        helper.make_node("QuantizeLinear", ["r", "s", "z"], ["yq"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2, 9, 10])],
        [helper.make_empty_tensor_value_info("yq")],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    x = np.random.default_rng(3).normal(size=(2, 2, 9, 10)).astype(np.float32) * 3
    got = run_reference(model, {"x": x})["yq"].astype(np.int64)
    expected = _ort(model, {"x": x})[0].astype(np.int64)
    assert np.max(np.abs(got - expected)) <= 1  # float64 vs float32 interpolation: at most a rounding tie
    assert np.mean(got == expected) > 0.99


def test_nearest_resize_picks_the_samples_onnxruntime_picks() -> None:
    # 14 -> 18 by asymmetric floor: output 9 maps to 9 / (18 / 14), 7 in onnxruntime's float32 but
    # 6.999... in float64; the fuzzer's graph (interpolate to (18, 11), mode nearest) parted there.
    x = np.random.default_rng(4).normal(size=(2, 6, 14, 16)).astype(np.float32)
    model = _resize_model([2, 6, 14, 16], LINEAR[6], sizes=[2, 6, 18, 11])
    np.testing.assert_array_equal(run_reference(model, {"x": x})["y"], _ort(model, {"x": x})[0])
