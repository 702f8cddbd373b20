"""Group-wise weights (one scale per group of input channels): the scheme key, the simulation against the formula
written here, and the weight-only backends' two ONNX forms (blocked DequantizeLinear on packed integers, and
onnxruntime's MatMulNBits) read back by hand and verified on onnxruntime."""

from __future__ import annotations

import math
import os
import warnings

import ml_dtypes
import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper
from torch import Tensor, nn

from mqbench.backends import BackendSpec, Placement, QuantizerSpec
from mqbench.convert_deploy import convert_deploy
from mqbench.deploy.verify import verify_deploy
from mqbench.functional import from_groups, to_groups
from mqbench.nn.qat.modules import Embedding as QATEmbedding
from mqbench.prepare_by_platform import prepare_by_platform
from mqbench.scheme import QuantScheme
from mqbench.utils.state import enable_calibration, enable_quantization

WEIGHT_ONLY = ["llm_w4a16", "llm_w8a16"]


def _reference(weight: Tensor, group: int, low: int, high: int, symmetric: bool) -> Tensor:
    """Per group of ``group`` input channels (the last one partial): MinMax range, then round to nearest; in
    float32, as the deployed formats compute it."""
    out = torch.empty_like(weight)
    for row in range(weight.shape[0]):
        for start in range(0, weight.shape[1], group):
            block = weight[row, start : start + group]
            lo, hi = torch.clamp(block.min(), max=0.0), torch.clamp(block.max(), min=0.0)
            if symmetric:
                scale = torch.maximum(-lo, hi) / ((high - low) / 2)
                zero = torch.tensor(0.0)
            else:
                scale = (hi - lo) / (high - low)
                zero = torch.clamp(low - torch.round(lo / scale), low, high)
            q = torch.clamp(torch.round(block / scale) + zero, low, high)
            out[row, start : start + group] = (q - zero) * scale
    return out


def test_groups_are_rows_of_input_channels_and_back():
    x = torch.arange(2 * 5 * 3, dtype=torch.float32).reshape(2, 5, 3)  # a conv-like [O, I, k]: groups along I
    rows = to_groups(x, 2)
    assert rows.shape == (2 * 3 * 3, 2)
    # output channel 0, kernel position 1: input channels (0, 1), (2, 3), (4, 4 repeated)
    assert rows[1].tolist() == [x[0, 0, 1].item(), x[0, 1, 1].item()]
    assert rows[3 * 2 + 1].tolist() == [x[0, 4, 1].item(), x[0, 4, 1].item()]
    assert torch.equal(from_groups(rows, x.shape, 2), x)


def test_the_scheme_key_is_checked():
    assert QuantScheme(4, per_channel=True, group_size=64).observer_kwargs()["group_size"] == 64
    assert "group_size" not in QuantScheme(4, per_channel=True).observer_kwargs()
    with pytest.raises(ValueError, match="needs per_channel=True"):
        QuantScheme(4, group_size=64)
    for bad in (1, 0, True, 64.0):
        with pytest.raises(ValueError, match="group_size must be an int of at least 2"):
            QuantScheme(4, per_channel=True, group_size=bad)
    grouped = QuantScheme(4, per_channel=True, group_size=64)
    assert grouped.updated({"per_channel": False}).group_size is None  # per-tensor has no groups
    with pytest.raises(ValueError, match="needs per_channel=True"):
        prepare_by_platform(
            nn.Sequential(nn.Linear(4, 4)), "snpe", {"extra_qconfig_dict": {"w_qscheme": {"group_size": 2}}}
        )


