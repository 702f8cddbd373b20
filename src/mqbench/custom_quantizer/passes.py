"""Graph passes of prepare: fuse patterns, swap in QAT modules, insert activation quantizers.

Each pass takes a GraphModule, edits it in place, lints and recompiles it, and returns it.
"""

from __future__ import annotations

import builtins
import copy
import math
import operator
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import fx, nn

from mqbench.custom_quantizer.annotation import (
    ANNOTATION,
    Annotation,
    Fusion,
    annotated_inputs,
    annotation_of,
)
from mqbench.custom_quantizer.bits import set_quantizer_bits
from mqbench.fuser_method_mapping import Pattern
from mqbench.utils.role import QuantizerRole, set_role

__all__ = [
    "delete_unused_submodules",
    "drop_shape_assertions",
    "eliminate_dead_code",
    "finite_sentinels",
    "fuse_patterns",
    "has_side_effects",
    "insert_activation_quantizers",
    "mark_fusions",
    "set_submodule",
    "sole_followers",
    "swap_modules",
]

# Methods that change their object (containers, modules) rather than return a new value.
_MUTATING_METHODS = frozenset(
    {
        "update",
        "append",
        "extend",
        "insert",
        "setdefault",
        "pop",
        "popitem",
        "clear",
        "remove",
        "discard",
        "sort",
        "reverse",
        "register_buffer",
        "register_parameter",
        "add_module",
    }
)
_IN_PLACE_OPERATORS = frozenset(
    {
        operator.setitem,
        operator.delitem,
        operator.iadd,
        operator.isub,
        operator.imul,
        operator.imatmul,
        operator.itruediv,
        operator.ifloordiv,
        operator.imod,
        operator.ipow,
        operator.iand,
        operator.ior,
        operator.ixor,
        operator.ilshift,
        operator.irshift,
        operator.iconcat,
    }
)


def set_submodule(root: nn.Module, qualname: str, module: nn.Module) -> None:
    parent_name, _, child = qualname.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, child, module)


def delete_unused_submodules(gm: fx.GraphModule) -> None:
    """Remove submodules no node uses (linear in the number of modules, unlike the fx helper)."""
    prefixes: set[str] = set()
    called: set[str] = set()
    for node in gm.graph.nodes:
        if node.op in ("call_module", "get_attr"):
            parts = str(node.target).split(".")
            prefixes.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
            if node.op == "call_module":
                called.add(str(node.target))
    deleted: set[str] = set()
    for name, _ in list(gm.named_modules()):
        if not name or name in prefixes:
            continue
        parts = name.split(".")
        ancestors = (".".join(parts[:i]) for i in range(1, len(parts)))
        if any(ancestor in called or ancestor in deleted for ancestor in ancestors):
            continue  # inside a called module (its quantizers, BatchNorm ...) or already removed
        gm.delete_submodule(name)
        deleted.add(name)


def _in_place_name(name: str) -> bool:
    """``add_``, ``copy_``, ``__setitem__``, ``__iadd__``: names of calls that write into an argument."""
    if name.startswith("__") and name.endswith("__"):
        return name in ("__setitem__", "__delitem__") or (name.startswith("__i") and name != "__init__")
    return name.endswith("_")


def has_side_effects(node: fx.Node) -> bool:
    """Whether removing ``node`` could change the model even when nothing reads its result.

    torch.fx's ``Node.is_impure`` plus what it does not know: container methods that mutate
    (``out.update(...)``, ``append``, ``setdefault`` ...), in-place tensor methods and functions
    (``add_``, ``x += y``, ``x[i] = v``), ``inplace=True`` calls and modules.
    """
    if node.op == "call_method":
        name = str(node.target)
        return name in _MUTATING_METHODS or _in_place_name(name)
    if node.op == "call_function":
        if node.target in _IN_PLACE_OPERATORS or node.kwargs.get("inplace") is True:
            return True
        if getattr(node.target, "__module__", None) == "torch._functorch.predispatch":
            return True  # vmap's levels in a torch.export capture (entered and left by calls nothing reads)
        if _in_place_name(getattr(node.target, "__name__", "")):
            return True
    if node.op == "call_module":
        module = node.graph.owning_module.get_submodule(str(node.target)) if node.graph.owning_module else None
        if getattr(module, "inplace", False) is True:
            return True
    return node.is_impure()


def eliminate_dead_code(gm: fx.GraphModule) -> None:
    """Remove nodes whose results nothing reads, keeping every call with side effects."""
    gm.graph.eliminate_dead_code(is_impure_node=has_side_effects)


# What a shape assertion reads of a tensor: its metadata, never its values.
_METADATA_ATTRIBUTES = frozenset({"ndim", "shape", "dtype", "device", "is_cuda", "layout"})
_METADATA_METHODS = frozenset({"size", "dim", "numel", "ndimension"})


