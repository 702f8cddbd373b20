"""The quantization plan: every prepare decision, made by a front end, carried out and stored on the graph.

Two front ends decide what is quantized: a built-in backend from its
:class:`~mqbench.backends.Placement` rules (:class:`~mqbench.custom_quantizer.ModelQuantizer`),
a BackendConfig from its patterns and dtype configs (:mod:`mqbench.backend_config.engine`).
Both answer the questions of :class:`FrontEnd`; :func:`prepare_graph` asks them, runs the
passes (fusion, the swap to QAT modules with weight quantizers, activation quantizer
insertion) and records the answers as a :class:`QuantizationPlan` in the prepared model's
``meta``. What reads a prepared model reads the plan: ``quantization_report``, ``convert_fx``
(which ops to lower), ``convert_deploy`` (the backend the model was prepared for).

A plan says, per node of the prepared graph, whether the op is quantized and why (or why it
stays float); per layer, the weight quantizer and the chain fused into it; per activation
quantizer, the values it quantizes (several values: one quantizer the backend requires to be
shared, such as the inputs of a concatenation), who reads the quantized value and why its grid
is what it is.

Example:
    >>> import torch
    >>> from mqbench.prepare_by_platform import prepare_by_platform
    >>> from mqbench.custom_quantizer.plan import plan_of
    >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Flatten()).eval()
    >>> plan = plan_of(prepare_by_platform(model, "tensorrt"))
    >>> plan.backend, plan.fused["_0"], plan.decisions["_0"].quantized
    ('tensorrt', 'Conv2d-ReLU', True)
    >>> [(q.values, q.readers) for q in plan.activations]
    [(('input_1',), ('_0',))]
"""

from __future__ import annotations

import dataclasses
import typing
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from mqbench.backends.spec import BackendSpec
from mqbench.custom_quantizer.annotation import (
    ANNOTATION,
    Annotation,
    NodeDecision,
    SharedQuantizer,
    annotated_inputs,
    annotation_of,
    check_widths,
    graph_annotations,
)
from mqbench.custom_quantizer.functionalize import functionalize
from mqbench.custom_quantizer.modularize import modularize
from mqbench.custom_quantizer.passes import (
    drop_shape_assertions,
    eliminate_dead_code,
    finite_sentinels,
    fuse_patterns,
    fused_view,
    insert_activation_quantizers,
    mark_fusions,
    swap_modules,
)
from mqbench.custom_quantizer.placement import ActivationSite, Rules, plan_activation_quantizers
from mqbench.fake_quantize.quantize_base import QuantizeBase
from mqbench.functional import bits_of_range
from mqbench.fuser_method_mapping import Pattern
from mqbench.utils.factory import Factory

__all__ = [
    "PLAN_ATTRIBUTE",
    "FrontEnd",
    "NodeDecision",
    "QuantizationPlan",
    "QuantizerPlan",
    "annotate",
    "annotate_graph",
    "carry_out",
    "describe_quantizer",
    "node_op",
    "op_name",
    "plan_from_annotations",
    "plan_of",
    "prepare_graph",
    "record_quantizers",
]

PLAN_ATTRIBUTE = "mqbench_quantization_plan"  # a key of GraphModule.meta (kept by deepcopy)
EXCLUDED = "excluded by prepare_custom_config_dict['extra_quantizer_dict']"


@dataclass(frozen=True)
class QuantizerPlan:
    """One activation quantizer module: the values it quantizes, who reads them, its grid and why."""

    module: str
    values: tuple[str, ...]  # more than one: a quantizer the backend requires these values to share
    readers: tuple[str, ...] | None  # None: every reader of the values
    scheme: str
    reasons: tuple[str, ...] = ()


@dataclass(frozen=True)
class QuantizationPlan:
    """Every prepare decision of one model (see the module docstring)."""

    backend: str
    front_end: str  # "placement" (a built-in backend's rules) or "backend_config"
    decisions: Mapping[str, NodeDecision]
    weights: Mapping[str, str]  # layer node -> its weight quantizer's scheme
    fused: Mapping[str, str]  # layer node -> the chain fused into it ("Conv2d-BatchNorm2d-ReLU")
    activations: tuple[QuantizerPlan, ...] = ()
    spec: BackendSpec | None = field(default=None, repr=False, compare=False)  # resolved once, at prepare
    widths: Mapping[str, int] = field(default_factory=dict)  # quantizer module -> its bit width

    def quantized(self, node: str) -> bool:
        decision = self.decisions.get(node)
        return decision is not None and decision.quantized

    def shared(self) -> list[tuple[str, ...]]:
        """The groups of values that share one quantizer."""
        return [q.values for q in self.activations if len(q.values) > 1]

    def renamed(self, names: Mapping[str, str], reasons: Mapping[str, str]) -> QuantizationPlan:
        """The plan after nodes were replaced (``convert_fx``): decisions under their new names and reasons."""
        decisions = {}
        for name, decision in self.decisions.items():
            new = names.get(name, name)
            reason = reasons.get(name, decision.reason)
            decisions[new] = dataclasses.replace(decision, node=new, reason=reason)
        return dataclasses.replace(self, decisions=decisions)


