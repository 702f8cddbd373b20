"""The float reference's GatherElements: every index of every row, on axes longer than 64 (where onnx's reference
evaluator reads only the first index of each row), negative indices counted from the end."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from mqbench.deploy.reference.values import run_float


@pytest.mark.parametrize(
    ("shape", "index_shape", "axis"), [((1, 512), (1, 32), 1), ((3, 100, 4), (3, 7, 4), 1), ((70, 5), (9, 5), 0)]
)
def test_gather_elements_reads_every_index(shape, index_shape, axis):
    rng = np.random.default_rng(0)
    data = rng.standard_normal(shape).astype(np.float32)
    indices = rng.integers(-shape[axis], shape[axis], size=index_shape).astype(np.int64)
    node = helper.make_node("GatherElements", ["data", "indices"], ["out"], name="gather", axis=axis)
    (out,) = run_float(node, [data, indices], [helper.make_opsetid("", 17)])
    expected = np.empty(index_shape, np.float32)
    for position in np.ndindex(*index_shape):  # ONNX: out[i][j][k] = data[..., indices[i][j][k] on axis, ...]
        source = list(position)
        source[axis] = int(indices[position]) % shape[axis]
        expected[position] = data[tuple(source)]
    np.testing.assert_array_equal(out, expected)