def _reads_metadata_only(condition: Any) -> bool:
    """Whether ``condition`` is computed from constants and tensors' ranks, shapes and dtypes alone."""
    stack, seen = [condition], set()
    while stack:
        value = stack.pop()
        if not isinstance(value, fx.Node):
            if isinstance(value, (list, tuple)):
                stack.extend(value)
            continue
        if value in seen:
            continue
        seen.add(value)
        if value.op == "call_function" and value.target is builtins.getattr:
            if len(value.args) > 1 and value.args[1] in _METADATA_ATTRIBUTES:
                continue
            return False
        if value.op == "call_method" and value.target in _METADATA_METHODS:
            stack.extend(value.args[1:])
            continue
        if value.op == "call_function" and (
            getattr(value.target, "__module__", None) in ("_operator", "operator") or value.target is builtins.len
        ):
            stack.extend([*value.args, *value.kwargs.values()])
            continue
        return False
    return True


def drop_shape_assertions(gm: fx.GraphModule) -> fx.GraphModule:
    """Remove ``torch._assert`` calls whose condition reads only tensors' ranks, shapes or dtypes.

    A layer that checks its input (``_assert(x.ndim == 4, ...)``) reads the output of the layer
    before it: that extra reader keeps a convolution and the batch norm after it from being fused
    (folded), and neither the exported graph nor a runtime keeps the check. What is left of the
    condition is removed as dead code.
    """
    asserts = [
        node
        for node in gm.graph.nodes
        if node.op == "call_function" and node.target is torch._assert and not node.users
        if _reads_metadata_only(node.args[0] if node.args else node.kwargs.get("condition"))
    ]
    for node in asserts:
        gm.graph.erase_node(node)
    if asserts:
        eliminate_dead_code(gm)
        gm.recompile()
    return gm


SENTINEL = 1e30  # what a mask's "masked out" value is written as (sign kept)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and math.isfinite(value) and abs(value) > SENTINEL:
        return math.copysign(SENTINEL, value)
    return value


def finite_sentinels(gm: fx.GraphModule) -> fx.GraphModule:
    """Write the finite "masked out" values of attention masks (``torch.finfo(float32).min``, literals or scalar
    tensor constants beyond 1e30 in magnitude) as -1e30 (+1e30 for a maximum).

    The float model computes the same: a score added to either is absorbed by float32 rounding (so a fully masked
    row is uniform after softmax with both) and ``exp`` of either is 0. A runtime that rescales the mask may not:
    OpenVINO's CPU plugin moves the dequantization scale of quantized scores past the ``Add`` with the mask,
    computing ``mask / scale``, which overflows to -inf for ``finfo.min`` (measured on OpenVINO 2026.4: a
    left-padded row of every masked key came out NaN); -1e30 / scale stays finite for any scale above 3e-9.
    ``-inf`` is left as written."""
    changed = False
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method"):
            args, kwargs = fx.node.map_aggregate(node.args, _finite), fx.node.map_aggregate(node.kwargs, _finite)
            if args != node.args or kwargs != node.kwargs:
                node.args, node.kwargs = tuple(args), dict(kwargs)
                changed = True
        elif node.op == "get_attr":
            value: Any = gm
            for part in str(node.target).split("."):
                value = getattr(value, part, None)
            if isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel() == 1:
                number = float(value)
                if _finite(number) != number:
                    with torch.no_grad():
                        value.fill_(_finite(number))
    if changed:
        gm.recompile()
    return gm


def _finish(gm: fx.GraphModule) -> fx.GraphModule:
    eliminate_dead_code(gm)
    gm.graph.lint()
    gm.recompile()
    delete_unused_submodules(gm)
    return gm


def _matches(node: fx.Node, matcher: Any, modules: Mapping[str, nn.Module]) -> bool:
    if isinstance(matcher, tuple):
        return any(_matches(node, m, modules) for m in matcher)
    if isinstance(matcher, type):
        return node.op == "call_module" and type(modules[str(node.target)]) is matcher
    if isinstance(matcher, str):
        return node.op == "call_method" and node.target == matcher
    return node.op == "call_function" and node.target is matcher


def sole_followers(node: fx.Node, accept: Callable[[fx.Node, int], bool], limit: int | None = None) -> list[fx.Node]:
    """``node`` and the chain after it: each next node is the previous one's only user, reads it as its
    first argument and is accepted by ``accept(user, position)`` (position 1 for the first follower)."""
    chain = [node]
    while limit is None or len(chain) < limit:
        users = list(chain[-1].users)
        if len(users) != 1:
            break
        follower = users[0]
        if not follower.args or follower.args[0] is not chain[-1] or not accept(follower, len(chain)):
            break
        chain.append(follower)
    return chain