def plan_of(model: nn.Module) -> QuantizationPlan | None:
    """The plan a prepared (or converted) model carries, or None for a model mqbench did not prepare."""
    meta = getattr(model, "meta", None)
    plan = meta.get(PLAN_ATTRIBUTE) if isinstance(meta, dict) else None
    return plan if isinstance(plan, QuantizationPlan) else None


def node_op(node: fx.Node, modules: Mapping[str, nn.Module]) -> Any:
    """The op a pattern names for this node: module class, function, or method name (None for others)."""
    if node.op == "call_module":
        return type(modules[str(node.target)])
    if node.op in ("call_function", "call_method"):
        return node.target
    return None


def op_name(op: Any) -> str:
    if op is None:
        return "?"
    return op if isinstance(op, str) else getattr(op, "__name__", repr(op))


def describe_quantizer(quantizer: nn.Module) -> str:
    """``"LearnableFakeQuantize [-127, 127] per-channel (axis 0) symmetric"``: a quantizer's grid in words."""
    qscheme = getattr(quantizer, "qscheme", None)
    granularity = "per-tensor"
    if qscheme in (torch.per_channel_symmetric, torch.per_channel_affine):
        granularity = f"per-channel (axis {getattr(quantizer, 'ch_axis', '?')})"
    symmetry = "symmetric" if qscheme in (torch.per_tensor_symmetric, torch.per_channel_symmetric) else "affine"
    low, high = getattr(quantizer, "quant_min", "?"), getattr(quantizer, "quant_max", "?")
    pot = ", power-of-two scale" if getattr(quantizer, "pot_scale", False) else ""
    return f"{type(quantizer).__name__} [{low}, {high}] {granularity} {symmetry}{pot}"


class FrontEnd:
    """What a front end decides. :func:`prepare_graph` asks, in this order, and records the answers.

    Subclasses override what they decide; the defaults fuse nothing, quantize nothing and say
    so.
    """

    backend: str = ""
    name: str = "placement"
    spec: BackendSpec | None = None  # the backend's spec, where the front end has one

    def fusion(self) -> tuple[Mapping[Pattern, Callable[..., nn.Module]], Callable[[fx.Node], bool]]:
        """The fusion patterns with their fuser methods, and the nodes that must not start a fusion."""
        return {}, lambda node: True

    def qat_mapping(self) -> Mapping[type, Any]:
        """Float module class -> its QAT class (``from_float(module, weight_factory)``)."""
        return {}

    def decide(self, gm: fx.GraphModule) -> None:
        """Called on the graph as the backend runs it (each fused chain one op, :func:`fused_view`), before any
        annotation is written: make per-node decisions here."""

    def weight_quantizer(self, node: fx.Node, module: nn.Module) -> Factory | None:
        """The weight quantizer of a layer node, or None to keep its weights float."""
        return None

    def rules(self, gm: fx.GraphModule) -> Rules:
        """Where activation quantizers go (evaluated on the graph with QAT modules in place)."""
        raise NotImplementedError

    def activation_quantizer(self, site: ActivationSite) -> Factory:
        """The quantizer of one activation site (shared sites: the first site of the group)."""
        raise NotImplementedError

    def excluded(self, node: fx.Node) -> bool:
        """The user's exclusions: such a node is neither fused nor quantized."""
        return False

    def excluded_reason(self, node: fx.Node) -> str:
        """Why an excluded node stays float."""
        return EXCLUDED

    def declared_decisions(self) -> Mapping[str, NodeDecision]:
        """Decisions the front end made itself (by node name); the engine derives the others."""
        return {}

    def float_reason(self, node: fx.Node, modules: Mapping[str, nn.Module]) -> str:
        """Why an op node that got no quantizer stays float."""
        return "the backend places no quantizer at this op"

    def nothing_quantized(self) -> str:
        """The warning when the plan quantizes nothing at all."""
        return (
            f"backend {self.backend!r} quantizes nothing in this model: every op stays float "
            "(see mqbench.backend_config.quantization_report for why each op stays float)"
        )


