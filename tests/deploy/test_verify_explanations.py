"""What verify accepts in a file a runtime computes without showing its intermediate tensors.

Exposing a tensor changes what a runtime fuses, so the outputs of a file as written are compared with the
simulation fed the quantized tensors of a copy that exposes them. Two differences are explained, and
nothing else: a value at a rounding tie that the file rounds the other way (``explain_ties``), and
OpenVINO's CPU plugin leaving out the rounding of a FakeQuantize before an Add it fuses into the layer in
front, measured tensor by tensor as verify measures every tensor.
"""

from __future__ import annotations

import numpy as np
import onnx
import torch
from torch import nn

from backend_configs import host_config
from fuzz.grammar import generate
from fuzz.harness import calibrate
from mqbench.convert_deploy import convert_deploy
from mqbench.deploy.comparison import (
    FLOAT_RTOL,
    HostReport,
    VerifyRun,
    compare,
    explain_ties,
    simulate,
    simulation_copy,
)
from mqbench.deploy.verify import verify_deploy
from mqbench.prepare_by_platform import prepare_by_platform
from mqbench.utils.state import enable_calibration, enable_quantization


def _linear_on_openvino(tmp_path):
    torch.manual_seed(0)
    qmodel = prepare_by_platform(nn.Sequential(nn.Linear(4, 3)).eval(), "openvino")
    enable_calibration(qmodel)
    qmodel(torch.randn(16, 4))
    enable_quantization(qmodel)
    return qmodel, convert_deploy(qmodel, "openvino", {"x": [2, 4]}, output_path=tmp_path)


def test_only_a_rounding_tie_decided_the_other_way_is_explained(tmp_path):
    qmodel, result = _linear_on_openvino(tmp_path)
    (tensor,) = [t for t, e in result.table.items() if e.kind == "activation"]
    entry = result.table[tensor]
    scale = float(entry.scale[0])
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
    x[0, 1] = 3.5 * scale  # a tie: the simulation rounds it to 4 steps (half to even)
    x[0, 2] = 2.2 * scale  # far from one: 2 steps, whichever runtime
    run = VerifyRun(simulation_copy(qmodel), [x], simulate(simulation_copy(qmodel), [x]), True, 1, True, False)
    quantized = run.free.quantized[entry.quantizer, 0]
    assert quantized[0, 1] == np.float32(4 * scale) and quantized[0, 2] == np.float32(2 * scale)
    layer = qmodel.get_submodule("0")
    weight = layer.weight_fake_quant(layer.weight).detach().numpy()  # the deployed (quantized) weight
    output = result.output_names[0]

    def judged(column: int, steps: int) -> HostReport:
        served = run.free.outputs[0].copy()  # a runtime's output: that input one step off, through the Linear
        served[0] += steps * scale * weight[:, column]
        values = {"x_q": quantized, output: served}
        report = compare(HostReport("openvino_onnx", "runtime"), values, result.table, {tensor: "x_q"}, run, [output])
        assert report.local_outputs[output].float_mismatch()  # 1 step at the input moves the output beyond 0.1%
        return explain_ties(report, values, result.table, {tensor: "x_q"}, run, [output])

    assert not judged(1, -1).diverging(1)  # the tie rounded down: explained
    assert judged(1, +1).diverging(1)  # 5 steps is no rounding of 3.5
    assert judged(2, +1).diverging(1)  # 2.2 rounds to 2 on any runtime


