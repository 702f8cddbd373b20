"""The fuzzer's own properties, then a fixed set of generated graphs through every registered backend."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from torch import nn

from fuzz.builder import BATCH, FuzzGraph, InputSpec
from fuzz.grammar import FAMILIES, all_tags, generate
from fuzz.harness import ArtifactMismatchError, CaseResult, check_artifacts, classify_error, run_case
from mqbench.backends import ParamsTable
from mqbench.convert_deploy import DeployResult, convert_deploy
from mqbench.prepare_by_platform import prepare_by_platform
from mqbench.utils.state import enable_calibration, enable_quantization

# -- the grammar ------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 6, 7])
def test_same_seed_same_graph_same_weights_same_data(seed):
    first, second = generate(seed), generate(seed)
    assert first == second
    for a, b in zip(first.build().state_dict().values(), second.build().state_dict().values(), strict=True):
        assert torch.equal(a, b)
    for index in (0, 1, -1):
        for a, b in zip(first.batch(index), second.batch(index), strict=True):
            assert torch.equal(a, b)
    assert not torch.equal(first.batch(0)[0], first.verify_inputs()[0])  # verification data is its own batch
    assert generate(seed).source != generate(seed + 2).source


def test_generation_leaves_the_global_random_state_alone():
    state = torch.get_rng_state()
    generate(4).build()
    assert torch.equal(state, torch.get_rng_state())


def test_describe_is_the_code_that_runs():
    graph = generate(12)
    namespace: dict[str, object] = {}
    with torch.random.fork_rng():
        exec(graph.describe(), namespace)  # the printed script builds the model itself
    printed = namespace["model"]
    with torch.no_grad():
        expected = graph.build()(*graph.verify_inputs())
        got = printed(*graph.verify_inputs())  # type: ignore[operator]
    expected = expected if isinstance(expected, tuple) else (expected,)
    got = got if isinstance(got, tuple) else (got,)
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a, b)


# The first seeds of each family that together use every tag of its grammar (measured: image 0..62,
# sequence 0..26); a new op must be reachable within these or the bound below moves with it.
REACHABLE_WITHIN = {"image": 63, "sequence": 27}


@pytest.mark.parametrize("family", FAMILIES)
def test_every_op_of_the_grammar_is_reachable(family):
    seen: set[str] = set()
    for seed in range(REACHABLE_WITHIN[family]):
        seen |= generate(seed, family).tags
    assert seen == all_tags(family)


def test_generated_graphs_trace_with_fx():
    for seed in range(8):
        graph = generate(seed)
        traced = torch.fx.symbolic_trace(graph.build())
        inputs = graph.verify_inputs()
        with torch.no_grad():
            expected, got = graph.build()(*inputs), traced(*inputs)
        expected = expected if isinstance(expected, tuple) else (expected,)
        got = got if isinstance(got, tuple) else (got,)
        assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True)), seed


# -- the harness -------------------------------------------------------------------------------------
SHARED_OUTPUT = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 4, 3, padding=1)
        self.c2 = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x0):
        v = torch.relu(self.c1(x0))
        return self.c2(v), v
"""
PLAIN = SHARED_OUTPUT.replace("return self.c2(v), v", "return self.c2(v)")
IMAGE_INPUT = (InputSpec("x0", (BATCH, 3, 8, 8)),)


def _deployed(source: str, backend: str, folder: Path) -> tuple[nn.Module, DeployResult, tuple[torch.Tensor, ...]]:
    graph = FuzzGraph(1000, "image", source, IMAGE_INPUT)
    qmodel = prepare_by_platform(graph.build(), backend)
    enable_calibration(qmodel)
    with torch.no_grad():
        for batch in graph.calibration_batches():
            qmodel(*batch)
    enable_quantization(qmodel)
    result = convert_deploy(qmodel, backend, dummy_input=graph.batch(0), output_path=folder)
    return qmodel, result, graph.verify_inputs(3.0)


