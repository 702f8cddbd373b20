"""FP8 (E4M3FN, E5M2): the fake quantization against the formats decoded bit by bit here, the scheme key, and the
tensorrt_fp8 backend deployed as FLOAT8 Q/DQ and verified on onnxruntime (which runs FP8 QuantizeLinear /
DequantizeLinear on the CPU)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper
from torch import nn

from mqbench.convert_deploy import convert_deploy
from mqbench.deploy.verify import verify_deploy
from mqbench.functional import fp8_quantize
from mqbench.grids import grid_of
from mqbench.models.transformers import BertTiny
from mqbench.prepare_by_platform import prepare_by_platform
from mqbench.qparams import TensorQParams
from mqbench.scheme import QuantScheme
from mqbench.utils.state import enable_calibration, enable_quantization

# (exponent bits, mantissa bits, bias, whether the all-ones exponent holds numbers (E4M3FN) or inf/NaN (E5M2))
FORMATS = {"e4m3": (4, 3, 7, True), "e5m2": (5, 2, 15, False)}


def _values(fmt: str) -> np.ndarray:
    """Every finite non-negative value of the format, decoded from its bits, ascending."""
    e_bits, m_bits, bias, fn = FORMATS[fmt]
    values = []
    for e in range(2**e_bits):
        for m in range(2**m_bits):
            if e == 2**e_bits - 1 and (not fn or m == 2**m_bits - 1):
                continue  # inf / NaN codes (E4M3FN: only S.1111.111 is NaN)
            if e == 0:
                values.append(m / 2**m_bits * 2.0 ** (1 - bias))  # subnormal
            else:
                values.append((1 + m / 2**m_bits) * 2.0 ** (e - bias))
    return np.array(sorted(values))


def _round(x: np.ndarray, fmt: str) -> np.ndarray:
    """Nearest value of the format, ties to the even code (the even mantissa), saturating at the largest."""
    grid = _values(fmt)
    magnitude = np.minimum(np.abs(x), grid[-1])
    upper = np.clip(np.searchsorted(grid, magnitude), 1, len(grid) - 1)
    lo, hi = grid[upper - 1], grid[upper]
    pick_hi = (magnitude - lo > hi - magnitude) | ((magnitude - lo == hi - magnitude) & (upper % 2 == 0))
    return np.sign(x) * np.where(pick_hi, hi, lo)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_rounding_is_the_format_decoded_from_its_bits(fmt):
    grid = _values(fmt)
    assert grid[-1] == {"e4m3": 448.0, "e5m2": 57344.0}[fmt]
    midpoints = (grid[1:] + grid[:-1]) / 2  # every tie
    rng = np.random.default_rng(0)
    x = np.concatenate([grid, -grid, midpoints, -midpoints, rng.standard_normal(20000) * grid[-1] / 8, [1e9, -1e9]])
    x = x.astype(np.float32)
    got = fp8_quantize(torch.from_numpy(x), torch.tensor([1.0]), fmt).numpy()
    np.testing.assert_array_equal(got, _round(x.astype(np.float64), fmt).astype(np.float32))
    # with a scale: x / s rounded, times s
    s = np.float32(0.0123)
    scaled = fp8_quantize(torch.from_numpy(x[:500]), torch.tensor([s]), fmt).numpy()
    expected = (_round((x[:500] / s).astype(np.float64), fmt).astype(np.float32) * s).astype(np.float32)
    np.testing.assert_array_equal(scaled, expected)


def test_the_grid_counts_fp8_values_as_steps():
    entry = TensorQParams(np.array([0.5], np.float32), np.array([0], np.int32), -448, 448, grid="fp8_e4m3")
    grid = _values("e4m3") * 0.5
    steps = grid_of("fp8_e4m3").steps(entry, np.concatenate([grid, -grid]))
    np.testing.assert_array_equal(steps[: len(grid)], np.arange(len(grid)))  # one step from each value to the next
    np.testing.assert_array_equal(steps[len(grid) :], -np.arange(len(grid)))


def test_the_scheme_key():
    assert QuantScheme(8, symmetric=True, fp8="e4m3").quant_range == (-448, 448)
    assert QuantScheme(8, symmetric=True, per_channel=True, fp8="e5m2").observer_kwargs()["fp8"] == "e5m2"
    with pytest.raises(ValueError, match="fp8 must be one of"):
        QuantScheme(8, fp8="e3m4")
    with pytest.raises(ValueError, match="8-bit symmetric grid with a float scale"):
        QuantScheme(4, fp8="e4m3")
    with pytest.raises(ValueError, match="needs FP8FakeQuantize"):
        prepare_by_platform(
            nn.Sequential(nn.Linear(4, 4)), "tensorrt", {"extra_qconfig_dict": {"w_qscheme": {"fp8": "e4m3"}}}
        )


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8 * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv(x))
        h = h + torch.relu(self.conv2(h))
        # a mean: ReduceMean's axes moved from attribute to input at opset 18, which the FP8 nodes (19) need
        return self.fc(h.flatten(1)) + h.mean(dim=(1, 2, 3))[:, None]


def _bert() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    model = BertTiny(vocab_size=50, dim=32, depth=2, heads=2, max_len=16).eval()
    ids = torch.randint(0, 50, (4, 12), generator=torch.Generator().manual_seed(2))
    return model, (ids, torch.ones(4, 12, dtype=torch.long))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("which", ["conv", "bert"])
def test_tensorrt_fp8_deploys_float8_qdq_and_verifies(fmt, which, tmp_path):
    torch.manual_seed(0)
    if which == "conv":
        model, inputs = ConvNet().eval(), (torch.randn(4, 3, 8, 8),)
    else:
        model, inputs = _bert()
    config = {"extra_qconfig_dict": {"w_qscheme": {"fp8": fmt}, "a_qscheme": {"fp8": fmt}}}
    qmodel = prepare_by_platform(model, "tensorrt_fp8", config)
    enable_calibration(qmodel)
    qmodel(*inputs)
    enable_quantization(qmodel)
    result = convert_deploy(qmodel, "tensorrt_fp8", dummy_input=inputs, output_path=str(tmp_path), model_name="m")
    report = verify_deploy(qmodel, result, inputs)
    assert report.passed, str(report)
    assert report.artifacts["onnx"].per_tensor  # activations and weights compared one by one
    model_file = onnx.load(result.artifacts["onnx"])
    kind = {"e4m3": onnx.TensorProto.FLOAT8E4M3FN, "e5m2": onnx.TensorProto.FLOAT8E5M2}[fmt]
    quantize = [n for n in model_file.graph.node if n.op_type == "QuantizeLinear"]
    inits = {i.name: i for i in model_file.graph.initializer}
    assert quantize and all(inits[n.input[2]].data_type == kind for n in quantize)
    assert max(o.version for o in model_file.opset_import if o.domain in ("", "ai.onnx")) >= 19
    # every weight's scale is amax / largest per output channel
    largest = {"e4m3": 448.0, "e5m2": 57344.0}[fmt]
    for tensor, entry in result.table.weights().items():
        weight = np.abs(numpy_helper.to_array(inits[tensor]).reshape(entry.scale.size, -1)).max(axis=1)
        np.testing.assert_allclose(entry.scale, weight / largest, rtol=1e-6)


def test_a_wrong_fp8_scale_fails_verification(tmp_path):
    torch.manual_seed(0)
    x = torch.randn(4, 3, 8, 8)
    qmodel = prepare_by_platform(ConvNet().eval(), "tensorrt_fp8")
    enable_calibration(qmodel)
    qmodel(x)
    enable_quantization(qmodel)
    result = convert_deploy(qmodel, "tensorrt_fp8", dummy_input=x, output_path=str(tmp_path), model_name="m")
    model = onnx.load(result.artifacts["onnx"])
    name = next(n.input[1] for n in model.graph.node if n.op_type == "QuantizeLinear" and "conv2" in n.input[0])
    init = next(i for i in model.graph.initializer if i.name == name)
    init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) * np.float32(1.3), name))
    onnx.save(model, result.artifacts["onnx"])
    assert not verify_deploy(qmodel, result, x, host=False).passed