def prepare_graph(
    gm: fx.GraphModule, front_end: FrontEnd, is_qat: bool, widths: Mapping[str, int] | None = None
) -> fx.GraphModule:
    """Annotate ``gm`` with ``front_end``'s decisions (:func:`annotate_graph`), then carry them out
    (:func:`carry_out`: fuse, swap, insert) and store the plan.

    ``widths`` (``quantizer_bits``: quantizer name -> bit width) are part of the plan: each named quantizer is
    built at its width.
    """
    return carry_out(annotate_graph(gm, front_end, is_qat, widths), front_end, is_qat)


def annotate_graph(
    gm: fx.GraphModule, front_end: FrontEnd, is_qat: bool, widths: Mapping[str, int] | None = None
) -> fx.GraphModule:
    """The captured graph with every decision of ``front_end`` written on its nodes, before any pass runs.

    The graph is normalized first (in-place ops as functions, functional layers as modules, shape assertions
    dropped, infinite mask constants made finite). Then the front end marks the chains the backend runs as one op
    (on the chain's first node), and decides on the graph as the backend runs it (:func:`fused_view`: each chain
    one op, named by its first node): weight quantizers, activation quantizers (one :class:`SharedQuantizer` per
    module), a decision per op node; ``widths`` are checked and written on the quantizers they name. The
    returned graph is the captured one (nothing fused, swapped or inserted yet): its annotations are the whole
    plan, for :func:`carry_out` (or a user who edits them first).
    """
    gm = finite_sentinels(modularize(drop_shape_assertions(functionalize(gm))))
    eliminate_dead_code(gm)  # dead branches (made side-effect free above) would not export
    gm.recompile()
    fusers, skip = front_end.fusion()
    if fusers:
        excluded = front_end.excluded
        mark_fusions(gm, fusers, skip=lambda node: skip(node) or excluded(node))
    chained = any(annotation.fusion is not None for annotation in graph_annotations(gm.graph).values())
    view = fused_view(gm, is_qat) if chained else gm
    front_end.decide(view)
    annotate(view, front_end)
    if view is not gm:  # the decisions belong to the captured graph's nodes (of the same names)
        nodes = {node.name: node for node in gm.graph.nodes}
        for node in view.graph.nodes:
            if ANNOTATION in node.meta:
                nodes[node.name].meta[ANNOTATION] = node.meta[ANNOTATION]
    check_widths(gm.graph, widths or {}, front_end.spec)
    return gm


def carry_out(gm: fx.GraphModule, front_end: FrontEnd, is_qat: bool) -> fx.GraphModule:
    """Carry out the annotations of a captured graph (:func:`annotate_graph`): fuse the annotated chains, swap
    the layers with weight quantizers for their QAT modules, insert the activation quantizers; the plan, read
    from the annotations, is stored in the prepared graph's ``meta``."""
    gm = fuse_patterns(gm, is_qat)
    gm = swap_modules(gm, front_end.qat_mapping())
    gm = insert_activation_quantizers(gm)
    gm.meta[PLAN_ATTRIBUTE] = plan_from_annotations(gm, front_end)
    record_quantizers(gm)
    plan = typing.cast(QuantizationPlan, plan_of(gm))
    if not plan.weights and not plan.activations:
        warnings.warn(front_end.nothing_quantized(), stacklevel=4)
    return gm


def annotate(gm: fx.GraphModule, front_end: FrontEnd) -> None:
    """Write ``front_end``'s quantization decisions on the (fused) graph's nodes: weights, activations, reasons."""
    modules = dict(gm.named_modules())
    mapping = front_end.qat_mapping()
    for node in gm.graph.nodes:
        if node.op == "call_module" and type(modules[str(node.target)]) in mapping and not front_end.excluded(node):
            factory = front_end.weight_quantizer(node, modules[str(node.target)])
            if factory is not None:
                annotation_of(node).weight = factory
    sites = plan_activation_quantizers(gm.graph, modules, front_end.rules(gm))
    groups: dict[int, list[ActivationSite]] = {}
    for site in sites:
        groups.setdefault(site.group, []).append(site)
    for members in groups.values():
        first = members[0]
        shared = SharedQuantizer(
            [site.value.name for site in members], front_end.activation_quantizer(first), reasons=_reasons(members)
        )
        for site in members:
            if site.consumers is None:
                shared.readers = None
                annotation_of(site.value).output = shared
            else:
                if shared.readers is not None:
                    shared.readers.update(consumer.name for consumer in site.consumers)
                for consumer in site.consumers:
                    annotation_of(consumer).inputs[site.value.name] = shared
    _decide_nodes(gm, front_end, modules)


def _reasons(members: list[ActivationSite]) -> tuple[str, ...]:
    first = members[0]
    reasons = []
    if first.eight_bit:
        reasons.append("8-bit: next to the network's first or last layer")
    if first.unsigned:
        reasons.append("unsigned: its input is never negative")
    if first.product_operand:
        reasons.append("right operand of a product of two activations")
    if len(members) > 1:
        reasons.append("shared: the backend requires one quantizer for these values")
    return tuple(reasons)


