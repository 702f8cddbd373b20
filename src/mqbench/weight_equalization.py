"""MQBench's data-free cross-layer weight equalization (``mqbench.weight_equalization``).

For two layers in a row (the second reading the first's output channels one by one, through
ReLU-like activations), scaling channel ``i`` of the first by ``1 / s_i`` and input ``i`` of the
second by ``s_i`` leaves the model's function unchanged; ``s_i = sqrt(r1_i r2_i) / r2_i`` makes
both weight ranges ``sqrt(r1_i r2_i)``, which suits per-tensor weight grids (Nagel et al., 2019).
:func:`mqbench.advanced_ptq.cross_layer_equalization` applies it to every eligible pair of a
prepared model.

Example:
    >>> import torch
    >>> from mqbench.weight_equalization import dfq_weight_equalization
    >>> w1, b1, w2 = torch.tensor([[4.0], [0.25]]), torch.tensor([1.0, 1.0]), torch.tensor([[1.0, 4.0]])
    >>> w1, b1, w2, s = dfq_weight_equalization(w1, b1, w2)
    >>> w1.flatten().tolist(), w2.flatten().tolist(), s.tolist()
    ([2.0, 1.0], [2.0, 1.0], [2.0, 0.25])
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, fx, nn

from mqbench.advanced_ptq.correction import _LAYERS, _POOLS, equalization_pairs, equalize_pair
from mqbench.fake_quantize.quantize_base import QuantizeBase

__all__ = [
    "ACT_TYPES",
    "COLLECT_TYPES",
    "FAKE_QUANT_TYPE",
    "POOL_TYPES",
    "dfq_weight_equalization",
    "get_weight_equalization_groups",
    "weight_equalize_conv_pair",
]

# The types MQBench's equalization walk reads, as this package's walk (mqbench.advanced_ptq.equalization_pairs)
# reads them: the layers it pairs, the activations and pooling layers a pair may have between its two layers, and
# the fake quantizers it passes over.
COLLECT_TYPES = list(_LAYERS)
ACT_TYPES = [nn.ReLU]
POOL_TYPES = list(_POOLS)
FAKE_QUANT_TYPE = [QuantizeBase]


@torch.no_grad()
def dfq_weight_equalization(
    weight_1: Tensor, bias_1: Tensor | None, weight_2: Tensor, s_min: float = 1e-6, s_max: float = 1e6, eps: float = 0
) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
    """Equalize two weights in place: output channels of ``weight_1`` (axis 0) with inputs of ``weight_2`` (axis 1).

    Returns ``(weight_1, bias_1, weight_2, s)``; ``s`` is clipped to ``[s_min, s_max]`` and is 1 for
    a channel whose range is 0 in either weight (``eps`` is added to ``r2`` before dividing).
    """
    channels = weight_1.shape[0]
    if weight_2.dim() < 2 or weight_2.shape[1] != channels:
        raise ValueError(
            f"weight_2 of shape {list(weight_2.shape)} does not read the {channels} output channels of weight_1 "
            "along axis 1 (for a depthwise layer, equalize with mqbench.advanced_ptq.cross_layer_equalization)"
        )
    r1 = weight_1.reshape(channels, -1).abs().amax(1)
    r2 = weight_2.transpose(0, 1).reshape(channels, -1).abs().amax(1)
    usable = (r1 > 0) & (r2 > 0)
    scale = torch.where(usable, torch.sqrt(r1 * r2) / (r2 + eps), torch.ones_like(r1)).clamp(s_min, s_max)
    weight_1.div_(scale.reshape([-1] + [1] * (weight_1.dim() - 1)))
    if bias_1 is not None:
        bias_1.div_(scale)
    weight_2.mul_(scale.reshape([1, -1] + [1] * (weight_2.dim() - 2)))
    return weight_1, bias_1, weight_2, scale


def weight_equalize_conv_pair(modules: Mapping[str, nn.Module], weq_pair: Sequence[Any]) -> Tensor:
    """Equalize the two layers of ``weq_pair`` (their graph nodes, as MQBench passes them, or their module names in
    ``dict(model.named_modules())``), in place; the scales."""
    first, second = (modules[str(getattr(item, "target", item))] for item in weq_pair)
    return equalize_pair(first, second)


def get_weight_equalization_groups(model: fx.GraphModule, **kwargs: Any) -> list[list[str]]:
    """The pairs of layers (module names) cross-layer equalization applies to in a prepared model."""
    return [[str(a.target), str(b.target)] for a, b in _pair_nodes(model)]


def _pair_nodes(model: fx.GraphModule) -> list[tuple[fx.Node, fx.Node]]:
    nodes = {node.name: node for node in model.graph.nodes}
    return [(nodes[a], nodes[b]) for a, b, _, _ in equalization_pairs(model)]
