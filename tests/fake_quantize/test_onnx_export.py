"""Every learnable / special fake quantizer exports to ONNX and runs in onnxruntime bit for bit.

Each quantizer class is exported once per exporter (``torch.onnx.export`` with ``dynamo=False``
and ``dynamo=True``, dynamic batch axis) as a bundle of its configurations (per-tensor and
per-channel; 8-bit, a narrow [-127, 127] range and 4-bit), calibrated and switched to
quantize-only; the bundle concatenates their outputs along the batch axis. onnxruntime must
reproduce PyTorch exactly on two batch sizes.
"""

import numpy as np
import pytest
import torch

from mqbench.fake_quantize import (
    DoReFaFakeQuantize,
    DSQFakeQuantize,
    LearnableFakeQuantize,
    NNIEFakeQuantize,
    PACTFakeQuantize,
    TqtFakeQuantize,
)
from mqbench.utils.state import enable_calibration, enable_quantization
from onnx_helpers import export_onnx, run_onnx

INT8 = dict(quant_min=-128, quant_max=127, qscheme=torch.per_tensor_symmetric)
NARROW = dict(quant_min=-127, quant_max=127, qscheme=torch.per_tensor_symmetric)
UINT8 = dict(quant_min=0, quant_max=255, qscheme=torch.per_tensor_affine)
UINT8_SYM = dict(quant_min=0, quant_max=255, qscheme=torch.per_tensor_symmetric)
INT4_SYM = dict(quant_min=-8, quant_max=7, qscheme=torch.per_tensor_symmetric)
UINT4 = dict(quant_min=0, quant_max=15, qscheme=torch.per_tensor_affine)
PC_NARROW = dict(quant_min=-127, quant_max=127, qscheme=torch.per_channel_symmetric, ch_axis=1)
PC_INT4 = dict(quant_min=-8, quant_max=7, qscheme=torch.per_channel_affine, ch_axis=1)
PC_INT4_SYM = dict(quant_min=-8, quant_max=7, qscheme=torch.per_channel_symmetric, ch_axis=1)
INT10 = dict(quant_min=-512, quant_max=511, qscheme=torch.per_tensor_symmetric)


def train_lsq(fq):
    with torch.no_grad():  # trained values: a non-integer zero point, a moved scale
        fq.scale.mul_(0.93)
        if not fq.symmetric:
            fq.zero_point.add_(0.4)


def train_pact(fq):
    with torch.no_grad():
        fq.alpha.fill_(1.7)


def train_tqt(fq):
    with torch.no_grad():
        fq.log2_threshold.sub_(0.8)


BUNDLES = {
    "lsq": (
        LearnableFakeQuantize,
        [INT8, NARROW, UINT8, UINT4, PC_NARROW, PC_INT4, INT10],
        train_lsq,
    ),
    "pact": (
        PACTFakeQuantize,
        [INT8, NARROW, UINT8, UINT4, {**UINT8_SYM, "pot_scale": True}],
        train_pact,
    ),
    "dorefa": (DoReFaFakeQuantize, [INT8, NARROW, UINT8, INT4_SYM, PC_NARROW, PC_INT4], None),
    "dsq": (DSQFakeQuantize, [INT8, NARROW, UINT8, UINT4, PC_NARROW, PC_INT4], None),
    "tqt": (TqtFakeQuantize, [INT8, NARROW, UINT8_SYM, INT4_SYM, PC_NARROW, PC_INT4_SYM], train_tqt),
}


class Bundle(torch.nn.Module):
    def __init__(self, quantizers):
        super().__init__()
        self.quantizers = torch.nn.ModuleList(quantizers)

    def forward(self, x):
        # a distinct input per quantizer (see test_quantizers_sharing_an_input_dynamo)
        return torch.cat([quantizer(x * (1.0 + 0.125 * i)) for i, quantizer in enumerate(self.quantizers)], dim=0)


def batch(size, seed, scale=1.0):
    generator = torch.Generator().manual_seed(seed)
    spread = torch.tensor([0.3, 1.0, 2.5, 6.0]).reshape(1, 4, 1)  # channels of different ranges
    return (torch.randn(size, 4, 6, generator=generator) * spread + 0.2) * scale


def prepared(model, calibration):
    enable_calibration(model)
    model(calibration)
    enable_quantization(model)
    return model.eval()


