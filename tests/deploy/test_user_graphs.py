"""Graphs users write that tools get wrong: dead branches, in-place calls, returned inputs and
quantized tensors, unused inputs, ``movedim``, all-zero weights, nothing to quantize.

Each deployed model is run as a user loads it (onnxruntime on the file) and every output is
compared with the simulation (``qmodel(x)``): the deployment must compute what was simulated.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from backend_configs import host_config
from fuzz.grammar import generate
from fuzz.harness import calibrate
from mqbench.convert_deploy import convert_deploy
from mqbench.deploy.onnx_graph import ort_session
from mqbench.deploy.verify import verify_deploy
from mqbench.prepare_by_platform import prepare_by_platform
from mqbench.utils.state import disable_all, enable_calibration, enable_quantization, is_quantizer

BACKENDS = ["tensorrt", "openvino", "onnx_qnn", "vitis", "nnie"]
SHAPE = [1, 3, 8, 8]


def calibrated(model: nn.Module, backend: str, inputs: tuple[torch.Tensor, ...]) -> nn.Module:
    qmodel = prepare_by_platform(model.eval(), backend, host_config(backend))
    enable_calibration(qmodel)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _ in range(3):
            qmodel(*(torch.randn(t.shape, generator=generator) if t.is_floating_point() else t for t in inputs))
    enable_quantization(qmodel)
    return qmodel


def as_tuple(value) -> tuple[torch.Tensor, ...]:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def deploy_and_check(model: nn.Module, backend: str, inputs: tuple[torch.Tensor, ...], tmp_path) -> None:
    """Deploy, verify, and run the Q/DQ file on onnxruntime: every output equals the simulation's."""
    qmodel = calibrated(model, backend, inputs)
    result = convert_deploy(qmodel, backend, dummy_input=inputs, output_path=tmp_path)
    report = verify_deploy(qmodel, result, inputs, reference=True)
    assert report.passed, report.failures()
    with torch.no_grad():
        simulated = [t.numpy() for t in as_tuple(qmodel(*inputs))]
    session = ort_session(result.artifacts["onnx"], optimize=False)
    feeds = {name: t.numpy() for name, t in zip(result.input_names, inputs, strict=True)}
    got = session.run(None, feeds)
    assert len(got) == len(simulated)
    for deployed, expected in zip(got, simulated, strict=True):
        # the same function of the same quantized values: only float32 summation order parts them
        np.testing.assert_allclose(deployed, expected, rtol=0, atol=1e-4 * max(1.0, float(np.abs(expected).max())))


class DeadBranch(nn.Module):
    """A shared in-place ReLU also called in a branch whose result nothing reads."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2, self.act = nn.Conv2d(3, 4, 3), nn.Conv2d(4, 4, 3), nn.ReLU(inplace=True)

    def forward(self, x):
        y = self.act(self.c1(x))
        self.act(self.c2(y))  # dead
        return y


class OutputFeedsLayer(nn.Module):
    """An output that also feeds a quantized layer: it must stay unclipped (the simulation returns it float)."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 4, 3), nn.Conv2d(4, 4, 3)

    def forward(self, x):
        v = torch.relu(self.c1(x))
        return self.c2(v), v


class ReturnsInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        return self.c(x), x


class InPlaceOnSharedTensor(nn.Module):
    """``relu_`` on a tensor a layer read before: that layer keeps the values before the call."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2, self.c3 = nn.Conv2d(3, 4, 3), nn.Conv2d(4, 4, 1), nn.Conv2d(4, 4, 1)

    def forward(self, x):
        a = self.c1(x)
        b = self.c2(a)
        torch.relu_(a)
        return b + self.c3(a)


class Movedim(nn.Module):
    """A Linear on the channel axis through ``movedim`` (exported with a negative Transpose perm)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 5)

    def forward(self, x):
        return self.linear(x.movedim(1, -1)).movedim(-1, 1)


class UnusedInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv2d(3, 4, 3)

    def forward(self, x, y):
        return self.c(x)