def test_a_rounding_tie_on_a_per_channel_grid_is_explained_like_one_on_a_per_tensor_grid(tmp_path):
    """A depthwise convolution's input on OpenVINO's placement has a scale per channel. A value of it at a rounding
    tie may round the other way in a runtime (onnxruntime on an AVX-512 VNNI host: 2 steps at the output of
    ImageNet MobileNetV2's eighth depthwise layer), and that is explained as on a per-tensor grid; a move of a value
    far from its tie is not, nor a move away from the tie's other rounding."""
    torch.manual_seed(0)
    qmodel = prepare_by_platform(nn.Sequential(nn.Conv2d(2, 2, 3, padding=1, groups=2)).eval(), "openvino")
    enable_calibration(qmodel)
    qmodel(torch.randn(8, 2, 5, 5) * torch.tensor([1.0, 3.0]).view(1, 2, 1, 1))
    enable_quantization(qmodel)
    result = convert_deploy(qmodel, "openvino", {"x": [1, 2, 5, 5]}, output_path=tmp_path)
    (tensor,) = [t for t, e in result.table.items() if e.kind == "activation"]
    entry = result.table[tensor]
    scales = np.asarray(entry.scale, np.float64)
    assert entry.axis == 1 and scales.shape == (2,) and scales[1] > 2 * scales[0]
    x = torch.full((1, 2, 5, 5), 0.2) * torch.tensor(scales, dtype=torch.float32).view(1, 2, 1, 1)
    x[0, 1, 2, 2] = float(3.5 * scales[1])  # a tie on channel 1's grid: the simulation rounds it to 4 steps
    x[0, 0, 1, 1] = float(2.2 * scales[0])  # far from one: 2 steps of channel 0's grid, whichever runtime
    run = VerifyRun(simulation_copy(qmodel), [x], simulate(simulation_copy(qmodel), [x]), True, 1, True, False)
    key = (entry.quantizer, 0)
    quantized = run.free.quantized[key]
    assert quantized[0, 1, 2, 2] == np.float32(4 * scales[1]) and quantized[0, 0, 1, 1] == np.float32(2 * scales[0])
    output = result.output_names[0]

    def judged(where: tuple[int, ...], steps: int) -> HostReport:
        moved = quantized.copy()  # the runtime's input: one element ``steps`` of its channel's steps off
        moved[where] += np.float32(steps * scales[where[1]])
        served = simulate(run.model, run.inputs, {key: moved}).outputs[0]
        values = {"x_q": quantized, output: served}
        report = compare(HostReport("onnx", "runtime"), values, result.table, {tensor: "x_q"}, run, [output])
        assert report.local_outputs[output].float_mismatch()  # one step of the input moves the output beyond 0.1%
        return explain_ties(report, values, result.table, {tensor: "x_q"}, run, [output])

    assert not judged((0, 1, 2, 2), -1).diverging(1)  # the tie rounded down: explained
    assert judged((0, 1, 2, 2), +1).diverging(1)  # 5 steps is no rounding of 3.5
    assert judged((0, 0, 1, 1), +1).diverging(1)  # 2.2 rounds to 2 on any runtime


def test_openvino_leaving_out_a_rounding_before_a_fused_add_is_measured_tensor_by_tensor(tmp_path):
    """``x0 + conv(x1)``, both quantized, then a Linear: OpenVINO's CPU plugin fuses the Add into the convolution
    and clamps the convolution's output without rounding it (measured on OpenVINO 2026.4); each quantized tensor
    stays within one step of the simulation, and verify passes."""
    graph = generate(108, "image")
    qmodel = calibrate(graph, prepare_by_platform(graph.build(), "openvino", host_config("openvino")))
    result = convert_deploy(qmodel, "openvino", dummy_input=graph.batch(0), output_path=tmp_path)
    report = verify_deploy(qmodel, result, graph.verify_inputs(1.0))
    assert report.passed, report.failures()
    host = report.artifacts["openvino_onnx"].host
    measured = {name: d for name, d in host.per_tensor.items() if name.endswith("(as written)")}
    assert all(d.max_lsb_diff is not None and d.max_lsb_diff <= 1 for d in measured.values()), measured


def test_a_tie_in_an_activation_no_copy_shows_is_explained(tmp_path):
    """Embeddings added to an input and returned (``x0 + emb(ids) + pos``), as onnxruntime serves the Q/DQ file:
    showing the sum's integers changes what it fuses, so that sum is the simulation's own, and where the file
    rounds one of its near ties the other way, the returned float output moves by one step of it (measured on
    onnxruntime 1.32 on an AVX-512 VNNI host: 0.036 at one of 288 elements). Such a flip, in a tensor no copy
    shows, is explained as a flip in a shown one is; the artifact computes the prepared model (the fuzz check)."""
    from fuzz.harness import MAX_RELATIVE, check_artifacts

    graph = generate(2005, "sequence")
    qmodel = calibrate(graph, prepare_by_platform(graph.build(), "openvino", host_config("openvino")))
    result = convert_deploy(qmodel, "openvino", dummy_input=graph.batch(0), output_path=tmp_path)
    report = verify_deploy(qmodel, result, graph.verify_inputs(1.0))
    assert report.passed, report.failures()
    for diff in report.artifacts["onnx"].host.local_outputs.values():
        if diff.max_abs_diff > FLOAT_RTOL * diff.magnitude:  # where this host's kernels part: a tie flip, measured
            assert diff.unexplained is not None and not diff.float_mismatch(), diff
    assert check_artifacts(qmodel, result, graph.verify_inputs(1.0)) <= MAX_RELATIVE


