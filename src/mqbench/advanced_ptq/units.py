"""Reconstruction units found on a prepared graph: single layers, and blocks closed by their residuals.

A *cut point* is a node whose value is the only one alive at that point of the graph (in
execution order): everything after it reads nothing computed before it but that value. The
segments between consecutive cut points are the model's blocks: a ResNet basic or bottleneck
block with its shortcut, a MobileNetV2 inverted residual, a transformer's attention or MLP
sub-block with its residual addition. A chain without shortcuts has a cut point after every
op, so each of its layers is a segment of its own. Network inputs other than the first (an
attention mask), values computed from them alone and sizes read from a tensor are not counted
as alive: they are read where needed, as constants are. A segment with more than
:data:`MAX_BLOCK_LAYERS` layers in several top-level modules of the model (a UNet, whose skips
span the whole network) is split into one unit per top-level module: its stages. Ops between
blocks that hold no layer (a block's input quantizer, pooling) join the next unit, so that a
unit learns the quantizers of what it reads. More than :data:`MAX_BLOCK_LAYERS` layers left in
one piece fall back to layer units, with a warning naming them.

``pattern="layer"``: one unit per weighted layer (its exclusive input quantizers, the layer,
and the ReLU and quantizers that alone follow it). ``pattern="block"``: one unit per segment
holding a weighted layer.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from mqbench.prepare_by_platform import prepare_by_platform
    >>> from mqbench.advanced_ptq.units import find_units
    >>> class Residual(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)
    ...     def forward(self, x):
    ...         y = x + self.b(torch.relu(self.a(x)))
    ...         return self.c(y)
    >>> model = prepare_by_platform(Residual().eval(), "tensorrt")
    >>> [unit.layers for unit in find_units(model, "block")]
    [('a', 'b'), ('c',)]
    >>> [unit.layers for unit in find_units(model, "layer")]
    [('a',), ('b',), ('c',)]
"""

from __future__ import annotations

import operator
import warnings
from collections.abc import Iterable
from dataclasses import dataclass

from torch import fx, nn

from mqbench.custom_quantizer.ops import WEIGHTED_KINDS, node_kind
from mqbench.custom_quantizer.passes import sole_followers
from mqbench.fake_quantize.quantize_base import QuantizeBase

__all__ = ["PATTERNS", "Unit", "cut_points", "find_units"]

PATTERNS = ("layer", "block")
# More layers than this between two cut points is not a block of the architecture but a shortcut
# spanning most of the network: those layers are reconstructed one by one (ResNet's bottleneck with
# its downsample has 4, a transformer's attention 4, a MobileNetV2 inverted residual 3).
MAX_BLOCK_LAYERS = 8