class ZeroWeights(nn.Module):
    """Two residual blocks whose last BatchNorm starts at zero (timm's init): equal all-zero folded weights."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)) for _ in range(2))
        for block in self.blocks:
            nn.init.zeros_(block[1].weight)

    def forward(self, x):
        x = torch.relu(self.stem(x))
        for block in self.blocks:
            x = torch.relu(x + block(x))
        return x


class ConstantOperands(nn.Module):
    """Operands computed from parameters alone, which the exporter folds into constants: a ConvNeXt-style
    layer scale (``gamma.reshape``) and a Swin-style relative position bias gathered from its table."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.gamma = nn.Parameter(torch.rand(4) + 0.5)
        self.table = nn.Parameter(torch.randn(15, 4))
        self.register_buffer("index", torch.randint(0, 15, (8 * 8,)), persistent=False)

    def forward(self, x):
        y = self.conv(x) * self.gamma.reshape(1, -1, 1, 1)
        bias = self.table[self.index].reshape(8, 8, 4).permute(2, 0, 1)
        return torch.relu(y + bias.unsqueeze(0))


class DilatedSame(nn.Module):
    """``padding="same"`` with dilations (exported as auto_pad SAME, which onnxruntime refuses with dilations)."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 4, 3, padding="same", dilation=2)
        self.c2 = nn.Conv2d(4, 4, 2, padding="same", dilation=3)

    def forward(self, x):
        return self.c2(torch.relu(self.c1(x)))


class CeilModePools(nn.Module):
    """Average pools in ceil mode, with and without padding of their own, whose last windows run past the edge
    (torch divides those by the part within the input and padding), and a zero ``F.pad`` of a quantized tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2, self.c3 = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 1), nn.Conv2d(4, 4, 2)
        self.p1 = nn.AvgPool2d(3, 2, ceil_mode=True)
        self.p2 = nn.AvgPool2d(3, 2, padding=1, ceil_mode=True)

    def forward(self, x):
        y = torch.relu(self.c1(x))
        return self.c2(self.p1(y)), self.c3(self.p2(y)), self.c3(F.pad(y, (1, 2, 0, 1)))


class DilatedSameUnknownSize(nn.Module):
    """``padding="same"`` with dilations after a reflect pad, whose output size ONNX shape inference leaves unknown:
    stride 1 pads by the kernel's reach whatever the size."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 4, 3, dilation=2, padding="same")

    def forward(self, x):
        return self.c1(F.pad(x, (1, 0, 1, 1), mode="reflect"))


class MovedimThenShape(nn.Module):
    """A Linear over channels through ``movedim(1, -1)`` / ``movedim(-1, 1)``, then a reshape by ``x.shape[0]``:
    torch's exporter writes negative Transpose axes and folds shapes computed from them into constants."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.conv = nn.Linear(3, 4), nn.Conv2d(4, 4, 1)

    def forward(self, x):
        y = torch.movedim(self.fc(torch.movedim(x, 1, -1)), -1, 1)
        y = y.reshape(-1, 4, 64)
        return self.conv(y.reshape(y.shape[0], 4, 8, 8))