def _match_chain(
    node: fx.Node, pattern: Pattern, modules: Mapping[str, nn.Module], calls: Counter[str]
) -> list[fx.Node] | None:
    if not _matches(node, pattern[0], modules) or calls[str(node.target)] != 1:
        return None

    def accept(follower: fx.Node, position: int) -> bool:
        called_once = follower.op != "call_module" or calls[str(follower.target)] == 1
        return _matches(follower, pattern[position], modules) and called_once

    chain = sole_followers(node, accept, limit=len(pattern))
    return chain if len(chain) == len(pattern) else None


def mark_fusions(
    gm: fx.GraphModule,
    fuser_methods: Mapping[Pattern, Callable[..., nn.Module]],
    skip: Callable[[fx.Node], bool] = lambda node: False,
) -> None:
    """Annotate each chain matching a pattern (longest first) on its first node, for :func:`fuse_patterns`.

    A chain fuses only where every intermediate value has a single user and every module in
    it is called once (a module shared between call sites keeps its own behaviour); a node
    ``skip`` accepts starts none.
    """
    modules = dict(gm.named_modules())
    calls = Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_module")
    patterns = sorted(fuser_methods, key=len, reverse=True)
    claimed: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node in claimed or node.op != "call_module" or skip(node):
            continue
        for pattern in patterns:
            chain = _match_chain(node, pattern, modules, calls)
            if chain is None or claimed.intersection(chain):
                continue
            parts = [modules[str(n.target)] if n.op == "call_module" else n.target for n in chain]
            name = "-".join(
                type(part).__name__ if isinstance(part, nn.Module) else getattr(part, "__name__", str(part))
                for part in parts
            )
            annotation_of(node).fusion = Fusion(tuple(n.name for n in chain), name, fuser_methods[pattern])
            claimed.update(chain)
            break


def build_fused_modules(gm: fx.GraphModule, is_qat: bool) -> dict[str, nn.Module]:
    """Build the module of each chain annotated by :func:`mark_fusions` (``fuser(is_qat, *parts)``, once per
    chain: kept on its :class:`Fusion`); the fused modules by the chain's first module's name."""
    modules = dict(gm.named_modules())
    nodes = {node.name: node for node in gm.graph.nodes}
    built = {}
    for node in gm.graph.nodes:
        annotation = node.meta.get(ANNOTATION)
        fusion = annotation.fusion if isinstance(annotation, Annotation) else None
        if fusion is None:
            continue
        if fusion.module is None:
            chain = [nodes[name] for name in fusion.nodes]
            parts = [modules[str(n.target)] if n.op == "call_module" else n.target for n in chain]
            fusion.module = fusion.fuser(is_qat, *parts)
            fusion.module.train(modules[str(node.target)].training)
        built[str(node.target)] = fusion.module
    return built


def _collapse_chains(graph: fx.Graph) -> None:
    """Each annotated chain as its first node: the last node's readers read the first, the others are gone."""
    nodes = {node.name: node for node in graph.nodes}
    for node in list(graph.nodes):
        annotation = node.meta.get(ANNOTATION)
        fusion = annotation.fusion if isinstance(annotation, Annotation) else None
        if fusion is None:
            continue
        chain = [nodes[name] for name in fusion.nodes]
        chain[-1].replace_all_uses_with(node)
        for follower in reversed(chain[1:]):
            graph.erase_node(follower)


def fused_view(gm: fx.GraphModule, is_qat: bool) -> fx.GraphModule:
    """``gm`` as the backend runs it, for a front end to decide on: a copy of its graph with each chain annotated
    by :func:`mark_fusions` collapsed to its first node, which calls the fused module. The view calls ``gm``'s
    own modules (no parameter is copied); ``gm`` keeps its graph. Its nodes hold ``gm``'s annotations (the same
    objects), and keep their names."""
    fused = build_fused_modules(gm, is_qat)
    graph = copy.deepcopy(gm.graph)
    _collapse_chains(graph)
    targets = {str(n.target) for n in graph.nodes if n.op in ("call_module", "get_attr")}
    root = {target: fused[target] if target in fused else _attribute(gm, target) for target in targets}
    return fx.GraphModule(root, graph, class_name=type(gm).__name__)