@dataclass(frozen=True)
class Unit:
    """Nodes reconstructed together: ``nodes`` in graph order, read from ``inputs``, compared at ``outputs``."""

    kind: str  # "layer" or "block"
    nodes: tuple[str, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    layers: tuple[str, ...]  # the weighted layers among the nodes

    @property
    def name(self) -> str:
        return self.layers[0] if len(self.layers) == 1 else f"{self.layers[0]}..{self.layers[-1]}"


def _is_quantizer(node: fx.Node, modules: dict[str, nn.Module]) -> bool:
    return node.op == "call_module" and isinstance(modules.get(str(node.target)), QuantizeBase)


def _is_layer(node: fx.Node, modules: dict[str, nn.Module]) -> bool:
    module = modules.get(str(node.target)) if node.op == "call_module" else None
    return module is not None and node_kind(node, modules) in WEIGHTED_KINDS and hasattr(module, "weight")


_SHAPE_METHODS = frozenset({"size", "dim", "numel"})


def _is_shape(node: fx.Node, side: set[fx.Node]) -> bool:
    """A size or shape entry (``x.size(1)``, ``x.shape[0]``): a number, not an activation."""
    if node.op == "call_method" and node.target in _SHAPE_METHODS:
        return True
    if node.op == "call_function" and node.target is getattr:
        return True
    return node.op == "call_function" and node.target is operator.getitem and node.args[0] in side


def cut_points(graph: fx.Graph) -> list[fx.Node]:
    """Nodes after which their own value is the only one still to be read (see the module docstring)."""
    nodes = [n for n in graph.nodes if n.op != "output"]
    position = {node: i for i, node in enumerate(nodes)}
    placeholders = [n for n in nodes if n.op == "placeholder"]
    side = set(placeholders[1:]) | {n for n in nodes if n.op == "get_attr"}
    for node in nodes:  # values computed from side inputs alone (an attention mask's bias) are side values too
        derived = node.op not in ("placeholder", "get_attr") and node.all_input_nodes
        if (derived and set(node.all_input_nodes) <= side) or _is_shape(node, side):
            side.add(node)
    last_use = {node: max((position.get(u, len(nodes)) for u in node.users), default=-1) for node in nodes}
    alive: set[fx.Node] = set()
    ends: dict[int, list[fx.Node]] = {}
    cuts = []
    for i, node in enumerate(nodes):
        for dead in ends.pop(i, []):
            alive.discard(dead)
        if node not in side and last_use[node] > i:
            alive.add(node)
            ends.setdefault(last_use[node], []).append(node)
        if alive == {node} and node.op != "placeholder":
            cuts.append(node)
    return cuts


def _unit(kind: str, members: Iterable[fx.Node], modules: dict[str, nn.Module]) -> Unit:
    ordered = list(members)
    inside = set(ordered)
    inputs: list[str] = []
    for node in ordered:
        for arg in node.all_input_nodes:
            if arg not in inside and arg.op != "get_attr" and arg.name not in inputs:
                inputs.append(arg.name)
    outputs = [n.name for n in ordered if any(user not in inside for user in n.users)]
    layers = tuple(n.name for n in ordered if _is_layer(n, modules))
    return Unit(kind, tuple(n.name for n in ordered), tuple(inputs), tuple(outputs), layers)


def _layer_unit(layer: fx.Node, modules: dict[str, nn.Module]) -> Unit:
    before = [
        arg for arg in layer.all_input_nodes if _is_quantizer(arg, modules) and all(user is layer for user in arg.users)
    ]
    follows = sole_followers(layer, lambda user, _: _is_quantizer(user, modules) or node_kind(user, modules) == "relu")
    return _unit("layer", [*before, *follows], modules)


def _stages(segment: list[fx.Node], modules: dict[str, nn.Module]) -> list[list[fx.Node]]:
    """The segment as one block, or, when it is too long for one, split by the top-level modules of its layers."""
    tops = [str(n.target).split(".")[0] for n in segment if _is_layer(n, modules)]
    if len(tops) <= MAX_BLOCK_LAYERS or len(set(tops)) <= 1:
        return [segment]
    stages: list[list[fx.Node]] = []
    pending: list[fx.Node] = []  # ops between layers join the stage of the next layer
    current = None
    for node in segment:
        pending.append(node)
        if _is_layer(node, modules):
            top = str(node.target).split(".")[0]
            if top != current or not stages:
                stages.append([])
                current = top
            stages[-1].extend(pending)
            pending = []
    if pending:
        stages[-1].extend(pending)
    return stages


def _merge_layer_free(segments: list[list[fx.Node]], modules: dict[str, nn.Module]) -> list[list[fx.Node]]:
    """Stages with layers; the ops of a stage without one (an input quantizer, pooling) join the next stage
    (the last stage, for those after every layer), so a unit learns the quantizers of what it reads."""
    stages: list[list[fx.Node]] = []
    pending: list[fx.Node] = []
    for segment in segments:
        for stage in _stages(segment, modules):
            pending.extend(stage)
            if any(_is_layer(n, modules) for n in stage):
                stages.append(pending)
                pending = []
    if pending and stages:
        stages[-1].extend(pending)
    return stages


def find_units(model: fx.GraphModule, pattern: str, exclude: Iterable[str] = ()) -> list[Unit]:
    """The reconstruction units of a prepared model in graph order (see the module docstring).

    ``exclude``: node names left as they are (their units are skipped).
    """
    if pattern not in PATTERNS:
        raise ValueError(f"unknown reconstruction pattern {pattern!r}; choose one of {', '.join(PATTERNS)}")
    modules = dict(model.named_modules())
    excluded = set(exclude)
    known = {n.name for n in model.graph.nodes}
    missing = sorted(excluded - known)
    if missing:
        raise ValueError(f"exclude_node names no node of the model: {missing}; nodes are named as in model.graph")
    layers = [n for n in model.graph.nodes if _is_layer(n, modules)]
    if pattern == "layer":
        units = [_layer_unit(layer, modules) for layer in layers]
    else:
        units = []
        start = 0
        nodes = [n for n in model.graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
        index = {node: i for i, node in enumerate(nodes)}
        segments = []
        for cut in cut_points(model.graph):
            if cut in index:
                segments.append(nodes[start : index[cut] + 1])
                start = index[cut] + 1
        segments.append(nodes[start:])
        for stage in _merge_layer_free(segments, modules):
            stage_layers = [n for n in stage if _is_layer(n, modules)]
            if len(stage_layers) > MAX_BLOCK_LAYERS:
                names = ", ".join(n.name for n in stage_layers)
                warnings.warn(
                    f"no block boundary found among {len(stage_layers)} layers (a shortcut spans them all); "
                    f"reconstructing them layer by layer: {names}",
                    stacklevel=2,
                )
                units += [_layer_unit(layer, modules) for layer in stage_layers]
            else:
                units.append(_unit("block", stage, modules))
    return [unit for unit in units if not excluded & set(unit.nodes)]