def _clip_outputs_to_their_readers_quantizer(result: DeployResult, folder: Path) -> DeployResult:
    """The deployment as it was wrong: every network output that a quantized layer also reads is returned
    through that layer's input quantizer (its Q/DQ pair) instead of as computed."""
    model = onnx.load(result.artifacts["onnx"])
    clipped = 0
    for output in model.graph.output:
        if output.name in result.dequantized:
            output.name = result.dequantized[output.name]
            clipped += 1
    assert clipped, "the graph has no output that a quantized layer reads"
    path = folder / "clipped.onnx"
    onnx.save(model, path)
    return replace(result, artifacts={**result.artifacts, "onnx": str(path)})


def test_silent_detector_flags_an_output_clipped_to_the_next_layers_range(tmp_path):
    """``v = relu(conv1(x)); return conv2(v), v``: an artifact that returns ``v`` through conv2's input
    quantizer clips it to the calibration range, so on inputs three times that range it is wrong."""
    qmodel, result, inputs = _deployed(SHARED_OUTPUT, "tensorrt", tmp_path)
    with pytest.raises(ArtifactMismatchError, match=r"^onnx output 1: off by up to \d+\.\d% of its range"):
        check_artifacts(qmodel, _clip_outputs_to_their_readers_quantizer(result, tmp_path), inputs)


def test_shared_output_case_deploys_right():
    """The same graph through the whole harness: verify passes and the artifacts agree with the simulation."""
    case = run_case(FuzzGraph(1000, "image", SHARED_OUTPUT, IMAGE_INPUT), "tensorrt", verify_scale=3.0)
    assert case.status == "ok", case


@pytest.mark.parametrize("scale", [1.0, 3.0])
def test_silent_detector_passes_a_clean_conv_relu_conv(scale):
    case = run_case(FuzzGraph(1000, "image", PLAIN, IMAGE_INPUT), "tensorrt", verify_scale=scale)
    assert case.status == "ok", case


def test_errors_are_clear_only_when_mqbench_raises_a_value_or_type_error():
    with pytest.raises(ValueError) as ours:
        convert_deploy(nn.Linear(2, 2), "qdq")  # the float model: mqbench says what to do
    assert classify_error(ours.value)[0] == "clear_error"
    assert "mqbench" in classify_error(ours.value)[1]
    empty: dict[str, int] = {}
    with pytest.raises(KeyError) as lookup:
        empty["missing"]
    assert classify_error(lookup.value)[0] == "crash"
    with pytest.raises(ValueError) as foreign:
        np.zeros(3).reshape(2, 2)
    assert classify_error(foreign.value)[0] == "crash"  # raised outside mqbench


def test_a_model_that_fails_in_torch_is_a_crash_at_its_stage():
    source = PLAIN.replace("return self.c2(v)", "return self.c2(v).view(3, -1, 7)")  # 2*4*8*8 is no multiple of 21
    case = run_case(FuzzGraph(1000, "image", source, IMAGE_INPUT), "qdq")
    assert (case.status, case.stage, case.error_type) == ("crash", "calibrate", "RuntimeError"), case
    assert "torch" in case.location


# -- the suite: fixed seeds through every backend ------------------------------------------------------
SEEDS = range(6)  # image graphs for even seeds, sequence graphs for odd ones
BACKENDS = list(ParamsTable)
# Clear errors the suite accepts: the start of mqbench's message -> why such a graph cannot deploy, as documented.
ALLOWED_CLEAR_ERRORS = {
    "the prepared model quantizes nothing": "convert_deploy raises ValueError for a model without fake quantizers "
    "(its docstring): the backend's placement quantizes no op of the graph",
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", SEEDS)
def test_fuzz_graph_deploys_and_verifies(seed, backend, tmp_path):
    graph = generate(seed)
    case: CaseResult = run_case(graph, backend, folder=str(tmp_path))
    if case.status == "clear_error" and case.message.startswith(tuple(ALLOWED_CLEAR_ERRORS)):
        return
    assert case.status == "ok", f"{case}\n{case.location}\n{graph.describe()}"
