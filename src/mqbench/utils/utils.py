"""MQBench's ``mqbench.utils.utils`` helpers, on current PyTorch.

Example:
    >>> import torch
    >>> from mqbench.utils.utils import deepcopy_graphmodule, is_symmetric_quant
    >>> gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    >>> copied = deepcopy_graphmodule(gm)
    >>> copied.graph is not gm.graph and str(copied.graph) == str(gm.graph)
    True
    >>> is_symmetric_quant(torch.per_channel_symmetric)
    True
"""

from __future__ import annotations

import contextlib
import copy
import operator
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, fx, nn

__all__ = [  # and USE_DDP, computed when read
    "USE_LINK",
    "deepcopy_graphmodule",
    "deepcopy_mixedmodule",
    "get_flattened_qconfig_dict",
    "getitem2node",
    "is_symmetric_quant",
    "is_tracing_state",
    "no_jit_trace",
    "pot_quantization",
    "replace_bn_to_syncbn",
    "sync_tensor",
    "topology_order",
]

USE_LINK = False  # MQBench's flag for SenseTime's "linklink" communication library, which this package never uses


def __getattr__(name: str) -> Any:
    if name == "USE_DDP":  # whether a torch.distributed process group is running (read when asked)
        return dist.is_available() and dist.is_initialized()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def deepcopy_graphmodule(gm: fx.GraphModule) -> fx.GraphModule:
    """A deep copy of ``gm`` with its own graph (its modules, parameters and graph all copied)."""
    copied = copy.deepcopy(gm)
    copied.graph = copy.deepcopy(gm.graph)
    copied.recompile()
    return copied


def deepcopy_mixedmodule(mm: nn.Module, module_list: Sequence[str]) -> nn.Module:
    """A deep copy of ``mm`` whose children named in ``module_list`` are GraphModules with their own graphs."""
    copied = copy.deepcopy(mm)
    for name in module_list:
        child = mm.get_submodule(name)
        if isinstance(child, fx.GraphModule):
            parent_name, _, leaf = name.rpartition(".")
            setattr(copied.get_submodule(parent_name) if parent_name else copied, leaf, deepcopy_graphmodule(child))
    return copied


def is_symmetric_quant(qscheme: torch.qscheme) -> bool:
    return qscheme in (torch.per_tensor_symmetric, torch.per_channel_symmetric)


def sync_tensor(tensor: Tensor) -> Tensor:
    """Average ``tensor`` over the processes of a running torch.distributed group (in place); as is otherwise."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor)
        tensor.div_(dist.get_world_size())
    return tensor


def pot_quantization(tensor: Tensor, mode: str = "round") -> Tensor:
    """``tensor`` rounded to a power of two (``round`` or ``floor`` of log2), gradients passed straight through."""
    if mode not in ("round", "floor"):
        raise ValueError(f"mode must be 'round' or 'floor', got {mode!r}")
    log2 = torch.log2(tensor)
    rounded = torch.round(log2) if mode == "round" else torch.floor(log2)
    return (2**rounded - tensor).detach() + tensor


@contextlib.contextmanager
def no_jit_trace() -> Iterator[None]:
    """Code in this block is not recorded by ``torch.jit.trace`` (``torch.onnx.export``'s default path)."""
    state = torch._C._get_tracing_state()
    torch._C._set_tracing_state(None)  # type: ignore[attr-defined]
    try:
        yield
    finally:
        torch._C._set_tracing_state(state)  # type: ignore[attr-defined]


def is_tracing_state() -> bool:
    return torch._C._get_tracing_state() is not None


def topology_order(model: fx.GraphModule) -> dict[fx.Node, int]:
    """Each node of the graph and its position in the graph's (topological) order."""
    return {node: index for index, node in enumerate(model.graph.nodes)}


def getitem2node(model: fx.GraphModule) -> dict[fx.Node, fx.Node]:
    """``x[key]`` nodes of a dict built in the graph (``d.update({...})`` / ``dict(...)``), to the node stored there."""
    stored: dict[tuple[fx.Node, Any], fx.Node] = {}
    for node in model.graph.nodes:
        if node.op == "call_method" and node.target == "update" and len(node.args) > 1:
            for key, value in dict(node.args[1]).items() if isinstance(node.args[1], Mapping) else ():
                if isinstance(value, fx.Node):
                    stored[(node.args[0], key)] = value
        if node.op == "call_function" and node.target is dict:
            for key, value in node.kwargs.items():
                if isinstance(value, fx.Node):
                    stored[(node, key)] = value
    found: dict[fx.Node, fx.Node] = {}
    for node in model.graph.nodes:
        if node.op == "call_function" and node.target is operator.getitem:
            source, key = node.args[0], node.args[1]
            if (source, key) in stored:
                found[node] = stored[(source, key)]
    return found


def get_flattened_qconfig_dict(qconfig_dict: Mapping[str, Any]) -> dict[Any, Any]:
    """PyTorch's old qconfig dict (``""``, ``object_type``, ``module_name`` entries) as one key -> qconfig map."""
    flattened: dict[Any, Any] = {}
    if "" in qconfig_dict:
        flattened[""] = qconfig_dict[""]
    for section in ("object_type", "module_name"):
        for key, qconfig in qconfig_dict.get(section, []):
            flattened[key] = qconfig
    return flattened


def replace_bn_to_syncbn(model: nn.Module, custom_bn_type: Sequence[type] | None = None) -> nn.Module:
    """Every BatchNorm of ``model`` replaced, in place, by ``torch.nn.SyncBatchNorm`` with its state (DDP training)."""
    types = tuple(custom_bn_type or (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d))
    for name, child in list(model.named_children()):
        if isinstance(child, types) and not isinstance(child, nn.SyncBatchNorm):
            setattr(model, name, nn.SyncBatchNorm.convert_sync_batchnorm(child))
        else:
            replace_bn_to_syncbn(child, custom_bn_type)
    return model