@pytest.mark.parametrize(
    ("bits", "symmetric", "group"), [(4, True, 128), (4, False, 32), (3, True, 64), (8, True, 128)]
)
def test_the_simulation_is_the_group_formula(bits, symmetric, group):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(300, 40), nn.ReLU(), nn.Linear(40, 8)).eval()
    scheme = {"bit": bits, "symmetry": symmetric, "group_size": group}
    qmodel = prepare_by_platform(model, "llm_w4a16", {"extra_qconfig_dict": {"w_qscheme": scheme}})
    enable_calibration(qmodel)
    qmodel(torch.randn(3, 300))
    enable_quantization(qmodel)
    low, high = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if symmetric else (0, 2**bits - 1)
    for index in ("0", "2"):
        weight = model.get_submodule(index).weight.detach()
        quantizer = qmodel.get_submodule(f"{index}.weight_fake_quant")
        assert (quantizer.quant_min, quantizer.quant_max, quantizer.group_size) == (low, high, group)
        expected = _reference(weight, group, low, high, symmetric)
        assert torch.equal(quantizer(weight), expected)
    assert not [n for n, _ in qmodel.named_modules() if n.endswith("_post_act_fake_quantizer")]  # weights only


def test_conv_and_embedding_weights_quantize_in_groups():
    torch.manual_seed(0)
    conv = nn.Conv2d(6, 4, 3)
    scheme = QuantScheme(4, per_channel=True, group_size=4)
    factory = QuantizerSpec(scheme, "FixedFakeQuantize", "MinMaxObserver").factory()
    quantizer = factory()
    out = quantizer(conv.weight.detach())
    # input channels 0-3 and 4-5 of each (output channel, kernel position) share a scale
    w = conv.weight.detach()
    for o, i, j in ((0, 0, 0), (3, 2, 1)):
        for start, stop in ((0, 4), (4, 6)):
            block = w[o, start:stop, i, j]
            scale = float(np.float32(block.abs().max().item() / 7.5))
            expected = torch.clamp(torch.round(block / scale), -8, 7) * scale
            assert torch.allclose(out[o, start:stop, i, j], expected, atol=1e-6)
    embedding = QATEmbedding.from_float(nn.Embedding(10, 12), factory)
    table = embedding.weight_fake_quant(embedding.weight.detach())
    assert torch.allclose(table, _reference(embedding.weight.detach(), 4, -8, 7, True), atol=1e-6)


class Decoderish(nn.Module):
    """An embedding, a linear layer on 3-D activations (Transpose -> MatMul), one on 2-D (Gemm), no bias on one,
    an input width that leaves a partial last group."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(40, 256)
        self.up = nn.Linear(256, 200)
        self.down = nn.Linear(200, 256, bias=False)
        self.head = nn.Linear(256, 16)

    def forward(self, ids: Tensor) -> Tensor:
        h = self.down(torch.relu(self.up(self.embed(ids))))
        return self.head(h.mean(dim=1))


def _deployed(backend: str, tmp_path, config: dict | None = None, embeddings: bool = False):
    torch.manual_seed(0)
    model = Decoderish().eval()
    ids = torch.randint(0, 40, (3, 9), generator=torch.Generator().manual_seed(1))
    config = dict(config or {})
    if embeddings:  # quantized too: the weight-only backends keep embedding tables float by default
        config["extra_fuse_dict"] = {"additional_qat_module_mapping": {nn.Embedding: QATEmbedding}}
        config["float_layers"] = []
    qmodel = prepare_by_platform(model, backend, config)
    enable_calibration(qmodel)
    qmodel(ids)
    enable_quantization(qmodel)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = convert_deploy(qmodel, backend, dummy_input=ids, output_path=str(tmp_path), model_name="m")
    return qmodel, ids, result, [str(w.message) for w in caught]


def _dequantized_by_hand(model: onnx.ModelProto, weight: str) -> np.ndarray:
    """The blocked DequantizeLinear of ``weight`` computed here: (q - z) * s, each block's own s and z."""
    inits = {i.name: i for i in model.graph.initializer}
    node = next(n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.output[0] == f"{weight}_dq")
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    q = numpy_helper.to_array(inits[node.input[0]]).astype(np.float64)
    s = numpy_helper.to_array(inits[node.input[1]]).astype(np.float64)
    z = numpy_helper.to_array(inits[node.input[2]]).astype(np.float64)
    block = attrs["block_size"]
    assert attrs["axis"] == 1 and s.shape == (q.shape[0], math.ceil(q.shape[1] / block))
    s, z = np.repeat(s, block, axis=1)[:, : q.shape[1]], np.repeat(z, block, axis=1)[:, : q.shape[1]]
    return ((q - z) * s).astype(np.float32)


