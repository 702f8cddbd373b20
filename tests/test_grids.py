"""Quantization grids: each one's arithmetic against formulas written here, and a new grid added by registration."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from mqbench.deploy.onnx_graph import ort_session
from mqbench.deploy.qdq import insert_qdq
from mqbench.grids import GRIDS, Grid, grid_of, register_grid
from mqbench.qparams import QParamTable, TensorQParams


def linear_reference(x, scale, zero_point, qmin, qmax):
    return (np.clip(np.round(x / scale) + zero_point, qmin, qmax) - zero_point) * scale


@pytest.mark.parametrize("axis", [None, 1])
def test_the_linear_grid_is_the_affine_formula(axis):
    rng = np.random.default_rng(0)
    x = rng.normal(0, 2, (4, 3, 5)).astype(np.float32)
    scale = np.array([0.05] if axis is None else [0.05, 0.1, 0.02], np.float32)
    zero_point = np.array([3] if axis is None else [3, -2, 0], np.int32)
    entry = TensorQParams(scale, zero_point, -128, 127, axis=axis)
    grid = grid_of("linear")
    got = grid.simulate(entry, torch.from_numpy(x)).numpy()
    shape = (1, -1, 1) if axis is not None else (1,)
    expected = linear_reference(x, scale.reshape(shape), zero_point.reshape(shape), -128, 127)
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)
    steps = grid.steps(entry, got) + zero_point.reshape(shape)
    assert np.allclose(steps, np.round(steps), atol=1e-4)  # grid values are whole steps
    low, high = (-128 - zero_point) * scale, (127 - zero_point) * scale
    # float32 products on the grid's side
    np.testing.assert_allclose(grid.amax(entry), np.maximum(np.abs(low), np.abs(high)), rtol=2**-23)


def test_log_grid_levels_are_one_step_apart():
    """NNIE's levels are 2 ** (m / 16); consecutive levels differ by one step, zero by one from the smallest."""
    entry = TensorQParams(np.array([1.0], np.float32), np.array([0], np.int32), -127, 127, grid="log", data_max=8.0)
    grid = grid_of("log")
    z = round(16 * np.log2(8.0)) - 127
    levels = np.array([2.0 ** ((k + z) / 16) for k in range(128)], np.float32)
    simulated = grid.simulate(entry, torch.from_numpy(levels)).numpy()
    np.testing.assert_array_equal(simulated, levels)  # levels are fixed points
    assert grid.steps(entry, levels).tolist() == list(range(1, 129))
    assert grid.steps(entry, -levels[1:]).tolist() == [-k for k in range(2, 129)]
    assert grid.steps(entry, np.zeros(3)).tolist() == [0.0, 0.0, 0.0]
    assert float(grid.amax(entry)[0]) == 8.0


class SignGrid(Grid):
    """A toy ternary grid {-s, 0, s}: sign(x) * s."""

    name = "test_sign"

    def simulate(self, entry, x):
        return torch.sign(x) * float(entry.scale[0])

    def steps(self, entry, values):
        return np.asarray(values, np.float64) / float(entry.scale[0])

    def amax(self, entry):
        return entry.scale.copy()

    def to_onnx(self, builder, tensor, entry):
        sign = builder.node("Sign", [tensor], f"{tensor}_sign")
        return builder.node("Mul", [sign, builder.const(f"{tensor}_s", entry.scale.reshape(()))], f"{tensor}_dq")


@pytest.fixture
def sign_grid():
    register_grid(SignGrid())
    yield
    GRIDS.unregister("test_sign")


def test_a_new_grid_is_one_class_and_one_registration(sign_grid):
    """The Q/DQ model computes a registered grid with the grid's own nodes, as its simulate does."""
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"], name="relu")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [6])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    entry = TensorQParams(np.array([0.25], np.float32), np.array([0], np.int32), -1, 1, grid="test_sign")
    qdq, dequantized = insert_qdq(model, QParamTable({"x": entry}))
    onnx.checker.check_model(qdq)
    x = np.array([-3.0, -0.1, 0.0, 0.2, 1.0, 5.0], np.float32)
    (y,) = ort_session(qdq).run(["y"], {"x": x})
    expected = np.maximum(grid_of("test_sign").simulate(entry, torch.from_numpy(x)).numpy(), 0)
    np.testing.assert_array_equal(y, expected)
    assert dequantized["x"] == "x_dq"


def test_an_unknown_grid_is_refused_with_the_known_ones():
    with pytest.raises(ValueError, match=r"grid must be one of \('linear', 'log'"):
        TensorQParams(np.array([1.0], np.float32), np.array([0], np.int32), -1, 1, grid="ternary")
    with pytest.raises(
        ValueError, match="unknown quantization grid 'ternary'; registered: fp8_e4m3, fp8_e5m2, linear, log"
    ):
        grid_of("ternary")