class ViewAfterInterpolate(nn.Module):
    """An interpolated tensor scaled per channel, then ``view``: the integer reference returns the interpolation in
    another memory layout, which the simulation fed with it must not keep."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Conv2d(3, 3, 1)

    def forward(self, x):
        y = F.interpolate(x, size=(4, 8), mode="bilinear")
        y = y * torch.sigmoid(self.gate(F.adaptive_avg_pool2d(y, 1)))
        return y.view(-1, 3, 32).softmax(-1)


CASES = {
    "ceil_mode_pools": (CeilModePools, 1),
    "dilated_same_unknown_size": (DilatedSameUnknownSize, 1),
    "movedim_then_shape": (MovedimThenShape, 1),
    "view_after_interpolate": (ViewAfterInterpolate, 1),
    "dilated_same": (DilatedSame, 1),
    "constant_operands": (ConstantOperands, 1),
    "dead_branch": (DeadBranch, 1),
    "output_feeds_layer": (OutputFeedsLayer, 1),
    "returns_input": (ReturnsInput, 1),
    "in_place_on_shared_tensor": (InPlaceOnSharedTensor, 1),
    "movedim": (Movedim, 1),
    "unused_input": (UnusedInput, 2),
    "zero_weights": (ZeroWeights, 1),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_user_graphs_deploy_and_compute_what_was_simulated(case, backend, tmp_path):
    torch.manual_seed(0)
    factory, count = CASES[case]
    generator = torch.Generator().manual_seed(1)
    # 3x the calibration range: clipping a returned float tensor would show
    inputs = tuple(3 * torch.randn(SHAPE, generator=generator) for _ in range(count))
    deploy_and_check(factory(), backend, inputs, tmp_path)


def test_verify_serves_each_file_as_a_session_loads_it(tmp_path):
    """onnxruntime fuses ``DequantizeLinear -> AveragePool(ceil_mode=1, count_include_pad=1) -> QuantizeLinear``
    into an int8 kernel that divides a window past the input's edge by the whole kernel. In this graph (conv,
    split, conv, ``AvgPool2d(3, 2, ceil_mode=True)``, Linear) the fusion happens only in the file as written:
    exposing the dequantized tensors stops it. Put back in the exporter's form, the file fails verify at the
    pool's quantized output, read from the integers the fused kernel writes."""
    graph = generate(56, "image")
    qmodel = calibrate(graph, prepare_by_platform(graph.build(), "openvino", host_config("openvino")))
    result = convert_deploy(qmodel, "openvino", dummy_input=graph.batch(0), output_path=tmp_path)
    inputs = graph.verify_inputs(1.0)
    assert verify_deploy(qmodel, result, inputs).passed
    written = onnx.load(result.artifacts["onnx"])
    (pool,) = [n for n in written.graph.node if n.op_type == "AveragePool"]
    del pool.attribute[:]
    pool.attribute.extend(
        onnx.helper.make_attribute(name, value)
        for name, value in {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1, "count_include_pad": 1}.items()
    )
    onnx.save(written, result.artifacts["onnx"])
    failures = verify_deploy(qmodel, result, inputs, predict=False).failures()
    assert any(f.startswith("onnx: onnxruntime (optimized)") and "(reshape)" in f for f in failures), failures
    assert not any(f.startswith("onnx: onnxruntime (as written)") for f in failures), failures


def test_an_in_place_call_on_a_read_tensor_keeps_the_float_models_values():
    torch.manual_seed(0)
    model = InPlaceOnSharedTensor().eval()
    x = torch.randn(SHAPE)
    qmodel = prepare_by_platform(model, "tensorrt")
    with torch.no_grad():
        expected = model(x.clone())
        disable_all(qmodel)
        got = qmodel(x.clone())
    torch.testing.assert_close(got, expected)


