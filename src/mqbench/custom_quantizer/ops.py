"""Map torch.fx nodes to the op kinds that placement rules speak of.

Example:
    >>> import torch
    >>> from torch import fx, nn
    >>> from mqbench.custom_quantizer.ops import node_kind
    >>> gm = fx.symbolic_trace(nn.Sequential(nn.Conv2d(1, 1, 1), nn.ReLU()))
    >>> [node_kind(n, dict(gm.named_modules())) for n in gm.graph.nodes]
    [None, 'conv', 'relu', None]
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from mqbench.nn.modules.norms import norm_of

__all__ = [
    "FUNCTION_KINDS",
    "IDENTITY_FUNCTIONS",
    "IDENTITY_METHODS",
    "IDENTITY_MODULES",
    "METHOD_KINDS",
    "MODULE_KINDS",
    "WEIGHTED_KINDS",
    "edge_layers",
    "is_identity",
    "node_kind",
]

WEIGHTED_KINDS = frozenset({"conv", "linear", "deconv"})

MODULE_KINDS: dict[type, str] = {
    nn.Conv1d: "conv",
    nn.Conv2d: "conv",
    nn.Conv3d: "conv",
    nn.Linear: "linear",
    nn.ConvTranspose1d: "deconv",
    nn.ConvTranspose2d: "deconv",
    nn.ConvTranspose3d: "deconv",
    nn.MaxPool1d: "pool",
    nn.MaxPool2d: "pool",
    nn.MaxPool3d: "pool",
    nn.AvgPool1d: "pool",
    nn.AvgPool2d: "pool",
    nn.AvgPool3d: "pool",
    nn.AdaptiveAvgPool1d: "pool",
    nn.AdaptiveAvgPool2d: "pool",
    nn.AdaptiveAvgPool3d: "pool",
    nn.AdaptiveMaxPool2d: "pool",
    nn.Upsample: "interpolate",
    nn.ReLU: "relu",
    nn.ReLU6: "relu",
    nn.BatchNorm1d: "bn",
    nn.BatchNorm2d: "bn",
    nn.BatchNorm3d: "bn",
    nn.Flatten: "flatten",
    nn.Dropout: "dropout",
    nn.Dropout2d: "dropout",
    nn.Hardswish: "hardswish",
    nn.Sigmoid: "sigmoid",
    nn.Hardsigmoid: "sigmoid",
    nn.Embedding: "embedding",
    nn.LayerNorm: "layernorm",
    nn.RMSNorm: "layernorm",
    nn.Softmax: "softmax",
    nn.GELU: "gelu",
}

FUNCTION_KINDS: dict[Callable[..., Any], str] = {
    F.conv1d: "conv",
    F.conv2d: "conv",
    F.conv3d: "conv",
    F.linear: "linear",
    F.conv_transpose2d: "deconv",
    F.max_pool2d: "pool",
    F.avg_pool2d: "pool",
    F.adaptive_avg_pool2d: "pool",
    F.adaptive_max_pool2d: "pool",
    operator.add: "add",
    operator.iadd: "add",
    torch.add: "add",
    operator.mul: "mul",
    operator.imul: "mul",
    torch.mul: "mul",
    operator.matmul: "matmul",
    torch.matmul: "matmul",
    torch.bmm: "matmul",
    torch.cat: "concat",
    torch.concat: "concat",
    F.interpolate: "interpolate",
    F.relu: "relu",
    F.relu6: "relu",
    torch.relu: "relu",
    torch.flatten: "flatten",
    F.dropout: "dropout",
    F.hardswish: "hardswish",
    torch.sigmoid: "sigmoid",
    F.sigmoid: "sigmoid",
    F.hardsigmoid: "sigmoid",
    F.layer_norm: "layernorm",
    F.rms_norm: "layernorm",
    F.softmax: "softmax",
    torch.softmax: "softmax",
    F.gelu: "gelu",
    torch.reshape: "reshape",
}

METHOD_KINDS: dict[str, str] = {
    "add": "add",
    "add_": "add",
    "mul": "mul",
    "mul_": "mul",
    "matmul": "matmul",
    "relu": "relu",
    "relu_": "relu",
    "sigmoid": "sigmoid",
    "softmax": "softmax",
    "flatten": "flatten",
    "view": "reshape",
    "reshape": "reshape",
}


# Ops that return their first input unchanged in a deployed (eval-mode) model: the ONNX exporter
# drops them, so their output is the same tensor as their input. Quantizers on both must be one.
IDENTITY_MODULES: tuple[type, ...] = (
    nn.Identity,
    nn.Dropout,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.Dropout3d,
    nn.AlphaDropout,
    nn.FeatureAlphaDropout,
)
IDENTITY_FUNCTIONS: frozenset[Callable[..., Any]] = frozenset(
    {
        F.dropout,
        F.dropout1d,
        F.dropout2d,
        F.dropout3d,
        F.alpha_dropout,
        F.feature_alpha_dropout,
        torch.clone,
        torch.detach,
    }
)
IDENTITY_METHODS = frozenset({"contiguous", "clone", "detach"})


def is_identity(node: fx.Node, modules: Mapping[str, nn.Module]) -> bool:
    """Whether ``node`` passes its first input through unchanged at deploy time (Identity, Dropout, clone ...)."""
    if not node.args or not isinstance(node.args[0], fx.Node):
        return False
    if node.op == "call_module":
        module = modules.get(str(node.target))
        return type(module) in IDENTITY_MODULES
    if node.op == "call_function":
        return node.target in IDENTITY_FUNCTIONS
    if node.op == "call_method":
        return node.target in IDENTITY_METHODS
    return False


def node_kind(node: fx.Node, modules: Mapping[str, nn.Module]) -> str | None:
    """The op kind of ``node``, or None for placeholders, outputs, attributes and unknown ops."""
    if node.op == "call_module":
        module = modules[str(node.target)]
        declared = getattr(module, "op_kind", None)  # fused and QAT modules declare their kind
        if isinstance(declared, str):
            return declared
        for cls in type(module).__mro__:
            kind = MODULE_KINDS.get(cls)
            if kind is not None:
                return kind
        return "layernorm" if _is_norm_class(module) else None
    if node.op == "call_function":
        return FUNCTION_KINDS.get(node.target)  # type: ignore[arg-type]
    if node.op == "call_method":
        return METHOD_KINDS.get(str(node.target))
    return None


_NORM_CLASSES: dict[type[nn.Module], bool] = {}  # a class outside torch.nn: whether it normalizes (probed once)


def _is_norm_class(module: nn.Module) -> bool:
    """Whether ``module``'s class is a norm over the last dimension that torch.nn does not define (``LlamaRMSNorm``,
    a model family's own class; see :func:`mqbench.nn.modules.norms.norm_of`): one of its instances decides."""
    kind = type(module)
    if kind not in _NORM_CLASSES:
        _NORM_CLASSES[kind] = norm_of(module) is not None
    return _NORM_CLASSES[kind]


def normalizes_layers(model: fx.GraphModule) -> bool:
    """Whether ``model`` normalizes its layers: a LayerNorm, an RMSNorm or a model family's own norm class
    (``LlamaRMSNorm``, ...), a transformer's mark. Its residual stream carries outlier channels, which the backends'
    transformer defaults keep (``BackendSpec.transformer_recipe``, ``BackendSpec.transformer_activation``)."""
    modules = dict(model.named_modules())
    return any(node_kind(node, modules) == "layernorm" for node in model.graph.nodes)


def edge_layers(graph: fx.Graph, modules: Mapping[str, nn.Module]) -> set[fx.Node]:
    """The first and the last weighted layer in graph order (kept 8-bit where a backend asks)."""
    weighted = [node for node in graph.nodes if node_kind(node, modules) in WEIGHTED_KINDS]
    return {weighted[0], weighted[-1]} if weighted else set()