@pytest.mark.parametrize("backend", WEIGHT_ONLY)
def test_both_forms_deploy_verify_and_hold_the_simulated_weights(backend, tmp_path):
    qmodel, ids, result, caught = _deployed(backend, tmp_path, embeddings=True)
    assert sorted(result.artifacts) == ["deploy_onnx", "matmulnbits_onnx", "onnx"]
    report = verify_deploy(qmodel, result, ids)
    assert report.passed, str(report)
    assert set(report.artifacts) >= {"onnx", "matmulnbits_onnx"}
    bits = 4 if backend == "llm_w4a16" else 8
    qdq = onnx.load(result.artifacts["onnx"])
    inits = {i.name: i for i in qdq.graph.initializer}
    expected_type = onnx.TensorProto.INT4 if bits == 4 else onnx.TensorProto.INT8
    for layer in ("embed", "up", "down", "head"):
        assert inits[f"{layer}.weight_quantized"].data_type == expected_type
        assert f"{layer}.weight" not in inits  # the float weight is gone: only the integers are stored
        simulated = qmodel.get_submodule(f"{layer}.weight_fake_quant")(qmodel.get_submodule(layer).weight.detach())
        np.testing.assert_array_equal(_dequantized_by_hand(qdq, f"{layer}.weight"), simulated.numpy())
    # MatMulNBits for the three linear layers; the embedding stays a blocked DequantizeLinear (said in a warning)
    nbits = onnx.load(result.artifacts["matmulnbits_onnx"])
    ops = [n.op_type for n in nbits.graph.node]
    assert ops.count("MatMulNBits") == 3 and ops.count("DequantizeLinear") == 1
    assert all(
        onnx.helper.get_attribute_value(a) == bits
        for n in nbits.graph.node
        if n.op_type == "MatMulNBits"
        for a in n.attribute
        if a.name == "bits"
    )
    assert any("stay blocked DequantizeLinear" in m and "embed.weight: read by Gather" in m for m in caught), caught


def test_asymmetric_groups_carry_packed_zero_points(tmp_path):
    config = {"extra_qconfig_dict": {"w_qscheme": {"symmetry": False, "group_size": 32}}}
    qmodel, ids, result, _ = _deployed("llm_w4a16", tmp_path, config)
    nbits = onnx.load(result.artifacts["matmulnbits_onnx"])
    inits = {i.name: numpy_helper.to_array(i) for i in nbits.graph.initializer}
    up = next(n for n in nbits.graph.node if n.op_type == "MatMulNBits" and n.input[1] == "up.weight_packed")
    assert len(up.input) == 4  # zero points given: the grid is not the default 8
    # unpack B by hand and rebuild the weight: (q - z) * s, two values a byte, low nibble first, 32 per block
    packed, scales, zeros = (inits[name] for name in up.input[1:4])
    low, high = packed & 0x0F, packed >> 4
    q = np.stack([low, high], axis=-1).reshape(packed.shape[0], -1)[:, :256].astype(np.float64)
    blocks = packed.shape[1]
    z = np.stack([zeros & 0x0F, zeros >> 4], axis=-1).reshape(packed.shape[0], -1)[:, :blocks].astype(np.float64)
    s = scales.reshape(packed.shape[0], blocks).astype(np.float64)
    weight = (q - np.repeat(z, 32, axis=1)) * np.repeat(s, 32, axis=1)
    simulated = qmodel.get_submodule("up.weight_fake_quant")(qmodel.get_submodule("up").weight.detach())
    np.testing.assert_allclose(weight.astype(np.float32), simulated.numpy(), rtol=0, atol=0)
    assert verify_deploy(qmodel, result, ids).passed