def test_verify_leaves_the_callers_input_unchanged(tmp_path):
    class WritesInput(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c = nn.Conv2d(3, 4, 3)

        def forward(self, x):
            x.narrow(1, 0, 1).mul_(0)  # a write into a view of the input: kept in place
            return self.c(x)

    x = torch.randn(SHAPE)
    before = x.clone()
    qmodel = calibrated(WritesInput(), "tensorrt", (x,))
    result = convert_deploy(qmodel, "tensorrt", dummy_input=x.clone(), output_path=tmp_path)
    verify_deploy(qmodel, result, x)
    assert torch.equal(x, before)


def test_the_movedim_export_is_valid_onnx_with_its_true_output_shape(tmp_path):
    inputs = (torch.randn(SHAPE),)
    qmodel = calibrated(Movedim(), "tensorrt", inputs)
    result = convert_deploy(qmodel, "tensorrt", dummy_input=inputs, output_path=tmp_path)
    model = onnx.load(result.artifacts["onnx"])
    perms = [list(a.ints) for n in model.graph.node if n.op_type == "Transpose" for a in n.attribute]
    assert perms and all(axis >= 0 for perm in perms for axis in perm)
    dims = [d.dim_value for d in model.graph.output[0].type.tensor_type.shape.dim]
    assert dims in ([], [1, 5, 8, 8])


def test_the_unused_input_is_an_input_of_the_deployed_model(tmp_path):
    inputs = (torch.randn(SHAPE), torch.randn(2, 5))
    qmodel = calibrated(UnusedInput(), "tensorrt", inputs)
    result = convert_deploy(qmodel, "tensorrt", dummy_input=inputs, output_path=tmp_path)
    model = onnx.load(result.artifacts["onnx"])
    assert [v.name for v in model.graph.input][:2] == result.input_names
    shape = [d.dim_value for d in model.graph.input[1].type.tensor_type.shape.dim]
    assert shape == [2, 5]


def test_zero_weights_stay_weights_of_their_own_layers(tmp_path):
    inputs = (torch.randn(SHAPE),)
    qmodel = calibrated(ZeroWeights(), "tensorrt", inputs)
    result = convert_deploy(qmodel, "tensorrt", dummy_input=inputs, output_path=tmp_path)
    model = onnx.load(result.artifacts["deploy_onnx"])
    initializers = {i.name for i in model.graph.initializer}
    weights = [name for name, entry in result.table.items() if entry.kind == "weight"]
    assert len(weights) == 3 and set(weights) <= initializers
    assert not [n for n in model.graph.node if n.op_type == "Identity" and n.input[0] in initializers]


class NothingToQuantize(nn.Module):
    def forward(self, x):
        return x.flatten(1).softmax(-1)


def test_a_prepared_model_that_quantizes_nothing_is_told_so(tmp_path):
    with pytest.warns(UserWarning, match="quantize"):
        qmodel = prepare_by_platform(NothingToQuantize().eval(), "tensorrt")
    with pytest.raises(ValueError, match=r"quantizes nothing.*softmax"):
        convert_deploy(qmodel, "tensorrt", {"x": SHAPE}, output_path=tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_deploying_without_enable_quantization_is_an_error_naming_it(tmp_path):
    qmodel = prepare_by_platform(Movedim().eval(), "tensorrt")
    enable_calibration(qmodel)
    qmodel(torch.randn(SHAPE))
    with pytest.raises(ValueError, match="enable_quantization"):
        convert_deploy(qmodel, "tensorrt", {"x": SHAPE}, output_path=tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_verify_refuses_non_finite_inputs(bad, tmp_path):
    inputs = (torch.randn(SHAPE),)
    qmodel = calibrated(Movedim(), "tensorrt", inputs)
    result = convert_deploy(qmodel, "tensorrt", dummy_input=inputs, output_path=tmp_path)
    x = torch.randn(SHAPE)
    x[0, 0, 0, 0] = bad
    with pytest.raises(ValueError, match="non-finite"):
        verify_deploy(qmodel, result, x)


class PositionIds(nn.Module):
    """Integer arithmetic on token ids (position ids as RoBERTa computes them) next to float layers."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens, self.positions, self.linear = nn.Embedding(10, 8), nn.Embedding(40, 8), nn.Linear(8, 8)

    def forward(self, ids):
        mask = ids.ne(1).int()
        positions = torch.cumsum(mask, dim=1).type_as(mask) * mask + 1
        return self.linear(self.tokens(ids) + self.positions(positions.long()))


class IntegerOffsets(nn.Module):
    """A float tensor plus an integer ``arange`` product."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)

    def forward(self, x):
        y = self.conv(x)
        return y + torch.arange(y.shape[-1]) * 2


@pytest.mark.parametrize("backend", [*BACKENDS, "snpe", "tensorrt_nlp"])
def test_integer_arithmetic_is_not_quantized(backend, tmp_path):
    torch.manual_seed(0)
    ids = torch.randint(0, 10, (2, 6), generator=torch.Generator().manual_seed(2))
    deploy_and_check(PositionIds(), backend, (ids,), tmp_path / "ids")
    deploy_and_check(IntegerOffsets(), backend, (torch.randn(SHAPE),), tmp_path / "offsets")


@pytest.mark.parametrize("backend", ["tensorrt", "openvino", "snpe"])
def test_export_quantizes_no_integer_tensor(backend):
    """torch.export records dtypes: no quantizer reads an integer tensor (token positions, an ``arange``), and an
    add of an activation and an integer tensor is not an integer add (the quantizers torch.fx's capture gets, whose
    ``arange`` of a traced shape is no tensor to the placement rules)."""
    ids = torch.randint(0, 10, (2, 6), generator=torch.Generator().manual_seed(2))
    for model, inputs in ((PositionIds(), (ids,)), (IntegerOffsets(), (torch.randn(SHAPE),))):
        qmodel = prepare_by_platform(model.eval(), backend, {"capture": "export", "example_inputs": inputs})
        modules = dict(qmodel.named_modules())
        read = [n.args[0] for n in qmodel.graph.nodes if n.op == "call_module" and is_quantizer(modules[n.target])]
        assert read, "nothing quantized"
        assert all(value.meta["val"].is_floating_point() for value in read), [v.name for v in read]
        if isinstance(model, IntegerOffsets):
            traced = prepare_by_platform(model.eval(), backend, {"capture": "fx"})
            names = {name for name, module in traced.named_modules() if is_quantizer(module)}
            assert names == {name for name, module in modules.items() if is_quantizer(module)}


def _scaled_hex(line: str, factor: float) -> str:
    name, value = line.split(": ")
    scale = np.frombuffer(bytes.fromhex(value.strip()), dtype=">f4")[0] * factor
    return f"{name}: {np.array(scale, dtype='>f4').tobytes().hex()}"


def test_edited_parameter_files_fail_verification(tmp_path):
    """An input range x1.5 in clip_ranges, a scale x2 in the calibration cache: each file no longer holds what
    was simulated. Widening a range by such factors moves each value by at most about one of the simulation's
    steps (within the rounding tolerance), so the check is of the quantization the file holds itself."""
    import json
    from pathlib import Path

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3))
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(1))
    qmodel = calibrated(model, "tensorrt", (x,))
    result = convert_deploy(qmodel, "tensorrt", dummy_input=x, output_path=tmp_path)
    assert verify_deploy(qmodel, result, x).passed
    first, second = [name for name, entry in result.table.items() if entry.kind == "activation"]
    ranges_file, cache_file = Path(result.artifacts["clip_ranges"]), Path(result.artifacts["calib_cache"])
    ranges = json.loads(ranges_file.read_text())
    ranges["tensorrt"]["blob_range"][first] *= 1.5
    ranges["qparams"][first]["scale"] *= 1.5
    ranges_file.write_text(json.dumps(ranges))
    lines = cache_file.read_text().splitlines()
    lines = [lines[0], *(_scaled_hex(line, 2.0) if line.startswith(f"{second}:") else line for line in lines[1:])]
    cache_file.write_text("\n".join(lines) + "\n")
    report = verify_deploy(qmodel, result, x, artifacts=["clip_ranges", "calib_cache"], host=False)
    failures = report.failures()
    assert {line.split(":")[0] for line in failures} == {"clip_ranges", "calib_cache"}, failures
    assert f"quantization of {first!r}" in failures[0] and f"quantization of {second!r}" in failures[1]