def _attribute(gm: fx.GraphModule, target: str) -> Any:
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def fuse_patterns(gm: fx.GraphModule, is_qat: bool) -> fx.GraphModule:
    """Replace each chain annotated by :func:`mark_fusions` with its fused module at its first node (the module
    :func:`build_fused_modules` built, or ``fuser(is_qat, *parts)``)."""
    for target, fused in build_fused_modules(gm, is_qat).items():
        set_submodule(gm, target, fused)
    for node in gm.graph.nodes:
        annotation = node.meta.get(ANNOTATION)
        if isinstance(annotation, Annotation) and annotation.fusion is not None:
            annotation.fusion.module = None  # in place now: the annotation holds no module
    _collapse_chains(gm.graph)
    return _finish(gm)


def _float_parameter(module: nn.Module, name: str) -> Any:
    """``module``'s weight or bias; of its first part for a fused sequence (convolution then activation)."""
    if not hasattr(module, name) and isinstance(module, nn.Sequential) and len(module):
        module = module[0]
    return getattr(module, name, None)


def swap_modules(gm: fx.GraphModule, mapping: Mapping[type, Any]) -> fx.GraphModule:
    """Swap each called module annotated with a weight quantizer for ``QAT.from_float(module, factory)``.

    ``mapping`` gives the QAT class of each float module class (exact type); the weight quantizer gets the
    width the annotation sets, if any.
    """
    swapped: set[str] = set()
    for node in gm.graph.nodes:
        annotation = node.meta.get(ANNOTATION)
        if node.op != "call_module" or str(node.target) in swapped or not isinstance(annotation, Annotation):
            continue
        if annotation.weight is None:
            continue
        module = gm.get_submodule(str(node.target))
        qat_class = mapping[type(module)]
        qat = qat_class.from_float(module, annotation.weight)
        weight, bias = _float_parameter(module, "weight"), _float_parameter(module, "bias")
        folds_norm = any(isinstance(part, nn.modules.batchnorm._BatchNorm) for part in module.modules())
        if (
            isinstance(weight, nn.Parameter)
            and isinstance(qat.weight, nn.Parameter)
            and qat.weight.shape == weight.shape
            and qat.weight.dtype == weight.dtype
            and not folds_norm
        ):
            # the QAT layer takes the float layer's own weight, not a copy: one copy of the weights in memory
            # (the prepared model owns them, or shares them with the model when prepared in place), and a weight
            # another module holds too (a language model's embedding table read again as its output layer's
            # weight) stays one tensor, trained and transformed as one (a layer folding a BatchNorm into its
            # weight keeps its own copy: the folds differ)
            qat.weight = weight
            if isinstance(bias, nn.Parameter) and isinstance(qat.bias, nn.Parameter) and qat.bias.shape == bias.shape:
                qat.bias = bias  # and its bias with it
        weight_quantizer = getattr(qat, "weight_fake_quant", None)
        if isinstance(weight_quantizer, nn.Module):
            set_role(weight_quantizer, QuantizerRole("weight", layer=str(node.target)))
            if annotation.weight_bits is not None:
                set_quantizer_bits(weight_quantizer, annotation.weight_bits)
        set_submodule(gm, str(node.target), qat)
        swapped.add(str(node.target))
    return _finish(gm)


def _not(node: fx.Node) -> Callable[[fx.Node], bool]:
    return lambda user: user is not node


def insert_activation_quantizers(gm: fx.GraphModule) -> fx.GraphModule:
    """Insert the annotated activation quantizers as ``<value>_post_act_fake_quantizer`` modules.

    A value annotated with an ``output`` quantizer is read through it by every reader; one its readers annotate
    in their ``inputs`` is read through it by those readers. Values holding one :class:`SharedQuantizer` share
    one module, named after the first of them in graph order.
    """
    graph = gm.graph
    last_placeholder = [n for n in graph.nodes if n.op == "placeholder"][-1:]
    values: dict[int, list[str]] = {}
    for value in list(graph.nodes):
        annotation = value.meta.get(ANNOTATION)
        shared = annotation.output if isinstance(annotation, Annotation) else None
        readers: list[fx.Node] | None = None
        if shared is None:
            readers = [user for user in value.users if value.name in annotated_inputs(user)]
            if not readers:
                continue
            shared = annotated_inputs(readers[0])[value.name]
        if not shared.module:
            shared.module = shared.name
            quantizer = shared.factory()
            if shared.bits is not None:
                set_quantizer_bits(quantizer, shared.bits)
            gm.add_submodule(shared.module, quantizer)
        members = values.setdefault(id(shared), [])
        members.append(value.name)
        set_role(gm.get_submodule(shared.module), QuantizerRole("activation", values=tuple(members)))
        anchor = last_placeholder[0] if value.op == "placeholder" else value
        with graph.inserting_after(anchor):
            quantized = graph.call_module(shared.module, (value,))
        if readers is None:
            value.replace_all_uses_with(quantized, delete_user_cb=_not(quantized))
        else:
            for reader in readers:
                reader.replace_input_with(value, quantized)
    return _finish(gm)
