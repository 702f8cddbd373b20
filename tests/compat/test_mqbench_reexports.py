"""MQBench's names that code written against MQBench imports, each doing what it does in MQBench: the helpers its
``mqbench.utils`` re-exports, its logger's name, its profiling summary and dummy-module step, its registry of pair
equalizers, and the type tables of its equalization walk."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch
from torch import fx, nn

import mqbench.utils
from mqbench.advanced_ptq import cross_layer_equalization
from mqbench.prepare_by_platform import prepare_by_platform
from mqbench.utils import utils as helpers
from mqbench.utils.registry import WEIGHT_EQUALIZATION_FUNCTION, register_weight_equalization_function


def test_mqbench_utils_names_its_helpers_and_imports_them_only_when_asked():
    from mqbench.utils import deepcopy_graphmodule, getitem2node, is_symmetric_quant, topology_order

    assert deepcopy_graphmodule is helpers.deepcopy_graphmodule and getitem2node is helpers.getitem2node
    assert is_symmetric_quant(torch.per_channel_symmetric) and not is_symmetric_quant(torch.per_tensor_affine)
    assert topology_order is helpers.topology_order
    assert mqbench.utils.USE_DDP is False  # no process group here
    namespace: dict[str, object] = {}
    exec("from mqbench.utils import *", namespace)
    assert set(mqbench.utils.__all__) <= set(namespace)
    code = "import sys, mqbench.utils.registry; print('mqbench.utils.utils' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        mqbench.utils.nothing_here  # noqa: B018


def test_mqbench_logger_name_names_the_packages_logger():
    from mqbench.utils.logger import MQBENCH_LOGGER_NAME, logger

    assert logging.getLogger(MQBENCH_LOGGER_NAME) is logger


def test_profile_summary_is_the_mean_cosine_and_the_worst_layer():
    from mqbench.utils.profiling import profile_summary

    rows = [
        {"op": "Conv2d", "name": "conv1", "nodes": ["conv1"], "cos": 0.99},
        {"op": "add", "name": "add", "nodes": ["add_dummy"], "cos": 0.95},
    ]
    assert (
        profile_summary(rows)
        == f"avg cos: {(0.99 + 0.95) / 2}\nworst layer: add(add) with nodes ['add_dummy'] cos 0.95"
    )
    with pytest.raises(ValueError, match="at least one"):
        profile_summary([])


class AddThenRelu(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + 1.0) * 2.0


def test_update_model_with_dummy_module_puts_an_identity_after_a_function_in_both_models():
    from mqbench.utils.profiling import update_model_with_dummy_module

    fp, quant = fx.symbolic_trace(AddThenRelu()), fx.symbolic_trace(AddThenRelu())
    x = torch.randn(3, 4)
    expected = fp(x)
    q_add = next(n for n in quant.graph.nodes if n.name == "add")
    f_add = next(n for n in fp.graph.nodes if n.name == "add")
    q_map: dict[fx.Node, nn.Module] = {}
    f_map: dict[fx.Node, nn.Module] = {}
    q_dummy, f_dummy, fp2, quant2, q_map2, f_map2 = update_model_with_dummy_module(
        fp, quant, q_add, f_add, list(quant.graph.nodes), list(fp.graph.nodes), q_map, f_map
    )
    assert fp2 is fp and quant2 is quant and q_map2 is q_map and f_map2 is f_map
    assert isinstance(q_map[q_dummy], nn.Identity) and isinstance(f_map[f_dummy], nn.Identity)
    seen = []
    quant.get_submodule(str(q_dummy.target)).register_forward_hook(lambda m, args, out: seen.append(out))
    torch.testing.assert_close(quant(x), expected, rtol=0, atol=0)
    torch.testing.assert_close(fp(x), expected, rtol=0, atol=0)
    torch.testing.assert_close(seen[0], x + 1.0, rtol=0, atol=0)  # the hook sees the add's output
    relu = next(n for n in quant.graph.nodes if n.target is torch.relu)
    assert relu.args[0] is q_dummy
    with pytest.raises(ValueError, match="GraphModule"):
        update_model_with_dummy_module(AddThenRelu(), quant, q_add, f_add, [], [], {}, {})


def test_a_registered_pair_equalizer_equalizes_its_layer_types():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3)).eval()
    qmodel = prepare_by_platform(model, "tensorrt")
    calls = []

    def equalizer(modules, pair):
        calls.append([str(node.target) for node in pair])
        assert isinstance(modules[str(pair[0].target)], nn.Linear)

    saved = dict(WEIGHT_EQUALIZATION_FUNCTION)
    try:
        register_weight_equalization_function(nn.Linear, nn.Linear)(equalizer)
        before = [p.detach().clone() for p in qmodel.parameters()]
        pairs = cross_layer_equalization(qmodel)
    finally:
        WEIGHT_EQUALIZATION_FUNCTION.clear()
        WEIGHT_EQUALIZATION_FUNCTION.update(saved)
    targets = {node.name: str(node.target) for node in qmodel.graph.nodes}
    assert len(pairs) == 1 and calls == [[targets[pairs[0][0]], targets[pairs[0][1]]]]
    assert all(torch.equal(a, b) for a, b in zip(before, qmodel.parameters(), strict=True))  # only the user's ran


class ConvPoolConv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.pool, self.second = nn.Conv2d(3, 8, 3, padding=1), nn.MaxPool2d(2), nn.Conv2d(8, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.pool(torch.relu(self.first(x))))


def test_a_pooling_layer_between_two_convolutions_keeps_them_a_pair_and_the_function():
    from mqbench.weight_equalization import ACT_TYPES, COLLECT_TYPES, FAKE_QUANT_TYPE, POOL_TYPES

    assert nn.Conv2d in COLLECT_TYPES and nn.Linear in COLLECT_TYPES and nn.ReLU in ACT_TYPES
    assert nn.MaxPool2d in POOL_TYPES and nn.AdaptiveAvgPool2d in POOL_TYPES and FAKE_QUANT_TYPE
    torch.manual_seed(0)
    model = ConvPoolConv().eval()
    with torch.no_grad():
        model.first.weight.mul_(torch.linspace(0.1, 4.0, 8).reshape(8, 1, 1, 1))  # uneven channel ranges
    qmodel = prepare_by_platform(model, "tensorrt")
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        from mqbench.utils.state import disable_all

        disable_all(qmodel)
        expected = qmodel(x)
        pairs = cross_layer_equalization(qmodel)
        got = qmodel(x)
    assert len(pairs) == 1
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    ranges = qmodel.first.weight.detach().reshape(8, -1).abs().amax(1)
    assert float(ranges.max() / ranges.min()) < 4.0 / 0.1  # evened out