def check_runtime_matches(model, onnx_model, inputs):
    for x in inputs:
        with torch.no_grad():
            expected = model(x).numpy()
        actual = run_onnx(onnx_model, x)
        assert actual.shape == expected.shape
        mismatched = int((actual != expected).sum())
        assert mismatched == 0, f"{mismatched} of {expected.size} outputs differ"
        np.testing.assert_array_equal(actual, expected)


@pytest.mark.parametrize("name", BUNDLES)
def test_export_matches_pytorch_bit_for_bit(name, dynamo, tmp_path):
    cls, schemes, train = BUNDLES[name]
    model = prepared(Bundle([cls(**kwargs) for kwargs in schemes]), batch(8, 0))
    if train is not None:
        for quantizer in model.quantizers:
            train(quantizer)
    onnx_model = export_onnx(model, batch(2, 1), dynamo, tmp_path)

    ops = [node.op_type for node in onnx_model.graph.node]
    low_bit = sum(quantizer.bitwidth <= 8 for quantizer in model.quantizers)
    # learnable quantizers export as their fixed Q/DQ equivalent
    assert ops.count("QuantizeLinear") == low_bit and ops.count("DequantizeLinear") == low_bit
    check_runtime_matches(model, onnx_model, [batch(3, 2, scale=1.3), batch(50, 3, scale=1.3)])


class Normalize(torch.nn.Module):
    def forward(self, x):
        return DoReFaFakeQuantize.normalize(x)


def test_dorefa_normalisation_is_bit_exact_in_onnxruntime(dynamo, tmp_path):
    """tanh in float64, rounded to float32: onnxruntime's float32 Tanh differs from PyTorch's in the last bit."""
    onnx_model = export_onnx(Normalize(), batch(2, 1), dynamo, tmp_path)
    check_runtime_matches(Normalize(), onnx_model, [batch(1000, 4, scale=0.7)])


def nnie_boundary_inputs():
    """Float32 neighbours of every point where NNIE's rounding or thresholds switch, and the levels."""
    m = torch.arange(-2000, 2040, dtype=torch.float64)
    points = [torch.pow(2.0, (m + 0.5) / 16).float(), torch.pow(2.0, m / 16).float()]
    towards = (torch.tensor(0.0), torch.tensor(float("inf")))
    values = torch.cat([p for point in points for p in (point, *(torch.nextafter(point, t) for t in towards))])
    values = values[torch.isfinite(values) & (values > 0)]
    values = torch.cat([values, -values, torch.zeros(48)])
    return values[: values.numel() // 24 * 24].reshape(-1, 4, 6)


def test_nnie_export_matches_pytorch_bit_for_bit(dynamo, tmp_path):
    model = Bundle([NNIEFakeQuantize() for _ in range(3)])
    enable_calibration(model)
    for quantizer, data_max in zip(model.quantizers, (8.0, 0.37, 1000.0), strict=True):
        quantizer(torch.tensor([data_max]))
    enable_quantization(model)
    onnx_model = export_onnx(model, batch(2, 1), dynamo, tmp_path)
    ops = {node.op_type for node in onnx_model.graph.node}
    assert "QuantizeLinear" not in ops and {"Log", "Pow", "Round"} <= ops
    boundaries = nnie_boundary_inputs()
    check_runtime_matches(model, onnx_model, [batch(3, 2, scale=3.0), batch(7, 3, scale=0.01), boundaries])


class SharedInput(torch.nn.Module):
    def __init__(self, first, second):
        super().__init__()
        self.first, self.second = first, second

    def forward(self, x):
        return self.first(x) + self.second(x)


def test_pact_quantizers_sharing_an_input(dynamo, tmp_path):
    model = prepared(
        SharedInput(PACTFakeQuantize(alpha=1.5, **UINT8), PACTFakeQuantize(alpha=2.0, **INT8)), batch(8, 0)
    )
    onnx_model = export_onnx(model, batch(2, 1), dynamo, tmp_path)
    check_runtime_matches(model, onnx_model, [batch(3, 2, scale=1.3)])


def test_narrow_range_quantizers_sharing_an_input_dynamo(tmp_path):
    model = prepared(SharedInput(LearnableFakeQuantize(**NARROW), LearnableFakeQuantize(**UINT4)), batch(8, 0))
    onnx_model = export_onnx(model, batch(2, 1), True, tmp_path)
    check_runtime_matches(model, onnx_model, [batch(3, 2, scale=1.3)])
