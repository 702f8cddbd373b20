"""docs/adding_a_backend.md runs as written, and the backend it builds behaves as the guide says."""

import json
import math
import re
import tempfile
from pathlib import Path

import pytest
from torch import nn

from mqbench.backends import ParamsTable
from mqbench.convert_deploy import deploy_functions
from mqbench.fake_quantize import FakeQuantizeDict, QuantizeBase
from mqbench.observer import ObserverDict

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "adding_a_backend.md"


def guide_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.S)


@pytest.fixture
def isolated_registries():
    """Registrations made by the guide are removed after the test."""
    yield
    deploy_functions.unregister("toynpu", "toynpu_json")
    for backend in ("toynpu", "toynpu_declared"):
        ParamsTable.unregister(backend)
    FakeQuantizeDict.unregister("ToyNPUFakeQuantize")
    ObserverDict.unregister("ToyNPUObserver")


def run_guide(blocks: list[str], tmp_path: Path, monkeypatch) -> dict:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the guide's mkdtemp lands in tmp_path
    namespace: dict = {"__name__": "adding_a_backend"}
    for block in blocks:
        exec(compile(block, str(GUIDE), "exec"), namespace)
    return namespace


def is_power_of_two(value: float) -> bool:
    return value > 0 and math.log2(value) == round(math.log2(value))


def test_guide_runs_and_builds_the_toynpu_backend(tmp_path, monkeypatch, isolated_registries, capsys):
    blocks = guide_blocks()
    assert len(blocks) >= 4
    ns = run_guide(blocks, tmp_path, monkeypatch)
    fake_quantize, observer = ns["ToyNPUFakeQuantize"], ns["ToyNPUObserver"]

    # Registered under the names the spec uses.
    assert FakeQuantizeDict["ToyNPUFakeQuantize"] is fake_quantize
    assert ObserverDict["ToyNPUObserver"] is observer
    spec = ParamsTable["toynpu"]
    assert spec.name == "toynpu" and spec.deploy == ("toynpu_json",)
    assert spec.placement.inputs_of == {"conv", "linear"} and not spec.placement.outputs_of
    assert "toynpu_json" in deploy_functions["toynpu"]

    # Every quantizer of the prepared model is ToyNPU's, with ToyNPU's observer and a power-of-two scale.
    qmodel = ns["qmodel"]
    found = [(name, m) for name, m in qmodel.named_modules() if isinstance(m, QuantizeBase)]
    assert len(found) == 6  # three weights, three activations
    for name, quantizer in found:
        assert type(quantizer) is fake_quantize, name
        assert type(quantizer.activation_post_process) is observer, name
        assert (quantizer.quant_min, quantizer.quant_max) == (-128, 127), name
        assert quantizer.activation_post_process.calibrated, name
        assert is_power_of_two(float(quantizer.scale[0])), name
        assert float(quantizer.scale[0]) == 2.0 ** -int(quantizer.fix_position[0]), name

    # Activation quantizers sit only in front of conv and linear, and every conv and linear reads one.
    modules = dict(qmodel.named_modules())
    weighted = (nn.Conv2d, nn.Linear)
    activation_nodes = [
        n for n in qmodel.graph.nodes if n.op == "call_module" and isinstance(modules[n.target], QuantizeBase)
    ]
    assert len(activation_nodes) == 3
    for node in activation_nodes:
        assert node.target.endswith("_post_act_fake_quantizer")
        assert node.users and all(
            user.op == "call_module" and isinstance(modules[user.target], weighted) for user in node.users
        ), node.target
    for node in qmodel.graph.nodes:
        if node.op == "call_module" and isinstance(modules[node.target], weighted):
            source = node.args[0]
            assert source.op == "call_module" and isinstance(modules[source.target], fake_quantize), node.target
            assert isinstance(modules[node.target].weight_fake_quant, fake_quantize), node.target

    # The deployment: the three artifacts, and a JSON with every tensor of the table at -log2(scale).
    result = ns["result"]
    assert sorted(result.artifacts) == ["deploy_onnx", "onnx", "toynpu_json"]
    path = Path(result.artifacts["toynpu_json"])
    assert path.name == "toy_toynpu.json" and path.is_file() and path.parent.parent == tmp_path
    written = json.loads(path.read_text())["tensors"]
    assert len(result.table) == 6 and len(result.table.weights()) == 3
    assert set(written) == set(result.table)
    for tensor, entry in result.table.items():
        scale = float(entry.scale[0])
        assert is_power_of_two(scale) and entry.axis is None and entry.symmetric, tensor
        assert written[tensor]["fix_position"] == -round(math.log2(scale)), tensor
        assert written[tensor]["kind"] == entry.kind and written[tensor]["bit_width"] == 8, tensor

    # Verification: onnxruntime, the file read back and the integer reference agree with the simulation.
    report = ns["report"]
    assert set(report.artifacts) == {"onnx", "toynpu_json", "reference"}
    assert report.max_lsb_diff <= 1
    assert set(report.per_tensor) == set(result.table)
    assert set(report.artifacts["toynpu_json"].per_tensor) == set(result.table)
    assert "onnxruntime" in capsys.readouterr().out

    # Route B: the declared backend places the same quantizers, and deploys and verifies.
    declared = ns["declared"]
    rows = {line.split()[0]: line for line in ns["quantization_report"](declared).splitlines()[1:-1]}
    assert all("quantized" in rows[name] for name in ("_0", "_2", "_5")), rows
    assert all("float" in rows[name] for name in ("_1", "_3", "_4")), rows
    qmodel_b = ns["qmodel_b"]

    def placement(model):
        mods = dict(model.named_modules())
        return sorted(
            str(user.target)
            for node in model.graph.nodes
            if node.op == "call_module" and isinstance(mods[node.target], QuantizeBase)
            for user in node.users
        )

    # The same layers read quantized inputs (route A also fused each conv with its ReLU; route B declares no fusion).
    assert placement(qmodel_b) == placement(qmodel) == ["0", "2", "5"]
    assert ns["report_b"].max_lsb_diff <= 1
    assert len(ns["result_b"].table) == len(result.table)

    # The writer refuses what ToyNPU cannot hold.
    entry = result.table["x"].with_changes(scale=result.table["x"].scale * 3)
    with pytest.raises(ValueError, match="power-of-two"):
        ns["fix_position"]("x", entry)


