"""Weights held by several modules (tied embeddings): what algorithms that change weights in place must know.

Example:
    >>> from torch import nn
    >>> embed, head = nn.Embedding(10, 4), nn.Linear(4, 10, bias=False)
    >>> head.weight = embed.weight  # tied, as small language models are
    >>> shared_weights(nn.ModuleDict({"embed": embed, "head": head, "other": nn.Linear(4, 4)}))
    {'embed': ('head',), 'head': ('embed',)}
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, fx, nn

__all__ = ["shared_weights"]


def shared_weights(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """The modules of ``model`` whose ``weight`` is one tensor with another module's (tied embeddings: the output
    layer's weight is the embedding table), each with the names of the others holding it. An algorithm that changes
    a weight in place changes it for all of them."""
    holders: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        weight = getattr(module, "weight", None)
        if isinstance(weight, Tensor):
            holders.setdefault(id(weight), []).append(name)
    if isinstance(model, fx.GraphModule):  # a graph may read a module's weight as a value (an embedding function)
        for node in model.graph.nodes:
            if node.op == "get_attr" and node.users:
                value = _attribute(model, str(node.target))
                if isinstance(value, Tensor) and id(value) in holders:
                    holders[id(value)].append(f"{node.name} (read by {', '.join(u.name for u in node.users)})")
    return {
        name: tuple(other for other in names if other != name)
        for names in holders.values()
        if len(set(names)) > 1
        for name in names
    }


def _attribute(model: nn.Module, target: str) -> Any:
    value: Any = model
    for part in target.split("."):
        value = getattr(value, part, None)
    return value
