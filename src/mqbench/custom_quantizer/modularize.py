"""Functional convolutions and Linears on a model's own parameters made modules before anything is swapped.

A model may call ``F.conv2d(x, self.weight, self.bias, padding=1)`` or ``F.linear(x, self.w)``
on parameters it holds instead of an ``nn.Conv2d`` / ``nn.Linear``. Module swapping gives only
modules a weight quantizer, so such a layer would be deployed with float weights, between
quantized activations: an integer runtime then quantizes those weights its own way, and the
deployment no longer computes what was simulated.

:func:`modularize` replaces each such call whose weight (and bias, if any) is a parameter of
the model and whose other arguments are constants by a call to an equivalent module holding the
same parameter objects, so that it is fused, swapped and given a weight quantizer like any
other layer of its kind.

Example:
    >>> import torch
    >>> import torch.nn.functional as F
    >>> from torch import fx, nn
    >>> class Model(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.w = nn.Parameter(torch.randn(4, 3, 3, 3))
    ...     def forward(self, x):
    ...         return F.conv2d(x, self.w, padding=1)
    >>> gm = modularize(fx.symbolic_trace(Model()))
    >>> [(n.op, n.target) for n in gm.graph.nodes][1], gm.w_conv2d.weight is gm.w
    (('call_module', 'w_conv2d'), True)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.nn.functional as F
from torch import fx, nn

__all__ = ["modularize"]

_CONVOLUTIONS: dict[Callable[..., Any], type[nn.Module]] = {
    F.conv1d: nn.Conv1d,
    F.conv2d: nn.Conv2d,
    F.conv3d: nn.Conv3d,
}
_CONV_ARGUMENTS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
_LINEAR_ARGUMENTS = ("input", "weight", "bias")


def _parameter(gm: fx.GraphModule, value: Any) -> nn.Parameter | None:
    if not isinstance(value, fx.Node) or value.op != "get_attr":
        return None
    try:
        found = gm.get_parameter(str(value.target))
    except AttributeError:
        return None
    return found if isinstance(found, nn.Parameter) else None


def _bound(node: fx.Node, names: tuple[str, ...]) -> dict[str, Any] | None:
    if len(node.args) > len(names) or any(key not in names for key in node.kwargs):
        return None
    return {**dict(zip(names, node.args, strict=False)), **node.kwargs}


def _module(gm: fx.GraphModule, node: fx.Node) -> nn.Module | None:
    """The module that computes ``node`` with the model's own parameters, or None."""
    if node.op != "call_function" or (node.target not in _CONVOLUTIONS and node.target is not F.linear):
        return None
    names = _LINEAR_ARGUMENTS if node.target is F.linear else _CONV_ARGUMENTS
    arguments = _bound(node, names)
    if arguments is None:
        return None
    weight = _parameter(gm, arguments.get("weight"))
    bias_node = arguments.get("bias")
    bias = _parameter(gm, bias_node)
    if weight is None or (bias_node is not None and bias is None):
        return None
    settings = {key: arguments[key] for key in names[3:] if key in arguments}
    if any(isinstance(value, fx.Node) for value in settings.values()):
        return None  # a stride or padding computed at run time
    module: nn.Module
    if node.target is F.linear:
        if weight.dim() != 2:
            return None
        module = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    else:
        groups = int(settings.get("groups", 1))
        if weight.dim() < 3:
            return None
        module = _CONVOLUTIONS[
            node.target
        ](  # type: ignore[index]
            weight.shape[1] * groups,
            weight.shape[0],
            tuple(weight.shape[2:]),
            stride=settings.get("stride", 1),
            padding=settings.get("padding", 0),
            dilation=settings.get("dilation", 1),
            groups=groups,
            bias=bias is not None,
        )
    module.weight = weight
    if bias is not None:
        module.bias = bias
    return module.to(weight.device)


def modularize(gm: fx.GraphModule) -> fx.GraphModule:
    """Replace (in place) each functional convolution / Linear on the model's own parameters by a module."""
    changed = False
    for node in list(gm.graph.nodes):
        module = _module(gm, node)
        if module is None:
            continue
        weight = node.args[1] if len(node.args) > 1 else node.kwargs["weight"]
        base = f"{str(weight.target).replace('.', '_')}_{getattr(node.target, '__name__', 'layer')}"
        name, index = base, 0
        while hasattr(gm, name):
            index += 1
            name = f"{base}_{index}"
        gm.add_submodule(name, module)
        source = node.args[0] if node.args else node.kwargs["input"]
        with gm.graph.inserting_before(node):
            call = gm.graph.call_module(name, (source,))
        call.meta = dict(node.meta)
        node.replace_all_uses_with(call)
        gm.graph.erase_node(node)
        changed = True
    if changed:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return gm
