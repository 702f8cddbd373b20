"""Functional convolutions, Linears and batch norms on a model's own parameters made modules before anything
is swapped.

A model may call ``F.conv2d(x, self.weight, self.bias, padding=1)`` or ``F.linear(x, self.w)``
on parameters it holds instead of an ``nn.Conv2d`` / ``nn.Linear``. Module swapping gives only
modules a weight quantizer, so such a layer would be deployed with float weights, between
quantized activations: an integer runtime then quantizes those weights its own way, and the
deployment no longer computes what was simulated.

:func:`modularize` replaces each such call whose weight (and bias, if any) is a parameter of
the model and whose other arguments are constants by a call to an equivalent module holding the
same parameter objects, so that it is fused, swapped and given a weight quantizer like any
other layer of its kind.

Batch norms likewise: a module that subclasses ``nn.BatchNorm2d`` and adds to its forward
(a norm with its activation in one module, as timm's ``BatchNormAct2d``) is traced into
``F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, ...)``. Left
functional, it is never folded into the convolution before it: the deployment keeps a float
batch norm after an int8 convolution (a layout that OpenVINO's CPU plugin computes wrongly after a
depthwise one), and the trace's constant ``training`` flag would outlive ``model.eval()``. It
becomes a plain batch norm module on the same parameters and statistics, which follows the
model's mode and is folded like any other.

Example:
    >>> import torch
    >>> import torch.nn.functional as F
    >>> from torch import Tensor, fx, nn
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
from torch import Tensor, fx, nn

from mqbench.custom_quantizer.passes import has_side_effects

__all__ = ["modularize"]

_CONVOLUTIONS: dict[Callable[..., Any], type[nn.Module]] = {
    F.conv1d: nn.Conv1d,
    F.conv2d: nn.Conv2d,
    F.conv3d: nn.Conv3d,
}
_CONV_ARGUMENTS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
_LINEAR_ARGUMENTS = ("input", "weight", "bias")
_NORM_ARGUMENTS = ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps")
_NORMS: tuple[type[nn.Module], ...] = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def _parameter(gm: fx.GraphModule, value: Any) -> nn.Parameter | None:
    if not isinstance(value, fx.Node) or value.op != "get_attr":
        return None
    try:
        found = gm.get_parameter(str(value.target))
    except AttributeError:
        return None
    return found if isinstance(found, nn.Parameter) else None


def _buffer(gm: fx.GraphModule, value: Any) -> Tensor | None:
    if not isinstance(value, fx.Node) or value.op != "get_attr":
        return None
    try:
        return gm.get_buffer(str(value.target))
    except AttributeError:
        return None


def _norm_kind(gm: fx.GraphModule, node: fx.Node, statistics: fx.Node) -> type[nn.Module] | None:
    """The batch norm class of ``node``: that of the module holding its statistics, else the rank of the
    convolution module whose output it normalizes; None when neither says."""
    owner_name = str(statistics.target).rpartition(".")[0]
    owner = gm.get_submodule(owner_name) if owner_name else gm
    for kind in _NORMS:
        if isinstance(owner, kind):
            return kind
    source = node.args[0] if node.args else node.kwargs.get("input")
    if isinstance(source, fx.Node) and source.op == "call_module":
        producer = gm.get_submodule(str(source.target))
        for conv, kind in zip((nn.Conv1d, nn.Conv2d, nn.Conv3d), _NORMS, strict=True):
            if isinstance(producer, conv):
                return kind
    return None


def _norm_module(gm: fx.GraphModule, node: fx.Node) -> nn.Module | None:
    """A batch norm module on the statistics and affine parameters ``F.batch_norm`` reads, or None."""
    arguments = _bound(node, _NORM_ARGUMENTS)
    if arguments is None:
        return None
    mean, var = _buffer(gm, arguments.get("running_mean")), _buffer(gm, arguments.get("running_var"))
    weight_node, bias_node = arguments.get("weight"), arguments.get("bias")
    weight, bias = _parameter(gm, weight_node), _parameter(gm, bias_node)
    if mean is None or var is None or (weight_node is None) != (bias_node is None):
        return None
    if (weight_node is not None and weight is None) or (bias_node is not None and bias is None):
        return None
    momentum, eps = arguments.get("momentum", 0.1), arguments.get("eps", 1e-5)
    if not isinstance(momentum, (int, float, type(None))) or not isinstance(eps, (int, float)):
        return None  # computed at run time
    if not isinstance(arguments.get("training", False), bool) or mean.dim() != 1 or var.shape != mean.shape:
        return None
    kind = _norm_kind(gm, node, arguments["running_mean"])
    if kind is None:
        return None
    owner = gm.get_submodule(str(arguments["running_mean"].target).rpartition(".")[0] or "")
    if isinstance(owner, nn.modules.batchnorm._BatchNorm):
        momentum = owner.momentum  # the traced value may be a cumulative-average factor of one step
    module = kind(mean.shape[0], eps=float(eps), momentum=momentum, affine=weight is not None)
    if weight is not None and bias is not None:
        module.weight, module.bias = weight, bias
    module.running_mean, module.running_var = mean, var
    counted = getattr(owner, "num_batches_tracked", None)
    if isinstance(counted, Tensor):
        module.num_batches_tracked = counted
    return module.to(mean.device)


def _bound(node: fx.Node, names: tuple[str, ...]) -> dict[str, Any] | None:
    if len(node.args) > len(names) or any(key not in names for key in node.kwargs):
        return None
    return {**dict(zip(names, node.args, strict=False)), **node.kwargs}


def _module(gm: fx.GraphModule, node: fx.Node) -> nn.Module | None:
    """The module that computes ``node`` with the model's own parameters, or None."""
    if node.op == "call_function" and node.target is F.batch_norm:
        return _norm_module(gm, node)
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
    """Replace (in place) each functional convolution / Linear / batch norm on the model's own parameters by a
    module."""
    changed = False
    for node in list(gm.graph.nodes):
        module = _module(gm, node)
        if module is None:
            continue
        held = (
            node.args[1]
            if len(node.args) > 1
            else node.kwargs["running_mean" if isinstance(module, _NORMS) else "weight"]
        )
        owner = str(held.target).rpartition(".")[0] if isinstance(module, _NORMS) else str(held.target)
        base = f"{owner.replace('.', '_') or 'model'}_{getattr(node.target, '__name__', 'layer')}"
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
        gm.graph.eliminate_dead_code(is_impure_node=has_side_effects)
        gm.recompile()
    return gm
