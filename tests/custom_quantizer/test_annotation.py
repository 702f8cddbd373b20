"""Annotate first: the decisions are on the graph's nodes before any pass, and the passes carry out only them."""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn

from mqbench.backends.registry import resolve_backend
from mqbench.custom_quantizer import ModelQuantizer
from mqbench.custom_quantizer.annotation import (
    ANNOTATION,
    Annotation,
    SharedQuantizer,
    annotation_of,
    graph_annotations,
)
from mqbench.custom_quantizer.passes import fuse_patterns, insert_activation_quantizers, mark_fusions, swap_modules
from mqbench.custom_quantizer.plan import annotate_graph, carry_out, plan_of
from mqbench.custom_quantizer.qconfig import resolve_qconfig
from mqbench.fake_quantize import FixedFakeQuantize
from mqbench.fuser_method_mapping import FUSER_METHODS, QAT_MODULE_MAPPING
from mqbench.observer import MinMaxObserver
from mqbench.prepare_by_platform import prepare_by_platform
from mqbench.utils.role import role_of

EIGHT_BIT = FixedFakeQuantize.with_args(observer=MinMaxObserver, quant_min=-128, quant_max=127)


class Branches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 4, 1)
        self.bn = nn.BatchNorm2d(4)
        self.relu = nn.ReLU()
        self.b = nn.Conv2d(3, 4, 1)
        self.head = nn.Conv2d(8, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([self.relu(self.bn(self.a(x))), self.b(x)], 1))


def test_the_prepared_graph_carries_its_decisions_and_the_plan_is_read_from_them():
    qmodel = prepare_by_platform(Branches().eval(), "vitis")  # its concatenations' inputs share one quantizer
    found = graph_annotations(qmodel.graph)
    assert found["a"].fusion is not None and found["a"].fusion.nodes == ("a", "bn", "relu")
    assert all(found[name].weight is not None for name in ("a", "b", "head"))
    # the concatenation's inputs share one quantizer: one object on both values, one module
    quantizer = found["a"].output
    assert isinstance(quantizer, SharedQuantizer) and quantizer is found["b"].output
    assert quantizer.values == ["a", "b"] and quantizer.readers is None
    assert quantizer.module == "a_post_act_fake_quantizer"
    assert role_of(quantizer.module, qmodel.get_submodule(quantizer.module)).values == ("a", "b")
    reads = [n for n in qmodel.graph.nodes if n.op == "call_module" and n.target == quantizer.module]
    assert [n.args[0].name for n in reads] == ["a", "b"]
    assert all([u.name for u in n.users] == ["cat"] for n in reads)
    plan = plan_of(qmodel)
    assert plan is not None and plan.fused == {"a": "Conv2d-BatchNorm2d-ReLU"}
    assert {name: d.quantized for name, d in plan.decisions.items()} == {
        name: a.decision.quantized for name, a in found.items() if a.decision is not None
    }
    assert [q.values for q in plan.activations if q.module == quantizer.module] == [("a", "b")]


def test_the_passes_do_what_annotations_written_by_hand_say():
    """A front end is anything that writes annotations: written by hand here, on a captured graph, the fusion,
    the swap and the insertion carry out exactly them (a shared quantizer across two values, one reader-only)."""
    gm = fx.symbolic_trace(Branches().eval())
    nodes = {n.name: n for n in gm.graph.nodes}
    mark_fusions(gm, FUSER_METHODS, skip=lambda node: node.name != "a")  # only the chain at "a" may fuse
    gm = fuse_patterns(gm, is_qat=False)
    assert isinstance(gm.get_submodule("a"), nn.Sequential) and "bn" not in {n.name for n in gm.graph.nodes}
    nodes = {n.name: n for n in gm.graph.nodes}
    annotation_of(nodes["head"]).weight = EIGHT_BIT.with_args(quant_min=-8, quant_max=7)
    annotation_of(nodes["head"]).weight_bits = 3
    both = SharedQuantizer(["a", "b"], EIGHT_BIT, readers={"cat"})
    annotation_of(nodes["cat"]).inputs.update(a=both, b=both)
    output = SharedQuantizer(["x"], EIGHT_BIT.with_args(quant_min=0, quant_max=255), readers=None)
    annotation_of(nodes["x"]).output = output
    gm = insert_activation_quantizers(swap_modules(gm, QAT_MODULE_MAPPING))
    modules = dict(gm.named_modules())
    assert "weight_fake_quant" not in dict(modules["a"].named_children())  # no weight annotated: stays float
    head = modules["head.weight_fake_quant"]
    assert (head.quant_min, head.quant_max) == (-4, 3)  # built at the annotated width
    assert both.module == "a_post_act_fake_quantizer" and output.module == "x_post_act_fake_quantizer"
    quantizers = {n.name: n for n in gm.graph.nodes if n.op == "call_module" and "post_act" in str(n.target)}
    assert {str(n.target) for n in quantizers.values()} == {both.module, output.module}
    x = next(n for n in gm.graph.nodes if n.op == "placeholder")
    assert all(modules.get(str(user.target)) is modules[output.module] for user in x.users)  # every reader
    x_in = torch.randn(2, 3, 5, 5)
    with torch.no_grad():
        gm(x_in)  # it runs


