"""What GPTQ and AWQ share: the linear layers of a prepared model, their weight grids and their inputs.

A layer here is a linear module of the prepared model (``nn.Linear`` or its QAT form) whose weight quantizer is
enabled and on a linear grid (per channel, or in groups of input channels). Layers reading the same graph value
(the query, key and value projections of one attention) form one *site*: they share their input statistics,
which leave out the padding of token batches given with an ``attention_mask`` (:func:`collect_inputs`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, fx, nn

from mqbench.advanced_ptq.pipeline import PIPELINE_DEFAULTS, Pipeline, token_mask, weights_quantized_only
from mqbench.advanced_ptq.smoothing import fresh_copy
from mqbench.fake_quantize.quantize_base import QuantizeBase
from mqbench.functional import from_groups, to_groups
from mqbench.utils.config import check_keys
from mqbench.utils.logger import logger
from mqbench.utils.state import calibrate_weights
from mqbench.utils.tied import shared_weights

__all__ = [
    "PIPELINE_DEFAULTS",
    "GridQParams",
    "Layer",
    "Pipeline",
    "Site",
    "calibrate_weights",
    "collect_inputs",
    "config_with",
    "fix_qparams",
    "grid_qparams",
    "linear_sites",
    "on_grid",
    "rtn",
    "token_mask",
    "weights_quantized_only",
]


@dataclass
class Layer:
    name: str
    module: nn.Linear
    quantizer: QuantizeBase
    node: fx.Node


@dataclass
class Site:
    """Linear layers reading one graph value, in graph order."""

    source: fx.Node
    layers: list[Layer] = field(default_factory=list)


def config_with(defaults: Mapping[str, Any], config: Mapping[str, Any] | None, what: str) -> dict[str, Any]:
    """``defaults`` updated with ``config`` (unknown keys are errors naming the valid ones)."""
    given = dict(config or {})
    check_keys(given, defaults, f"{what} config")
    return {**defaults, **given}


def linear_sites(model: nn.Module, names: Sequence[str] | None = None, what: str = "") -> list[Site]:
    """The sites of ``model`` (a prepared GraphModule), in graph order; ``names`` limits the layers."""
    if not isinstance(model, fx.GraphModule):
        raise ValueError(f"{what} takes the model prepare_by_platform returned, got {type(model).__name__}")
    modules = dict(model.named_modules())
    shared = shared_weights(model)
    sites: dict[fx.Node, Site] = {}
    found = set()
    for node in model.graph.nodes:
        module = modules.get(str(node.target)) if node.op == "call_module" else None
        if not isinstance(module, nn.Linear) or not node.args or not isinstance(node.args[0], fx.Node):
            continue
        quantizer = getattr(module, "weight_fake_quant", None)
        if not isinstance(quantizer, QuantizeBase) or quantizer.deploy_grid != "linear":
            continue
        if not quantizer._switch("fake_quant"):
            continue
        if names is not None and str(node.target) not in names:
            continue
        if str(node.target) in shared:  # rounding or scaling it in place would change the others too
            others = ", ".join(shared[str(node.target)])
            logger.warning("%s: %s shares its weight with %s (tied); left to its quantizer", what, node.target, others)
            continue
        found.add(str(node.target))
        site = sites.setdefault(node.args[0], Site(node.args[0]))
        site.layers.append(Layer(str(node.target), module, quantizer, node))
    if names is not None and set(names) - found:
        raise ValueError(
            f"{what}: {sorted(set(names) - found)} are not linear layers with an enabled weight quantizer; "
            f"those of this model: {sorted(str(n.target) for n in model.graph.nodes if n.op == 'call_module')[:20]}"
        )
    if not sites:
        raise ValueError(f"{what}: the model has no linear layer with an enabled weight quantizer on a linear grid")
    return list(sites.values())


def collect_inputs(
    model: nn.Module,
    cali_data: Any,
    layers: Sequence[Layer],
    reduce: Callable[[Layer, Tensor], None],
    weights: bool = True,
) -> None:
    """Run ``model`` on every calibration batch with the weights quantized (``weights``) or float, calling
    ``reduce(layer, rows)`` with each layer's input as rows ``[tokens, in_features]`` (float64).

    A batch given as a dict with an ``attention_mask`` ``[N, L]`` (padded token sequences, as a tokenizer returns
    them) contributes only the rows of its tokens, not of its padding, to layers whose input is ``[N, L, in]``
    (or ``[N * L, in]``): a padding position's values are computed but read by nothing the model returns.
    The whole model runs once per batch; :class:`~mqbench.advanced_ptq.pipeline.Pipeline` runs it block by block.
    """
    if not isinstance(model, fx.GraphModule):
        raise ValueError(f"collect_inputs takes the model prepare_by_platform returned, got {type(model).__name__}")
    with Pipeline(model, cali_data, by_block=False, cache_budget_mb=None) as pipeline:
        pipeline.gather(pipeline.segments[0], layers, reduce, weights)


def grid_qparams(quantizer: QuantizeBase, weight: Tensor) -> tuple[Tensor, Tensor]:
    """The (scale, zero point) ``quantizer``'s observer computes for ``weight`` alone (per row or per group)."""
    return GridQParams(quantizer)(weight)


class GridQParams:
    """:func:`grid_qparams` for many weights on one quantizer's grid (GPTQ asks once per group): one copy of the
    quantizer, which forgets what it saw before each weight as a fresh copy would (every observer starts over when
    its ``num_batches`` is 0), instead of a deep copy per weight."""

    def __init__(self, quantizer: QuantizeBase) -> None:
        self.twin = fresh_copy(quantizer)

    def __call__(self, weight: Tensor) -> tuple[Tensor, Tensor]:
        self.twin.activation_post_process.num_batches.zero_()
        with torch.no_grad():
            self.twin(weight.detach().float())
        scale, zero_point = self.twin.export_qparams()
        return scale.detach().clone(), zero_point.detach().clone()


def rtn(quantizer: QuantizeBase, weight: Tensor) -> Tensor:
    """Rounding to nearest of ``weight`` on ``quantizer``'s grid with the parameters its observer gives it."""
    scale, zero = grid_qparams(quantizer, weight)
    return on_grid(quantizer, weight, scale, zero)


def on_grid(quantizer: QuantizeBase, weight: Tensor, scale: Tensor, zero: Tensor) -> Tensor:
    """``weight`` fake-quantized (float32) with per-row (or per-group) parameters ``scale`` / ``zero``."""
    size = quantizer.group_size
    rows = to_groups(weight.float(), size) if size else weight.float().reshape(weight.shape[0], -1)
    s, z = scale.reshape(-1, 1).float(), zero.reshape(-1, 1).float()
    q = (torch.clamp(torch.round(rows / s) + z, quantizer.quant_min, quantizer.quant_max) - z) * s
    return from_groups(q, weight.shape, size) if size else q.reshape(weight.shape)


def fix_qparams(quantizer: QuantizeBase, scale: Tensor, zero_point: Tensor) -> None:
    """Give ``quantizer`` these parameters and stop its observer (the algorithm chose them)."""
    for attribute, value in (("scale", scale), ("zero_point", zero_point)):
        held = getattr(quantizer, attribute, None)
        if not isinstance(held, Tensor):
            raise ValueError(f"{type(quantizer).__name__} holds no {attribute} tensor to set")
        new = value.detach().to(held.dtype).reshape(-1).clone()
        if isinstance(held, nn.Parameter):
            held.data = new
        else:
            setattr(quantizer, attribute, new)
    quantizer.disable_observer()
    quantizer.enable_fake_quant()