def test_fake_quantizer_matches_its_export_and_passes_gradients(tmp_path, monkeypatch, isolated_registries):
    import torch

    from mqbench.functional import fake_quantize

    ns = run_guide(guide_blocks()[:1], tmp_path, monkeypatch)
    fq = ns["ToyNPUFakeQuantize"](quant_min=-128, quant_max=127, qscheme=torch.per_tensor_symmetric)
    fq(torch.tensor([-2.5, 0.3, 1.7]))  # max |x| 2.5 -> threshold 4 -> scale 4 / 128
    assert float(fq.scale[0]) == 2.0**-5 and int(fq.fix_position[0]) == 5
    fq.disable_observer()
    x = torch.linspace(-6, 6, 1001, requires_grad=True)
    y = fq(x)
    scale, zero_point = fq.export_qparams()
    assert torch.equal(y, fake_quantize(x, scale, zero_point, -128, 127))  # the simulation is the Q/DQ pair
    y.sum().backward()
    q = (x.detach() / scale).round()
    inside = (q >= -128) & (q <= 127)
    assert torch.equal(x.grad, inside.float())


def test_guide_registrations_can_run_twice(tmp_path, monkeypatch, isolated_registries):
    first = run_guide(guide_blocks()[:2], tmp_path, monkeypatch)
    second = run_guide(guide_blocks()[:2], tmp_path, monkeypatch)
    assert first["ToyNPUFakeQuantize"] is not second["ToyNPUFakeQuantize"]
    assert FakeQuantizeDict["ToyNPUFakeQuantize"] is second["ToyNPUFakeQuantize"]
    assert ObserverDict["ToyNPUObserver"] is second["ToyNPUObserver"]
    assert ParamsTable["toynpu"] == second["spec"]


def test_guide_leaves_no_registration_behind():
    assert "toynpu" not in ParamsTable
    assert "ToyNPUFakeQuantize" not in FakeQuantizeDict and "ToyNPUObserver" not in ObserverDict
    assert "toynpu_json" not in deploy_functions["toynpu"]