def _front_end(backend: str, gm: fx.GraphModule):
    spec = resolve_backend(backend)
    return ModelQuantizer(spec).front_end(gm, resolve_qconfig(spec, None, False))


def test_every_decision_is_on_the_captured_graph_before_any_pass():
    """The front end decides on the captured graph: after annotation nothing is fused, swapped or inserted, and
    the fused chain's op (named by its first node) holds its weight, its output's quantizer and its decision;
    carrying the annotations out gives the prepared model prepare_by_platform gives, and each chain's fuser ran
    once."""
    model = Branches().eval()
    gm = fx.symbolic_trace(model)
    before = [(n.name, n.op, str(n.target)) for n in gm.graph.nodes]
    calls = []
    front_end = _front_end("vitis", gm)
    fusers, skip = front_end.fusion()
    counted = {pattern: _counting(fuser, calls) for pattern, fuser in fusers.items()}
    front_end.fusion = lambda: (counted, skip)  # type: ignore[method-assign]
    annotated = annotate_graph(gm, front_end, is_qat=False)
    assert [(n.name, n.op, str(n.target)) for n in annotated.graph.nodes] == before  # the captured graph, as it was
    assert type(annotated.get_submodule("a")) is nn.Conv2d and type(annotated.get_submodule("bn")) is nn.BatchNorm2d
    found = graph_annotations(annotated.graph)
    assert found["a"].fusion is not None and found["a"].fusion.nodes == ("a", "bn", "relu")
    assert found["a"].weight is not None and found["a"].decision is not None and found["a"].decision.quantized
    assert "bn" not in found and "relu" not in found  # ops of the chain: the chain's op at "a" stands for them
    shared = found["a"].output
    assert shared is not None and shared is found["b"].output and shared.values == ["a", "b"]
    assert found["cat"].decision is not None and len(calls) == 1
    prepared = carry_out(annotated, front_end, is_qat=False)
    assert len(calls) == 1  # the chain fused with the module built while deciding
    reference = prepare_by_platform(model, "vitis")
    assert [(n.name, str(n.target)) for n in prepared.graph.nodes] == [
        (n.name, str(n.target)) for n in reference.graph.nodes
    ]
    assert plan_of(prepared) == plan_of(reference)


def test_an_annotation_edited_before_the_passes_is_what_they_do():
    """Annotations are the plan: one edited between annotation and the passes (a layer's weights kept float, an
    output quantizer dropped) is what the prepared model does."""
    gm = fx.symbolic_trace(Branches().eval())
    front_end = _front_end("tensorrt", gm)
    annotated = annotate_graph(gm, front_end, is_qat=False)
    found = graph_annotations(annotated.graph)
    assert found["b"].weight is not None
    found["b"].weight = None
    prepared = carry_out(annotated, front_end, is_qat=False)
    assert not hasattr(prepared.get_submodule("b"), "weight_fake_quant")
    assert hasattr(prepared.get_submodule("head"), "weight_fake_quant")


def _counting(fuser, calls):
    def counted(*args):
        calls.append(args)
        return fuser(*args)

    return counted


def test_an_annotation_lives_in_node_meta_under_one_key():
    gm = fx.symbolic_trace(nn.Sequential(nn.Linear(2, 2)))
    node = next(iter(gm.graph.nodes))
    assert ANNOTATION not in node.meta
    assert annotation_of(node) is annotation_of(node) and isinstance(node.meta[ANNOTATION], Annotation)


def test_quantizer_bits_are_part_of_the_plan_and_unknown_names_say_so():
    config = {
        "extra_qconfig_dict": {
            "w_observer": "MinMaxObserver",
            "a_observer": "MinMaxObserver",
            "w_fakequantize": "FixedFakeQuantize",
            "a_fakequantize": "FixedFakeQuantize",
            "w_qscheme": {"bit": 8, "symmetry": True, "per_channel": True},
            "a_qscheme": {"bit": 8, "symmetry": False, "per_channel": False},
        },
        "quantizer_bits": {"head.weight_fake_quant": 4, "cat_post_act_fake_quantizer": 6},
    }
    qmodel = prepare_by_platform(Branches().eval(), "academic", config)
    found = graph_annotations(qmodel.graph)
    assert found["head"].weight_bits == 4
    assert found["head"].inputs["cat"].bits == 6  # read by the head through it
    plan = plan_of(qmodel)
    assert (
        plan is not None
        and plan.widths["head.weight_fake_quant"] == 4
        and plan.widths["cat_post_act_fake_quantizer"] == 6
    )
    with pytest.raises(ValueError, match=r"'head\.weight_fq'.*did you mean head\.weight_fake_quant"):
        prepare_by_platform(Branches().eval(), "academic", {**config, "quantizer_bits": {"head.weight_fq": 4}})
    with pytest.raises(ValueError, match="a bit width is an integer from 2 to 16"):
        prepare_by_platform(Branches().eval(), "academic", {**config, "quantizer_bits": {"head.weight_fake_quant": 1}})