def test_a_wrong_matmulnbits_file_fails_verification(tmp_path):
    qmodel, ids, result, _ = _deployed("llm_w4a16", tmp_path)
    model = onnx.load(result.artifacts["matmulnbits_onnx"])
    scales = next(i for i in model.graph.initializer if i.name == "down.weight_scales")
    values = numpy_helper.to_array(scales).copy()
    values[5] *= 1.5  # one block's scale off
    scales.CopyFrom(numpy_helper.from_array(values, scales.name))
    onnx.save(model, result.artifacts["matmulnbits_onnx"])
    report = verify_deploy(qmodel, result, ids, host=False)
    assert not report.passed
    assert report.artifacts["matmulnbits_onnx"].diverging(1)
    assert not report.artifacts["onnx"].diverging(1)


def test_the_packed_file_is_a_fraction_of_the_float_one(tmp_path):
    # 4 bits a weight plus one float32 scale per 128 (and the int4 zero point): 4 + 32/128 + 4/128 = 4.28 bits
    # against 32; the biases and the model's structure (4 KiB) stay float. MatMulNBits pads each row to whole blocks.
    qmodel, _, result, _ = _deployed("llm_w4a16", tmp_path, embeddings=True)
    sizes = {key: os.path.getsize(path) for key, path in result.artifacts.items()}
    weights = [p for name, p in qmodel.named_parameters() if name.endswith("weight")]
    biases = sum(p.numel() for name, p in qmodel.named_parameters() if name.endswith("bias"))
    float_bytes = (sum(w.numel() for w in weights) + biases) * 4
    for key, count in (
        ("onnx", sum(w.numel() for w in weights)),
        ("matmulnbits_onnx", sum(w.shape[0] * math.ceil(w.shape[1] / 128) * 128 for w in weights)),
    ):
        assert sizes[key] < count * 4.28 / 8 + biases * 4 + 4096, key
        assert sizes[key] / sizes["deploy_onnx"] < 0.16 < (count * 4.28 / 8 + biases * 4 + 4096) / float_bytes + 0.02


def test_group_wise_weights_are_refused_where_the_format_cannot_hold_them(tmp_path):
    scheme = {"w_qscheme": {"bit": 4, "symmetry": True, "per_channel": True, "group_size": 16}}
    model = nn.Sequential(nn.Linear(32, 8), nn.ReLU(), nn.Linear(8, 4)).eval()
    qmodel = prepare_by_platform(model, "tensorrt", {"extra_qconfig_dict": scheme})
    x = torch.randn(2, 32)
    enable_calibration(qmodel)
    qmodel(x)
    enable_quantization(qmodel)
    with pytest.raises(ValueError, match=r"quantized in groups .*'clip_ranges'.*'llm_w4a16'"):
        convert_deploy(qmodel, "tensorrt", dummy_input=x, output_path=str(tmp_path), model_name="m")
    # the same model on a weight-only backend (the second layer's 8 inputs are one partial group of 16)
    wonly = prepare_by_platform(model, "llm_w4a16", {"extra_qconfig_dict": {"w_qscheme": {"group_size": 16}}})
    enable_calibration(wonly)
    wonly(x)
    enable_quantization(wonly)
    result = convert_deploy(wonly, "llm_w4a16", dummy_input=x, output_path=str(tmp_path / "w"), model_name="m")
    assert verify_deploy(wonly, result, x).passed
    with pytest.raises(ValueError, match="does not quantize in groups"):
        prepare_by_platform(
            model, "tensorrt", {"extra_qconfig_dict": {**scheme, "w_fakequantize": "DoReFaFakeQuantize"}}
        )


def test_weight_only_backends_have_no_activation_settings():
    with pytest.raises(ValueError, match="quantizes weights only"):
        prepare_by_platform(
            nn.Sequential(nn.Linear(4, 4)), "llm_w4a16", {"extra_qconfig_dict": {"a_observer": "MinMaxObserver"}}
        )
    with pytest.raises(ValueError, match="is weight-only"):
        BackendSpec("mine", QuantizerSpec(QuantScheme(4)), None, Placement(inputs_of={"linear"}), weight_only=True)
    assert ml_dtypes.int4(7) == 7  # the 4-bit type the packed weights are written with
