"""MQBench's names keep MQBench's meaning: each checked against a formula, a brute force or the float model."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from torch import nn

from mqbench.backends import ParamsTable
from mqbench.convert_deploy import convert_deploy, convert_merge_bn, convert_onnx
from mqbench.custom_quantizer import OPENVINOQuantizer
from mqbench.deploy import remove_fakequantize_and_collect_params
from mqbench.prepare_by_platform import BackendType, get_qconfig_by_platform, prepare_by_platform
from mqbench.scheme import QuantizeScheme
from mqbench.utils.registry import DEFAULT_MODEL_QUANTIZER, register_model_quantizer
from mqbench.utils.state import disable_all, enable_calibration, enable_quantization


def calibrated(model: nn.Module, backend, data: torch.Tensor, config=None) -> torch.fx.GraphModule:
    qmodel = prepare_by_platform(model, backend, config)
    enable_calibration(qmodel)
    with torch.no_grad():
        qmodel(data)
    enable_quantization(qmodel)
    return qmodel


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.bn = nn.BatchNorm2d(6)
        self.relu = nn.ReLU()
        self.fc = nn.Linear(6, 3)

    def forward(self, x):
        return self.fc(self.relu(self.bn(self.conv(x))).mean(dim=(2, 3)))


@pytest.mark.parametrize(("bit", "symmetry", "symmetric_range"), [(8, True, False), (8, True, True), (4, False, False)])
def test_quantize_scheme_gives_mqbenchs_observer_parameters(bit, symmetry, symmetric_range):
    params = QuantizeScheme(symmetry=symmetry, per_channel=True, bit=bit, symmetric_range=symmetric_range)
    params = params.to_observer_params()
    low = (-(2 ** (bit - 1)) + symmetric_range) if symmetry else 0
    high = 2 ** (bit - 1) - 1 if symmetry else 2**bit - 1
    assert (params["quant_min"], params["quant_max"], params["ch_axis"]) == (low, high, 0)
    assert params["qscheme"] == (torch.per_channel_symmetric if symmetry else torch.per_channel_affine)


def test_get_qconfig_by_platform_builds_the_backends_quantizers_with_the_overrides():
    qconfig = get_qconfig_by_platform(BackendType.Tensorrt, {"w_qscheme": {"bit": 4}, "a_observer": "MSEObserver"})
    weight, activation = qconfig.weight(), qconfig.activation()
    assert (weight.quant_min, weight.quant_max, weight.ch_axis) == (-7, 7, 0)  # TensorRT: symmetric range
    assert (activation.quant_min, activation.quant_max) == (-128, 127)  # explicit quantization's int8 grid
    assert type(activation.activation_post_process).__name__ == "MSEObserver"


def test_deepcopy_graphmodule_copies_the_graph_too():
    from mqbench.utils.utils import deepcopy_graphmodule

    qmodel = prepare_by_platform(ConvNet().eval(), "tensorrt")
    copied = deepcopy_graphmodule(qmodel)
    assert copied.graph is not qmodel.graph and all(
        a is not b for a, b in zip(copied.graph.nodes, qmodel.graph.nodes, strict=True)
    )
    assert all(p.data_ptr() != q.data_ptr() for p, q in zip(copied.parameters(), qmodel.parameters(), strict=True))
    output = next(n for n in copied.graph.nodes if n.op == "output")
    copied.graph.erase_node(output)  # editing the copy's graph leaves the original's whole
    assert any(n.op == "output" for n in qmodel.graph.nodes)


def test_dfq_weight_equalization_keeps_the_function_and_equalizes_the_ranges():
    from mqbench.weight_equalization import dfq_weight_equalization

    torch.manual_seed(0)
    first, second = nn.Linear(5, 4), nn.Linear(4, 3)
    with torch.no_grad():
        first.weight.mul_(torch.tensor([[10.0], [0.1], [1.0], [3.0]]))
    x = torch.randn(16, 5)
    before = second(torch.relu(first(x)))
    with torch.no_grad():
        _, _, _, scale = dfq_weight_equalization(first.weight, first.bias, second.weight)
    torch.testing.assert_close(second(torch.relu(first(x))), before, rtol=1e-5, atol=1e-5)  # ReLU(x / s) = ReLU(x) / s
    r1 = first.weight.detach().abs().amax(1)
    r2 = second.weight.detach().abs().amax(0)
    torch.testing.assert_close(r1, r2, rtol=1e-5, atol=0)
    assert bool((scale > 0).all())


def test_save_inp_oup_data_returns_the_modules_inputs_and_outputs():
    from mqbench.advanced_ptq import save_inp_oup_data

    torch.manual_seed(0)
    model = ConvNet().eval()
    data = [torch.randn(2, 3, 6, 6) for _ in range(3)]
    inputs, outputs = save_inp_oup_data(model, model.fc, model.fc, data)
    for batch, inp, out in zip(data, inputs, outputs, strict=True):
        features = model.relu(model.bn(model.conv(batch))).mean(dim=(2, 3))
        torch.testing.assert_close(inp, features)
        torch.testing.assert_close(out, model.fc(features))


def test_subgraph_reconstruction_lowers_the_error_of_rounding_to_nearest():
    from mqbench.advanced_ptq import lp_loss, subgraph_reconstruction

    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(16, 8))
    # correlated inputs (with white ones rounding to nearest is already the least-squares optimum)
    x = torch.randn(256, 3) @ torch.randn(3, 16) + 0.05 * torch.randn(256, 16)
    w4 = {"w_qscheme": {"bit": 4}, "w_fakequantize": "AdaRoundFakeQuantize"}
    qmodel = calibrated(layer.eval(), "tensorrt", x, {"extra_qconfig_dict": w4})
    disable_all(qmodel)
    qmodel.get_submodule("0").weight_fake_quant.enable_fake_quant()  # weights only, as the targets are float
    with torch.no_grad():
        target = layer(x)
        nearest = float(lp_loss(qmodel(x), target))
    batches = list(x.split(32))
    subgraph_reconstruction(
        qmodel, batches, [layer(b).detach() for b in batches], {"max_count": 500, "warm_up": 0.2, "weight": 0.01}
    )
    with torch.no_grad():
        learned = float(lp_loss(qmodel(x), target))
        weight = qmodel.get_submodule("0").weight
        quantizer = qmodel.get_submodule("0").weight_fake_quant
        on_grid = weight / quantizer.scale.reshape(-1, 1)
    torch.testing.assert_close(on_grid, torch.round(on_grid), rtol=0, atol=1e-4)  # the weights are hard-rounded
    assert learned < 0.9 * nearest, (learned, nearest)


def test_mixprecision_bit_selection_is_the_brute_force_optimum():
    from mqbench.mix_precision.mix_precision import mixprecision_bit_selection

    torch.manual_seed(0)
    layers = {f"layer{i}": int(n) for i, n in enumerate(torch.randint(100_000, 900_000, (5,)))}
    bits = [2, 4, 8]
    cost = {name: {b: float(torch.rand(1)) * (9 - b) for b in bits} for name in layers}
    budget = sum(layers.values()) * 4.5 / 8 / 2**20  # MB: about 4.5 bits on average
    chosen = mixprecision_bit_selection(bits, cost, layers, model_size_constraints=budget)
    best = min(
        (
            sum(cost[name][b] for name, b in zip(layers, choice, strict=True)),
            dict(zip(layers, choice, strict=True)),
        )
        for choice in itertools.product(bits, repeat=len(layers))
        if sum(layers[name] * b for name, b in zip(layers, choice, strict=True)) / 8 / 2**20 <= budget
    )
    assert sum(cost[name][b] for name, b in chosen.items()) == pytest.approx(best[0])


def test_frozen_batchnorm_fuses_and_keeps_its_statistics_while_training():
    from mqbench.fuser_method_mappings import fuse_custom_config_dict
    from mqbench.nn.modules import FrozenBatchNorm2d

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), FrozenBatchNorm2d(4), nn.ReLU())
    with torch.no_grad():
        model[1].running_mean.uniform_(-1, 1)
        model[1].running_var.uniform_(0.5, 2)
    qmodel = prepare_by_platform(model.train(), "tensorrt", {"extra_fuse_dict": fuse_custom_config_dict})
    fused = qmodel.get_submodule("0")
    assert type(fused).__name__ == "ConvFreezebnReLU2d"
    mean = fused.bn.running_mean.clone()
    disable_all(qmodel)
    x = torch.randn(8, 3, 6, 6) * 3
    torch.testing.assert_close(qmodel(x), model(x), rtol=1e-5, atol=1e-5)  # training mode, frozen statistics
    optimizer = torch.optim.SGD(qmodel.parameters(), lr=0.1)
    qmodel(x).sum().backward()
    optimizer.step()
    assert torch.equal(fused.bn.running_mean, mean)


def test_mqbenchs_step_by_step_deploy_writes_what_convert_deploy_writes(tmp_path):
    torch.manual_seed(0)
    data = torch.randn(16, 3, 6, 6)
    qmodel = calibrated(ConvNet().train(), "tensorrt", data).eval()
    shapes = {"x": [1, 3, 6, 6]}
    whole = convert_deploy(qmodel, "tensorrt", shapes, output_path=tmp_path / "whole", model_name="m")
    (tmp_path / "steps").mkdir()
    convert_merge_bn(qmodel)
    convert_onnx(qmodel, shapes, None, onnx_model_path=str(tmp_path / "steps" / "m.onnx"))
    written = remove_fakequantize_and_collect_params(str(tmp_path / "steps" / "m.onnx"), "m", "tensorrt")
    assert sorted(p.split("/")[-1] for p in written) == [
        "m_calib_cache.txt",
        "m_clip_ranges.json",
        "m_deploy_model.onnx",
    ]
    stepwise = json.loads((tmp_path / "steps" / "m_clip_ranges.json").read_text())
    assert stepwise == json.loads((tmp_path / "whole" / "m_clip_ranges.json").read_text())
    with pytest.raises(ValueError, match="convert_onnx"):
        remove_fakequantize_and_collect_params(str(tmp_path / "whole" / "m.onnx"), "m", "tensorrt")
    assert whole.artifacts["clip_ranges"].endswith("m_clip_ranges.json")


def test_fusion_method_merges_one_node_in_place():
    from mqbench.fusion_method import FUSED_MODULE_CONVERT_FUNCTION

    torch.manual_seed(0)
    data = torch.randn(8, 3, 6, 6)
    qmodel = calibrated(ConvNet().train(), "tensorrt", data).eval()
    with torch.no_grad():
        before = qmodel(data)
    node = next(n for n in qmodel.graph.nodes if n.op == "call_module" and n.target == "conv")
    FUSED_MODULE_CONVERT_FUNCTION[type(qmodel.conv)](qmodel, node)
    assert type(qmodel.conv).__name__ == "ConvReLU2d"
    with torch.no_grad():
        torch.testing.assert_close(qmodel(data), before, rtol=1e-5, atol=1e-5)


def test_replace_bn_to_syncbn_keeps_the_statistics():
    from mqbench.utils.utils import replace_bn_to_syncbn

    model = ConvNet()
    with torch.no_grad():
        model.bn.running_mean.fill_(0.5)
    replace_bn_to_syncbn(model)
    assert isinstance(model.bn, nn.SyncBatchNorm) and bool((model.bn.running_mean == 0.5).all())


def test_a_per_backend_quantizer_carries_its_backends_rules_to_a_new_backend():
    ParamsTable["with_openvino_rules"] = dict(
        qtype="affine",
        w_qscheme=QuantizeScheme(symmetry=True, per_channel=True, bit=8),
        a_qscheme=QuantizeScheme(symmetry=False, bit=8),
    )
    try:

        @register_model_quantizer("with_openvino_rules")
        class Mine(OPENVINOQuantizer):
            pass

        assert DEFAULT_MODEL_QUANTIZER["with_openvino_rules"] is Mine
        qmodel = prepare_by_platform(ConvNet().eval(), "with_openvino_rules")
        openvino = prepare_by_platform(ConvNet().eval(), "openvino")
        names = lambda m: sorted(n for n, _ in m.named_modules() if n.endswith("_post_act_fake_quantizer"))  # noqa: E731
        assert names(qmodel) == names(openvino)
        assert qmodel.fc.weight_fake_quant.quant_min == -128  # the new backend's scheme, openvino's rules
    finally:
        ParamsTable.unregister("with_openvino_rules")
