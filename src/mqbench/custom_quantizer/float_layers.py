"""Layers a backend leaves float by their role in the model (``BackendSpec.float_layers``).

LLM runtimes keep a language model's embedding tables and its projection onto the vocabulary (``lm_head``) in
16-bit: the output layer is the most sensitive one (its errors go straight into every token's probability), and
in small models it is often the embedding table itself (tied weights), which a gather reads row by row.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from mqbench.utils.tracer import trace
    >>> class TinyLM(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.embed, self.mlp, self.head = nn.Embedding(50, 8), nn.Linear(8, 8), nn.Linear(8, 50)
    ...     def forward(self, ids):
    ...         return self.head(self.mlp(self.embed(ids)))
    >>> gm = trace(TinyLM())
    >>> {node.name: role for node, role in float_layer_roles(gm, ("lm_head", "embedding")).items()}
    {'embed': 'embedding', 'head': 'lm_head'}
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence

from torch import fx, nn

from mqbench.custom_quantizer.plan import plan_of

__all__ = ["FLOAT_LAYER_REASONS", "float_layer_reason", "float_layer_roles", "float_layers_of"]

FLOAT_LAYER_REASONS: Mapping[str, str] = {
    "lm_head": "a language model's output projection (lm_head), float on this backend as LLM runtimes keep it",
    "embedding": "an embedding table, float on this backend as LLM runtimes keep it",
}
_HINT = "; prepare_custom_config_dict['float_layers'] = [] quantizes it"

# ops between an output layer and the model's output that only select, reshape or cast its values
_PASSING = {"getitem", "view", "reshape", "float", "to", "contiguous", "tree_unflatten", "squeeze", "unsqueeze"}


def _passes(node: fx.Node) -> bool:
    if node.op == "call_method":
        return str(node.target) in _PASSING
    if node.op == "call_function":
        if node.target is operator.getitem:
            return True
        name = getattr(node.target, "__name__", "")
        packet = getattr(node.target, "_opname", None)
        return name in _PASSING or packet in _PASSING or node.target in (dict, tuple, list)
    return False


def _writes_output(node: fx.Node) -> bool:
    pending, seen = list(node.users), set()
    while pending:
        user = pending.pop()
        if user in seen:
            continue
        seen.add(user)
        if user.op == "output":
            return True
        if _passes(user):
            pending.extend(user.users)
    return False


def float_layer_roles(gm: fx.GraphModule, roles: Sequence[str]) -> dict[fx.Node, str]:
    """The ``call_module`` nodes of ``gm`` having one of ``roles`` (``"lm_head"``, ``"embedding"``), with it."""
    if not roles:
        return {}
    modules = dict(gm.named_modules())
    tables = [m for m in modules.values() if isinstance(m, nn.Embedding)]
    found: dict[fx.Node, str] = {}
    for node in gm.graph.nodes:
        module = modules.get(str(node.target)) if node.op == "call_module" else None
        if isinstance(module, nn.Embedding) and "embedding" in roles:
            found[node] = "embedding"
        elif (
            isinstance(module, nn.Linear)
            and "lm_head" in roles
            and _is_lm_head(module, tables)
            and _writes_output(node)
        ):
            found[node] = "lm_head"
    return found


def _is_lm_head(layer: nn.Linear, tables: list[nn.Embedding]) -> bool:
    """A projection onto the token vocabulary: its weight is an embedding table (tied), or it is as wide as the
    largest table of its input width (the tokens', not a position or token-type table's)."""
    if any(layer.weight is table.weight for table in tables):
        return True
    widths = [table.num_embeddings for table in tables if table.embedding_dim == layer.in_features]
    return bool(widths) and layer.out_features == max(widths)


def float_layer_reason(role: str) -> str:
    """Why a layer of ``role`` stays float, and how to quantize it."""
    return FLOAT_LAYER_REASONS[role] + _HINT


def float_layers_of(model: fx.GraphModule) -> dict[str, str]:
    """The layers a prepared ``model`` left float by their role (``BackendSpec.float_layers``), each with its role,
    as its quantization plan recorded them."""
    plan = plan_of(model)
    if plan is None:
        return {}
    reasons = {float_layer_reason(role): role for role in FLOAT_LAYER_REASONS}
    return {
        str(node.target): reasons[decision.reason]
        for node in model.graph.nodes
        if node.op == "call_module"
        and (decision := plan.decisions.get(node.name)) is not None
        and decision.reason in reasons
    }
