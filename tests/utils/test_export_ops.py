"""The forms the export capture writes ATen ops in compute what the ops compute."""

from __future__ import annotations

import io

import onnx
import pytest
import torch

from mqbench.utils.export_ops import cumsum, diff


@pytest.mark.parametrize(
    ("n", "dim", "ends"),
    [(1, -1, None), (2, 0, None), (1, 1, "prepend"), (1, -1, "append"), (3, 1, "both"), (0, 1, None)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool])
def test_diff_computes_torch_diff(n, dim, ends, dtype):
    generator = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 6, 4, generator=generator) * 5).to(dtype)
    side = list(x.shape)
    side[dim] = 2
    extra = (torch.randn(side, generator=generator) * 5).to(dtype)
    kwargs = {}
    if ends in ("prepend", "both"):
        kwargs["prepend"] = extra
    if ends in ("append", "both"):
        kwargs["append"] = extra[tuple(slice(None, 1) if d == dim % 3 else slice(None) for d in range(3))]
    assert torch.equal(diff(x, n, dim, **kwargs), torch.diff(x, n, dim, **kwargs))


def test_diff_refuses_what_torch_diff_refuses():
    with pytest.raises(ValueError, match="at least one dimension"):
        diff(torch.tensor(1.0))
    with pytest.raises(ValueError, match="non-negative order"):
        diff(torch.ones(3), n=-1)
    with pytest.raises(ValueError, match="prepend and append"):
        diff(torch.ones(2, 3), prepend=torch.ones(3))


@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8, torch.int16, torch.int32, torch.int64, torch.float32])
def test_cumsum_computes_torch_cumsum(dtype):
    x = (torch.randn(2, 7, generator=torch.Generator().manual_seed(1)) * 3).abs().to(dtype)
    got, expected = cumsum(x, 1), torch.cumsum(x, 1)
    assert got.dtype == expected.dtype and torch.equal(got, expected)
    assert torch.equal(cumsum(x, 0, dtype=torch.float64), torch.cumsum(x, 0, dtype=torch.float64))


def test_packed_sequence_check_exports_with_a_dynamic_length():
    """transformers' packed-sequence check written with these forms exports to ONNX (no aten::diff, no CumSum of a
    boolean) and keeps the sequence length dynamic."""
    onnxruntime = pytest.importorskip("onnxruntime")

    class Packed(torch.nn.Module):
        def forward(self, positions):
            return cumsum(diff(positions, prepend=positions[:, :1] - 1, dim=-1) != 1, -1)

    buffer = io.BytesIO()
    positions = torch.arange(6)[None]
    torch.onnx.export(
        Packed(),
        (positions,),
        buffer,
        input_names=["positions"],
        dynamic_axes={"positions": {1: "sequence"}},
        opset_version=17,
        dynamo=False,
    )
    model = onnx.load_from_string(buffer.getvalue())
    assert "CumSum" in {node.op_type for node in model.graph.node}
    session = onnxruntime.InferenceSession(buffer.getvalue(), providers=["CPUExecutionProvider"])
    packed = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    (got,) = session.run(None, {"positions": packed.numpy()})
    assert got.tolist() == [[0, 0, 0, 1, 1, 2, 2, 2, 2]]
