"""AWQ (Lin et al., 2024): activation-aware weight quantization, by scaling salient input channels up before the
weights are rounded, then clipping each group's range where that loses less.

For the linear layers reading one value ``X`` (a *site*: the query, key and value projections of one attention),
input channel ``j`` is scaled by ``s_j = mean|X_j| ** alpha`` (normalised so that ``max(s) * min(s) == 1``): the
weights become ``W * s``, and the input ``X / s`` (a :class:`~mqbench.advanced_ptq.smoothing.ChannelScale` node on
those layers' input, which runtimes fold into the op before). The channels that carry large activations then
keep more of their weights' precision. ``alpha`` is searched on ``grid`` points of [0, 1) by the error of the
layers' outputs, ``sum ||Q(W * s) (X / s)^T - W X^T||^2`` with ``Q`` rounding to nearest on the layer's own grid;
``alpha = 0`` (no scaling) is among them, so the search never makes a site worse on the calibration rows.

Then, per layer, each (output channel, group) range is shrunk by the ratio of ``clip_grid`` points of
[``max_shrink``, 1] that gives the least error of that group's contribution to the output,
``||(Q_r(W_g) - W_g) X_g^T||^2``; the quantizer keeps the chosen scales (its observer stopped).

``awq(model, cali_data, config)`` runs this on every linear layer of a prepared model (the inputs from the float
model: scaling does not change them). ``model.meta["awq"]`` holds per site the chosen ``alpha`` and the errors
with and without it, and per layer the chosen clip ratios.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from mqbench.prepare_by_platform import prepare_by_platform
    >>> from mqbench.advanced_ptq import awq
    >>> _ = torch.manual_seed(0)
    >>> model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8)).eval()
    >>> qmodel = prepare_by_platform(model, "llm_w4a16", {"extra_qconfig_dict": {"w_qscheme": {"group_size": 32}}})
    >>> qmodel = awq(qmodel, [torch.randn(16, 64) * torch.linspace(0.1, 5, 64) for _ in range(4)])
    >>> all(site["error"] <= site["error_unscaled"] for site in qmodel.meta["awq"]["sites"].values())
    True
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, fx

from mqbench.advanced_ptq.pipeline import Pipeline, check_keys
from mqbench.advanced_ptq.smoothing import ChannelScale, _free_name, _insert_channel_scale
from mqbench.advanced_ptq.weight_only import (
    PIPELINE_DEFAULTS,
    Layer,
    Site,
    calibrate_weights,
    config_with,
    fix_qparams,
    grid_qparams,
    linear_sites,
    on_grid,
    rtn,
)
from mqbench.fake_quantize.quantize_base import QuantizeBase
from mqbench.utils.lazy_weights import pending_weights
from mqbench.utils.logger import logger

__all__ = ["AWQ_DEFAULTS", "awq", "awq_scales"]

AWQ_DEFAULTS: Mapping[str, Any] = {
    "grid": 20,  # alpha candidates: 0, 1/grid, ..., (grid - 1)/grid
    "clip": True,  # search each group's clipping ratio
    "clip_grid": 20,  # ratio candidates: 1, 1 - (1 - max_shrink)/clip_grid, ..., max_shrink
    "max_shrink": 0.5,  # the smallest ratio of a group's range tried
    "sample_rows": 4096,  # calibration rows (tokens) the searches use per site, drawn at random (seeded)
    "seed": 0,
    "layers": None,  # names of the linear layers to run on (default: every one with an enabled weight quantizer)
    **PIPELINE_DEFAULTS,  # by_block, cache_budget_mb, device: how the calibration data runs through the model
}


def _candidates(grid: int) -> list[float]:
    return [i / grid for i in range(grid)]


def awq_scales(x_mean: Tensor, alpha: float) -> Tensor:
    """``mean|X_j| ** alpha`` normalised to ``max * min == 1`` (1 everywhere for ``alpha == 0``)."""
    s = x_mean.clamp(min=1e-4) ** alpha
    return s / torch.sqrt(s.max() * s.min())


def _site_error(layers: list[Layer], weights: list[Tensor], x: Tensor, scale: Tensor, reference: list[Tensor]) -> float:
    error = 0.0
    for layer, weight, out in zip(layers, weights, reference, strict=True):
        quantized = rtn(layer.quantizer, weight * scale)
        error += float(((x / scale) @ quantized.T - out).pow(2).sum())
    return error / x.shape[0]


def _clip_ratios(layer: Layer, weight: Tensor, x: Tensor, ratios: list[float]) -> tuple[Tensor, Tensor, Tensor]:
    """Per (output channel, group): the ratio of ``ratios`` whose shrunk range gives the least output error, and
    the scale / zero point of that range."""
    quantizer = layer.quantizer
    size = quantizer.group_size or weight.shape[1]
    groups = (weight.shape[1] + size - 1) // size
    device = weight.device
    best = torch.full((weight.shape[0], groups), float("inf"), device=device)
    chosen = torch.ones(weight.shape[0], groups, device=device)
    scale = torch.zeros(weight.shape[0] * groups, device=device)
    zero = torch.zeros(weight.shape[0] * groups, device=device)
    for ratio in ratios:
        s, z = grid_qparams(quantizer, _shrunk(weight, size, ratio))
        delta = on_grid(quantizer, weight, s, z) - weight
        errors = torch.stack(
            [
                ((x[:, g * size : (g + 1) * size] @ delta[:, g * size : (g + 1) * size].T) ** 2).sum(0)
                for g in range(groups)
            ],
            dim=1,
        )
        better = errors < best
        best = torch.where(better, errors, best)
        chosen = torch.where(better, torch.full_like(chosen, ratio), chosen)
        flat = better.reshape(-1)
        scale = torch.where(flat, s.reshape(-1).float(), scale)
        zero = torch.where(flat, z.reshape(-1).float(), zero)
    return chosen, scale, zero


def _shrunk(weight: Tensor, size: int, ratio: float) -> Tensor:
    """``weight`` with each (row, group of ``size`` columns) clamped to ``ratio`` times its [min, max]."""
    columns = weight.shape[1]
    index = torch.arange(columns, device=weight.device) // size
    groups = int(index.max()) + 1
    low = torch.stack([weight[:, index == g].amin(dim=1) for g in range(groups)], dim=1)[:, index]
    high = torch.stack([weight[:, index == g].amax(dim=1) for g in range(groups)], dim=1)[:, index]
    return torch.minimum(torch.maximum(weight, low * ratio), high * ratio)


def _scale_inputs(model: fx.GraphModule, site: Site, inverse: Tensor) -> str:
    """Divide the site's input by ``s`` on the edges into its layers only (before an activation quantizer that
    only they read, so that it quantizes the scaled values)."""
    modules = dict(model.named_modules())
    source = site.source
    readers = {layer.node for layer in site.layers}
    inverse = inverse.to(site.layers[0].module.weight.device)  # the scale was found where the block ran
    if (
        source.op == "call_module"
        and isinstance(modules.get(str(source.target)), QuantizeBase)
        and set(source.users) <= readers
    ):
        name = _free_name(model, f"{source.target}_awq")
        _insert_channel_scale(model, source, name, inverse)
        return name
    name = _free_name(model, f"{site.layers[0].name.replace('.', '_')}_awq_input")
    model.add_module(name, ChannelScale(inverse))
    with model.graph.inserting_after(source):
        scaled = model.graph.call_module(name, (source,))
    for layer in site.layers:
        layer.node.replace_input_with(source, scaled)
    return name


class _Samples:
    """Per layer: the sum of ``|x|`` over its input rows, their number, and a uniform sample of ``sample_rows``
    rows (a reservoir by random keys, drawn from a generator of its own per site, seeded by ``seed`` and the
    site's index, so that the sample does not depend on the order the data is run in)."""

    def __init__(self, layers: list[Layer], cfg: Mapping[str, Any], indices: list[int]) -> None:
        self.limit = int(cfg["sample_rows"])
        self.generators = {
            layer.name: torch.Generator().manual_seed(int(cfg["seed"]) * 1_000_003 + index)
            for layer, index in zip(layers, indices, strict=True)
        }
        self.rows: dict[str, tuple[Tensor, Tensor]] = {}
        self.seen: dict[str, int] = {}
        self.sums: dict[str, Tensor] = {}

    def __call__(self, layer: Layer, x: Tensor) -> None:
        key = layer.name
        self.sums[key] = self.sums.get(
            key, torch.zeros(x.shape[1], dtype=torch.float64, device=x.device)
        ) + x.abs().sum(0)
        self.seen[key] = self.seen.get(key, 0) + x.shape[0]
        keys = torch.rand(x.shape[0], generator=self.generators[key]).to(x.device)  # the same draw on any device
        held = self.rows.get(key)
        pool = x.float() if held is None else torch.cat([held[0], x.float()])
        weights = keys if held is None else torch.cat([held[1], keys])
        keep = torch.argsort(weights)[: self.limit]
        self.rows[key] = (pool[keep], weights[keep])


def _awq_site(
    site: Site, samples: _Samples, cfg: Mapping[str, Any], report: dict[str, Any], scaled: list[tuple[Site, Tensor]]
) -> None:
    """AWQ's scale and clipping search for ``site`` on its sampled input rows; the layers' weights are scaled
    in place, the input's scaling (a graph change) is added to ``scaled``."""
    key = site.layers[0].name
    if key not in samples.rows:
        logger.info("awq: %s saw no input; left as it was", key)
        return
    started = time.perf_counter()
    x = samples.rows[key][0]
    x_mean = (samples.sums[key] / samples.seen[key]).float()
    weights = [layer.quantizer.deploy_weight(layer.module.weight.detach()).float().clone() for layer in site.layers]
    reference = [x @ w.T for w in weights]
    errors = {
        alpha: _site_error(site.layers, weights, x, awq_scales(x_mean, alpha), reference)
        for alpha in _candidates(int(cfg["grid"]))
    }
    alpha = min(errors, key=lambda a: errors[a])
    scale = awq_scales(x_mean, alpha)
    names = [layer.name for layer in site.layers]
    report["sites"][key] = {"layers": names, "alpha": alpha, "error": errors[alpha], "error_unscaled": errors[0.0]}
    if alpha > 0:
        with torch.no_grad():
            for layer in site.layers:
                layer.module.weight.mul_(scale.to(layer.module.weight.dtype))
        scaled.append((site, (1.0 / scale).to(x.dtype)))
    x_scaled = x / scale
    steps = int(cfg["clip_grid"])
    ratios = [1.0 - i * (1.0 - float(cfg["max_shrink"])) / steps for i in range(steps + 1)]
    for layer in site.layers:
        weight = layer.quantizer.deploy_weight(layer.module.weight.detach()).float()
        if cfg["clip"]:
            chosen, s, z = _clip_ratios(layer, weight, x_scaled, ratios)
            report["clip"][layer.name] = chosen.cpu()
        else:
            s, z = grid_qparams(layer.quantizer, weight)
        fix_qparams(layer.quantizer, s, z)
    report["sites"][key]["seconds"] = time.perf_counter() - started
    del samples.rows[key]


def awq(model: fx.GraphModule, cali_data: Any, config: Mapping[str, Any] | None = None) -> fx.GraphModule:
    """AWQ on every linear layer of ``model`` (prepared by ``prepare_by_platform``); returns it (changed in place).

    ``cali_data``: a list of input batches, as for ``ptq_reconstruction``. ``config`` keys: see
    :data:`AWQ_DEFAULTS` (unknown keys are errors).
    """
    cfg = config_with(AWQ_DEFAULTS, config, "awq")
    for key in ("grid", "clip_grid", "sample_rows"):
        if not isinstance(cfg[key], int) or cfg[key] < 1:
            raise ValueError(f"awq config {key} must be a positive int, got {cfg[key]!r}")
    if not 0 < float(cfg["max_shrink"]) <= 1:
        raise ValueError(f"awq config max_shrink must be in (0, 1], got {cfg['max_shrink']!r}")
    check_keys(cfg, "awq")
    sites = linear_sites(model, cfg["layers"], "awq")
    calibrate_weights(model, skip=pending_weights(model))  # weights on disk: calibrated as each block is loaded
    report: dict[str, Any] = {"sites": {}, "clip": {}}
    scaled_inputs: list[tuple[Site, Tensor]] = []  # the graph changes after the pipeline has run
    with Pipeline.for_sites(model, cali_data, sites, cfg, "awq") as pipeline:
        for segment, here, more in pipeline.with_sites(sites):
            samples = _Samples([site.layers[0] for site in here], cfg, [sites.index(site) for site in here])
            # the inputs of the float model (scaling does not change them), this block's and the next one's in one pass
            pipeline.gather(segment, [site.layers[0] for site in here], samples, weights=False, advance=more)
            for site in here:
                _awq_site(site, samples, cfg, report, scaled_inputs)
    for site, inverse in scaled_inputs:
        _scale_inputs(model, site, inverse)
    model.recompile()
    model.meta["awq"] = report
    scaled = sum(site["alpha"] > 0 for site in report["sites"].values())
    logger.info("awq: %d site(s), %d scaled", len(report["sites"]), scaled)
    return model
