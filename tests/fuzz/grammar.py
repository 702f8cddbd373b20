"""A seeded grammar of the graphs users write: image CNNs and sequence/attention models, as nn.Modules.

``generate(seed, family)`` returns a :class:`~fuzz.builder.FuzzGraph`: the Python source of a
``Net(nn.Module)`` (``describe()`` prints it, runnable), its inputs and the grammar tags it uses.
Same seed -> same graph, same weights, same data.

Example:
    >>> graph = generate(3, "image")
    >>> graph == generate(3, "image")
    True
    >>> outputs = graph.build()(*graph.verify_inputs())
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fuzz import image_ops, sequence_ops
from fuzz.builder import Builder, FuzzGraph

__all__ = ["FAMILIES", "all_tags", "generate"]

FAMILIES = ("image", "sequence")

_FAMILY_BUILDERS: dict[str, Callable[[Builder], None]] = {
    "image": image_ops.build_image,
    "sequence": sequence_ops.build_sequence,
}


def generate(seed: int, family: str = "all") -> FuzzGraph:
    """The graph of ``seed``; ``family="all"`` takes image graphs for even seeds, sequence graphs for odd."""
    if family == "all":
        family = FAMILIES[seed % 2]
    if family not in _FAMILY_BUILDERS:
        raise ValueError(f"unknown family {family!r}; valid: {[*FAMILIES, 'all']}")
    with torch.random.fork_rng(), torch.no_grad(), torch.device("meta"):
        builder = Builder(seed, family)
        _FAMILY_BUILDERS[family](builder)
        return builder.finish(family)


def all_tags(family: str) -> frozenset[str]:
    """Every tag the grammar of ``family`` can produce (what the reachability test checks)."""
    return image_ops.TAGS if family == "image" else sequence_ops.TAGS