def record_quantizers(gm: fx.GraphModule) -> None:
    """Write the plan's grids and widths from the quantizers as they are (after ``quantizer_bits`` set some
    widths, the plan says so): each layer's weight quantizer, each activation quantizer's scheme, and the width of
    every quantizer (``plan.widths``)."""
    plan = plan_of(gm)
    if plan is None:
        return
    modules = dict(gm.named_modules())
    weights = {}
    for node in gm.graph.nodes:
        layer = modules.get(str(node.target)) if node.op == "call_module" else None
        quantizer = getattr(layer, "weight_fake_quant", None)
        if isinstance(quantizer, QuantizeBase):
            weights[node.name] = describe_quantizer(quantizer)
    activations = tuple(
        dataclasses.replace(q, scheme=describe_quantizer(modules[q.module])) if q.module in modules else q
        for q in plan.activations
    )
    widths = {
        name: bits_of_range(int(module.quant_min), int(module.quant_max))
        for name, module in modules.items()
        if isinstance(module, QuantizeBase)
    }
    gm.meta[PLAN_ATTRIBUTE] = dataclasses.replace(plan, weights=weights, activations=activations, widths=widths)


def plan_from_annotations(gm: fx.GraphModule, front_end: FrontEnd) -> QuantizationPlan:
    """The plan of a prepared graph, read from its annotations (grids and widths: :func:`record_quantizers`)."""
    decisions: dict[str, NodeDecision] = {}
    fused: dict[str, str] = {}
    shared: dict[int, SharedQuantizer] = {}
    for node in gm.graph.nodes:
        annotation = node.meta.get(ANNOTATION)
        if not isinstance(annotation, Annotation):
            continue
        if annotation.decision is not None:
            decisions[node.name] = annotation.decision
        if annotation.fusion is not None:
            fused[node.name] = annotation.fusion.chain
        for quantizer in [annotation.output, *annotation.inputs.values()]:
            if quantizer is not None and quantizer.module:
                shared.setdefault(id(quantizer), quantizer)
    order = {node.name: i for i, node in enumerate(gm.graph.nodes)}
    activations = tuple(
        QuantizerPlan(
            q.module,
            tuple(q.values),
            None if q.readers is None else tuple(sorted(q.readers)),
            "",  # written by record_quantizers
            q.reasons,
        )
        for q in sorted(shared.values(), key=lambda q: order.get(q.values[0], -1))
    )
    return QuantizationPlan(
        backend=front_end.backend,
        front_end=front_end.name,
        decisions=decisions,
        weights={},  # written with the widths by record_quantizers
        fused=fused,
        activations=activations,
        spec=front_end.spec,
    )


def _decide_nodes(gm: fx.GraphModule, front_end: FrontEnd, modules: Mapping[str, nn.Module]) -> None:
    """One decision per op node: the front end's own, else what its annotations say."""
    declared = front_end.declared_decisions()
    weighted = {
        str(node.target)
        for node in gm.graph.nodes
        if isinstance(node.meta.get(ANNOTATION), Annotation) and node.meta[ANNOTATION].weight is not None
    }
    for node in gm.graph.nodes:
        op = node_op(node, modules)
        if op is None or isinstance(modules.get(str(node.target)), QuantizeBase):
            continue
        annotation = annotation_of(node)
        if node.name in declared:
            annotation.decision = declared[node.name]
            continue
        name = op_name(op)
        parts = []
        if node.op == "call_module" and str(node.target) in weighted:
            parts.append("weights")
        if annotation.inputs or any(_quantized_for_all(arg) for arg in node.all_input_nodes):
            parts.append("inputs")
        if node.users and (_quantized_for_all(node) or all(node.name in annotated_inputs(user) for user in node.users)):
            parts.append("output")
        if front_end.excluded(node):
            annotation.decision = NodeDecision(node.name, name, False, front_end.excluded_reason(node))
        elif "weights" in parts or "inputs" in parts:  # it computes on quantized values
            listed = ", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else parts[0]
            annotation.decision = NodeDecision(node.name, name, True, f"{listed} quantized", name)
        elif parts:
            reason = "computes in float; its output is quantized for its readers"
            annotation.decision = NodeDecision(node.name, name, False, reason)
        else:
            annotation.decision = NodeDecision(node.name, name, False, front_end.float_reason(node, modules))


def _quantized_for_all(node: fx.Node) -> bool:
    annotation = node.meta.get(ANNOTATION)
    return isinstance(annotation, Annotation) and annotation.output is not None