class _ThreeStages(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1), nn.Conv2d(4, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def test_the_qdq_host_verdict_reads_the_integers_of_the_file_as_served(tmp_path, monkeypatch):
    """The Q/DQ host verdict reads the integers each QuantizeLinear writes, from a copy whose outputs equal the
    file's bit for bit. A tensor whose showing changes the outputs (it stops a fusion) is left out, found by
    halving; the others are still read, and the verdict holds."""
    from mqbench.deploy import qdq

    torch.manual_seed(0)
    qmodel = prepare_by_platform(_ThreeStages().eval(), "openvino", host_config("openvino"))
    enable_calibration(qmodel)
    with torch.no_grad():
        qmodel(torch.randn(4, 3, 8, 8))
    enable_quantization(qmodel)
    result = convert_deploy(qmodel, "openvino", {"x": [1, 3, 8, 8]}, output_path=tmp_path)
    x = torch.randn(1, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    path, feeds = result.artifacts["onnx"], {"x": x.numpy()}
    sources = qdq._integer_sources(onnx.load(path), result)
    assert len(sources) == len([e for e in result.table.values() if e.kind != "weight"]) >= 3
    perturbing = sorted(sources)[1]
    integer = sources[perturbing].input[0]
    real_run_ort, seen = qdq.run_ort, []

    def fused_differently(model, feeds, names, optimize, typed=True):  # showing `integer` moves the outputs
        values = real_run_ort(model, feeds, names, optimize, typed)
        seen.append(list(names))
        if integer in names:
            for name in result.output_names:
                values[name] = values[name] + 1.0
        return values

    monkeypatch.setattr(qdq, "run_ort", fused_differently)
    served = qdq.run_as_loaded(path, feeds, optimize=True)
    observed = qdq._observe(onnx.load(path), feeds, result, served)
    assert observed is not None and set(observed) == set(sources) - {perturbing}
    assert len(seen) <= qdq.OBSERVE_SESSIONS
    report = verify_deploy(qmodel, result, x)
    assert report.passed, report.failures()
    host = report.artifacts["onnx"].host
    shown = {t for t, name in result.dequantized.items() if name in observed}
    assert shown and shown <= set(host.per_tensor)


class _ScaledThenLinear(nn.Module):
    """``relu(x / 16)`` then a Linear: on OpenVINO's placement the network input and the Linear's input are
    quantized, the latter on a grid sixteen times finer."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(x * 0.0625))


def test_a_tie_in_a_hidden_input_moves_the_next_tensor_by_its_scale_ratio_and_nothing_else(tmp_path):
    """onnxruntime serves ``DequantizeLinear -> Add -> ReLU -> QuantizeLinear`` as one QLinearAdd; the fused layer
    in front writes the Add's input, and showing that input changes what is fused, so the simulation computes it
    itself. Where that input was at a rounding tie and the file rounded it the other way, the next tensor moves by
    the input's step carried through, which is more than one step of its own grid where that is the finer (ResNet's
    residual Adds: 2 steps on a VNNI host). That difference is explained; the same difference where the input is
    far from a tie is not, and neither is a larger one at the tie."""
    torch.manual_seed(0)
    qmodel = prepare_by_platform(_ScaledThenLinear().eval(), "openvino")
    enable_calibration(qmodel)
    with torch.no_grad():
        qmodel(torch.linspace(-8, 8, 16).view(4, 4))
    enable_quantization(qmodel)
    result = convert_deploy(qmodel, "openvino", {"x": [2, 4]}, output_path=tmp_path)
    entries = {t: e for t, e in result.table.items() if e.kind == "activation"}
    assert len(entries) == 2
    step = {t: float(np.asarray(e.scale).reshape(-1)[0]) for t, e in entries.items()}
    hidden, scaled = max(step, key=step.get), min(step, key=step.get)  # x's quantizer, the Linear's input's
    carried = step[hidden] * 0.0625 / step[scaled]  # one step of x, in steps of the Linear's input
    assert carried > 1.5

    x = torch.full((2, 4), 20.2) * step[hidden]
    x[0, 1] = 20.5 * step[hidden]  # a tie: the simulation rounds it to 20 steps (half to even)
    run = VerifyRun(simulation_copy(qmodel), [x], simulate(simulation_copy(qmodel), [x]), True, 1, True, False)
    key = entries[scaled].quantizer, int(entries[scaled].extra.get("call", 0))
    output = result.output_names[0]

    def judged(column: int, steps: int) -> HostReport:
        """The runtime's Linear input (by the grid's formula) where it held x ``steps`` of x's steps off at
        ``column`` (x[0, 1] at 21 steps: its tie rounded up)."""
        held = np.full((2, 4), 20.0)
        held[0, column] += steps
        level = np.round(np.maximum(held * step[hidden] * 0.0625, 0) / step[scaled])
        value = (np.clip(level, 0, entries[scaled].quant_max) * step[scaled]).astype(np.float32)
        served = {"s_q": value, output: simulate(run.model, run.inputs, {key: value}).outputs[0]}
        report = compare(HostReport("onnx", "runtime"), served, result.table, {scaled: "s_q"}, run, [output])
        return explain_ties(report, served, result.table, {scaled: "s_q"}, run, [output])

    tie = judged(1, 1)  # the tie rounded up: the Linear's input moves by `carried` of its steps
    assert tie.per_tensor[scaled].max_lsb_diff >= carried - 1 and tie.per_tensor[scaled].max_lsb_diff > 1
    assert not tie.diverging(1), (tie.diverging(1), tie.per_tensor[scaled])
    assert judged(2, 1).diverging(1) == [scaled]  # 20.2 rounds to 20 on any runtime: the same move is no tie's
    far = judged(1, 2)
    assert far.diverging(1) == [scaled], (carried, far.per_tensor[scaled])  # two steps above: no rounding of 20.5