def test_an_op_onnx_cannot_write_is_a_clear_error_naming_it(tmp_path):
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d((4, 5)))
    x = torch.randn(1, 3, 9, 11)
    qmodel = calibrated(model, "tensorrt", (x,))
    with pytest.raises(NotImplementedError, match=r"adaptive_avg_pool2d.*Change that op"):
        convert_deploy(qmodel, "tensorrt", dummy_input=x, output_path=tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_zero_calibration_data_is_named_at_deploy(tmp_path):
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3)).eval()
    qmodel = prepare_by_platform(model, "vitis")
    enable_calibration(qmodel)
    qmodel(torch.zeros(SHAPE))
    enable_quantization(qmodel)
    with pytest.warns(
        UserWarning, match=r"saw only zeros in calibration: input_1_post_act_fake_quantizer\. .*taken as \[0, 1\]"
    ):
        convert_deploy(qmodel, "vitis", {"x": SHAPE}, output_path=tmp_path)


@pytest.mark.parametrize("backend", ["vitis", "snpe", "pplcuda", "tengine_u8"])
def test_a_relu_no_calibration_input_opens_deploys_within_int32(backend, tmp_path):
    """A ReLU closed on every calibration input: its output quantizer saw only zeros. Its range, taken as [0, 1]
    (not a scale at a floor near zero), keeps the next layer's bias, quantized at input scale x weight scale, within
    int32, which integer hardware adds in its accumulator: the integer reference computes what the simulation
    computes."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3)).eval()
    with torch.no_grad():
        model[0].bias.fill_(-100.0)  # closed for any input of the calibration's size
        model[2].bias.copy_(torch.tensor([2.5, -3.0, 0.7, 1.9]))
    inputs = (torch.randn(SHAPE),)
    qmodel = calibrated(model, backend, inputs)
    with pytest.warns(UserWarning, match="saw only zeros"):
        result = convert_deploy(qmodel, backend, dummy_input=inputs, output_path=tmp_path)
    # the quantizer that saw only zeros covers [0, 1] (to within a step of its grid)
    unit = [e for e in result.table.values() if e.kind == "activation" and abs(e.float_range()[1] - 1) <= e.scale[0]]
    assert len(unit) == 1
    report = verify_deploy(qmodel, result, inputs, reference=True)
    assert report.passed, report.failures()
