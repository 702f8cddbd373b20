"""In-place calls made out-of-place before anything is inserted into the graph.

A traced graph keeps a model's in-place calls (``nn.ReLU(inplace=True)``, ``F.relu(x,
inplace=True)``, ``x.add_(y)``, ``x += y``, ``torch.relu_(x)``). Once quantizers sit between
ops, an in-place call no longer writes where the float model wrote: a layer that read the
tensor before the call may read the changed values, a quantizer's input may change under it,
and the caller's input tensor may be overwritten. The exported ONNX graph, being functional,
then computes something else than the prepared model.

:func:`functionalize` replaces each in-place call whose target is no view of another tensor
by its out-of-place form and points every later reader of the target at the call's result,
which is what the float model computed. Calls on views (or on tensors with views taken
before the call) keep their in-place form: rewiring those would change what the view reads.
A dead in-place call (its result and target read by nothing later) then has no side effect
left and dead-code elimination removes it.

Example:
    >>> import torch
    >>> from torch import fx, nn
    >>> class Model(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.conv, self.act = nn.Conv2d(1, 1, 1), nn.ReLU(inplace=True)
    ...     def forward(self, x):
    ...         a = self.conv(x)
    ...         self.act(a)
    ...         return a
    >>> gm = functionalize(fx.symbolic_trace(Model()))
    >>> gm.act.inplace, [n.op for n in gm.graph.nodes][-1], list(gm.graph.nodes)[-1].args[0].name
    (False, 'output', 'act')
"""

from __future__ import annotations

import operator
import typing
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

__all__ = ["functionalize"]

_OUT_OF_PLACE_OPERATORS: dict[Callable[..., Any], Callable[..., Any]] = {
    operator.iadd: operator.add,
    operator.isub: operator.sub,
    operator.imul: operator.mul,
    operator.imatmul: operator.matmul,
    operator.itruediv: operator.truediv,
    operator.ifloordiv: operator.floordiv,
    operator.imod: operator.mod,
    operator.ipow: operator.pow,
    operator.iand: operator.and_,
    operator.ior: operator.or_,
    operator.ixor: operator.xor,
    operator.ilshift: operator.lshift,
    operator.irshift: operator.rshift,
}

# Ops whose result shares memory with their first argument: an in-place call on either side changes both.
_VIEW_METHODS = frozenset(
    {
        "view",
        "view_as",
        "reshape",
        "reshape_as",
        "flatten",
        "unflatten",
        "squeeze",
        "unsqueeze",
        "transpose",
        "permute",
        "t",
        "movedim",
        "narrow",
        "expand",
        "expand_as",
        "chunk",
        "split",
        "unbind",
        "select",
        "diagonal",
        "as_strided",
        "unfold",
        "swapaxes",
        "swapdims",
        "__getitem__",
        "detach",
        "contiguous",
        "real",
        "imag",
    }
)
_VIEW_FUNCTIONS = frozenset(
    {
        operator.getitem,
        torch.reshape,
        torch.flatten,
        torch.squeeze,
        torch.unsqueeze,
        torch.transpose,
        torch.permute,
        torch.movedim,
        torch.narrow,
        torch.chunk,
        torch.split,
        torch.unbind,
        torch.select,
        torch.t,
        torch.detach,
        torch.swapaxes,
        torch.diagonal,
    }
)
_VIEW_MODULES = (nn.Identity, nn.Flatten, nn.Unflatten, nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d)


def _is_view(node: fx.Node, modules: dict[str, nn.Module]) -> bool:
    if node.op == "call_method":
        return str(node.target) in _VIEW_METHODS
    if node.op == "call_function":
        return node.target in _VIEW_FUNCTIONS
    if node.op == "call_module":
        return isinstance(modules.get(str(node.target)), _VIEW_MODULES)
    return False


def _out_of_place(node: fx.Node, modules: dict[str, nn.Module]) -> Callable[[], None] | None:
    """How to make ``node`` out-of-place (applied later), or None when it writes into no argument."""
    if node.op == "call_module":
        module = modules.get(str(node.target))
        if getattr(module, "inplace", None) is True and isinstance(module, nn.Module):
            return lambda: setattr(module, "inplace", False)
        return None
    if node.op == "call_function":
        if node.kwargs.get("inplace") is True:
            return lambda: node.update_kwarg("inplace", False)
        replacement = _OUT_OF_PLACE_OPERATORS.get(node.target) if callable(node.target) else None
        name = getattr(node.target, "__name__", "")
        if replacement is None and name.endswith("_") and not name.endswith("__"):
            for namespace in (torch, F):
                if getattr(namespace, name, None) is node.target:
                    replacement = getattr(namespace, name[:-1], None)
                    break
        if replacement is None:
            return None
        chosen = replacement
        return lambda: setattr(node, "target", chosen)
    if node.op == "call_method":
        name = str(node.target)
        if name.endswith("_") and not name.endswith("__") and hasattr(torch.Tensor, name[:-1]):
            return lambda: setattr(node, "target", name[:-1])
    return None


def _aliased(target: fx.Node, call: fx.Node, order: dict[fx.Node, int], modules: dict[str, nn.Module]) -> bool:
    """Whether ``target`` is a view, or has a view taken before ``call`` (then writing into it shows elsewhere)."""
    if _is_view(target, modules) or not isinstance(target, fx.Node):
        return True
    return any(_is_view(user, modules) and order[user] < order[call] for user in target.users)


def functionalize(gm: fx.GraphModule) -> fx.GraphModule:
    """Make ``gm``'s in-place calls on unaliased tensors out-of-place, keeping what every reader reads."""
    modules = dict(gm.named_modules())
    nodes = list(gm.graph.nodes)
    order = {node: i for i, node in enumerate(nodes)}
    # A module called in place at several sites changes for all of them: only when each site can.
    plans: dict[fx.Node, Callable[[], None]] = {}
    blocked_modules: set[str] = set()
    for node in nodes:
        change = _out_of_place(node, modules)
        if change is None or not node.args or not isinstance(node.args[0], fx.Node):
            continue
        if _aliased(node.args[0], node, order, modules):
            if node.op == "call_module":
                blocked_modules.add(str(node.target))
            continue
        plans[node] = change
    changed = False
    for node, change in plans.items():
        if node.op == "call_module" and str(node.target) in blocked_modules:
            continue
        target = typing.cast(fx.Node, node.args[0])  # checked when planned
        for user in list(target.users):
            if user is not node and order[user] > order[node]:
                user.replace_input_with(target, node)
        change()
        changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()
    return gm
