"""GPTQ (Frantar et al., 2023): weights rounded one input column at a time, each column's error spread over the
columns not yet rounded so that the layer's output on the calibration data changes least.

For a linear layer with weight ``W`` ``[out, in]`` and inputs ``X`` ``[tokens, in]``, ``H = 2 X^T X / tokens`` is the
Hessian of the output error ``||(W - Q) X^T||^2``. Rounding column ``i`` to ``q`` with error ``e = w_i - q`` is
best compensated by moving the remaining columns by ``-e / [H^-1]_ii * [H^-1]_{i, rest}`` (the optimal brain
surgeon update); GPTQ does this for every column in order, through the upper Cholesky factor of ``H^-1`` and in
lazy blocks of columns (``block_size``) so that most of the work is one matrix product per block. ``damp`` adds
that fraction of the mean diagonal to ``H`` (a calibration set with fewer tokens than inputs leaves it singular);
``act_order`` rounds the columns of largest ``H_ii`` first, with the group scales then computed from the weights
before any update (contiguous groups, as every deployed format holds them); otherwise each group's scale is
computed when its first column is reached, from the weights as updated so far.

``gptq(model, cali_data, config)`` runs it on every linear layer of a prepared model, one site (the layers reading
one value) at a time in graph order, each site's inputs computed with the layers before it already quantized. On a
stack of blocks (a transformer) the calibration data runs block by block (:class:`~mqbench.advanced_ptq.pipeline.
Pipeline`): a block's sites are gathered by rerunning that block alone from its cached inputs, and the block's
quantized outputs become the next block's inputs, so the cost grows linearly with depth (``by_block: False``: the
whole model as one segment, the same results). Within a segment each site's gathering starts from the state kept
just before the site before it.
Each layer's weight is replaced by its rounded values and its weight quantizer keeps the scales GPTQ used (its
observer stopped). ``model.meta["gptq"]`` holds per layer the output error of rounding to nearest and of GPTQ;
``model.meta["rounded_weights"]`` names the layers whose float weights are now the rounded ones.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from mqbench.prepare_by_platform import prepare_by_platform
    >>> from mqbench.advanced_ptq import gptq
    >>> _ = torch.manual_seed(0)
    >>> model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8)).eval()
    >>> qmodel = prepare_by_platform(model, "llm_w4a16", {"extra_qconfig_dict": {"w_qscheme": {"group_size": 32}}})
    >>> qmodel = gptq(qmodel, [torch.randn(64, 64) for _ in range(4)])
    >>> all(r["gptq"] <= r["rtn"] for r in qmodel.meta["gptq"].values())
    True
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, fx

from mqbench.advanced_ptq.pipeline import Pipeline, Segment, check_keys
from mqbench.advanced_ptq.weight_only import (
    PIPELINE_DEFAULTS,
    Layer,
    Site,
    calibrate_weights,
    config_with,
    fix_qparams,
    grid_qparams,
    linear_sites,
    rtn,
)
from mqbench.fake_quantize.quantize_base import QuantizeBase
from mqbench.utils.logger import logger

__all__ = ["GPTQ_DEFAULTS", "gptq", "gptq_quantize", "round_to_grid"]

GPTQ_DEFAULTS: Mapping[str, Any] = {
    "block_size": 128,  # columns per lazy batch update
    "damp": 0.01,  # fraction of the mean of diag(H) added to its diagonal
    "act_order": False,  # round columns of largest H_ii first (group scales then from the weights before updates)
    "layers": None,  # names of the linear layers to run on (default: every one with an enabled weight quantizer)
    **PIPELINE_DEFAULTS,  # by_block, cache_budget_mb, device: how the calibration data runs through the model
}

QParams = Callable[[Tensor], tuple[Tensor, Tensor]]


def round_to_grid(w: Tensor, scale: Tensor, zero: Tensor, quant_min: int, quant_max: int) -> Tensor:
    """``(clamp(round(w / s) + z) - z) * s`` in float32 (the simulation's arithmetic), returned in ``w``'s type."""
    s, z = scale.float(), zero.float()
    return ((torch.clamp(torch.round(w.float() / s) + z, quant_min, quant_max) - z) * s).to(w.dtype)


def gptq_quantize(
    weight: Tensor,
    hessian: Tensor,
    qparams: QParams,
    quant_min: int,
    quant_max: int,
    group_size: int | None = None,
    block_size: int = 128,
    damp: float = 0.01,
    act_order: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """GPTQ of one weight ``[out, in]`` with Hessian ``[in, in]``: (rounded weight, scales, zero points), the
    last two ``[out, groups]`` (one group per row without ``group_size``).

    ``qparams(columns)`` gives the per-row (scale, zero point) of a block of columns ``[out, n]`` on the grid
    ``[quant_min, quant_max]``: of a group, or of the whole weight without groups.
    """
    W = weight.detach().double().clone()
    H = hessian.detach().double().clone()
    rows, columns = W.shape
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    size = group_size or columns
    groups = (columns + size - 1) // size
    device = W.device
    scales = torch.zeros(rows, groups, dtype=torch.float64, device=device)
    zeros = torch.zeros(rows, groups, dtype=torch.float64, device=device)
    known = torch.zeros(groups, dtype=torch.bool)
    if group_size is None or act_order:  # from the weights before any update
        for g in range(groups):
            s, z = qparams(W[:, g * size : (g + 1) * size])
            scales[:, g], zeros[:, g] = s.double().reshape(-1), z.double().reshape(-1)
        known[:] = True
    perm = torch.argsort(torch.diag(H), descending=True) if act_order else torch.arange(columns, device=device)
    order = perm.tolist()  # the column each step rounds, read once (not a device sync per column)
    if act_order:
        W, H = W[:, perm], H[perm][:, perm]
    H.diagonal().add_(damp * torch.mean(torch.diag(H)))
    # U: the upper Cholesky factor of H^-1; each [columns, columns] matrix freed once the next is made (a large
    # layer's float64 Hessian is hundreds of MiB: the memory is two of them, not five)
    L = torch.linalg.cholesky(H)
    del H
    inverse = torch.cholesky_inverse(L)
    del L
    U = torch.linalg.cholesky(inverse, upper=True)
    del inverse
    Q = torch.zeros_like(W)
    for i1 in range(0, columns, block_size):
        i2 = min(i1 + block_size, columns)
        W1, Err1 = W[:, i1:i2].clone(), torch.zeros(rows, i2 - i1, dtype=torch.float64, device=device)
        U1 = U[i1:i2, i1:i2]
        for i in range(i2 - i1):
            column = order[i1 + i]
            g = column // size
            if not known[g]:  # its first column (no act_order: columns in order): the weights as updated so far
                pending = W[:, i2:] - Err1[:, :i] @ U[i1 : i1 + i, i2:]
                current = torch.cat([W1[:, i:], pending], dim=1)[:, : min(size, columns - column)]
                s, z = qparams(current)
                scales[:, g], zeros[:, g] = s.double().reshape(-1), z.double().reshape(-1)
                known[g] = True
            w = W1[:, i]
            q = round_to_grid(w, scales[:, g], zeros[:, g], quant_min, quant_max)
            Q[:, i1 + i] = q
            err = (w - q) / U1[i, i]
            W1[:, i:] -= err[:, None] * U1[i, i:][None, :]
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ U[i1:i2, i2:]
    return Q[:, torch.argsort(perm)], scales, zeros


def _output_error(weight: Tensor, rounded: Tensor, hessian: Tensor) -> float:
    """``tr((W - Q) H (W - Q)^T)``: the output error the Hessian measures (mean over calibration tokens, x2)."""
    delta = (weight.double() - rounded.double()).detach()
    return float(torch.einsum("oi,ij,oj->", delta, hessian, delta))


def gptq(model: fx.GraphModule, cali_data: Any, config: Mapping[str, Any] | None = None) -> fx.GraphModule:
    """GPTQ on every linear layer of ``model`` (prepared by ``prepare_by_platform``); returns it (changed in place).

    ``cali_data``: a list of input batches (tensors, tuples of positional inputs, or dicts), as for
    ``ptq_reconstruction``. ``config`` keys: see :data:`GPTQ_DEFAULTS` (unknown keys are errors).
    """
    cfg = config_with(GPTQ_DEFAULTS, config, "gptq")
    if not isinstance(cfg["block_size"], int) or cfg["block_size"] < 1:
        raise ValueError(f"gptq config block_size must be a positive int, got {cfg['block_size']!r}")
    if not 0 <= float(cfg["damp"]) < 1:
        raise ValueError(f"gptq config damp must be in [0, 1), got {cfg['damp']!r}")
    check_keys(cfg, "gptq")
    sites = linear_sites(model, cfg["layers"], "gptq")
    calibrate_weights(model)
    report: dict[str, dict[str, float]] = {}
    with Pipeline.for_sites(model, cali_data, sites, cfg, "gptq") as pipeline:
        for segment, here, more in pipeline.with_sites(sites):
            for site in here:  # each site's inputs with the sites before it (this block's too) quantized
                _gptq_site(pipeline, segment, site, cfg, report)
            if more:
                pipeline.advance(segment)  # the next block's inputs, through this block quantized
    model.meta["gptq"] = report
    # the float model (quantizers off) now holds these rounded weights: verify_deploy's float comparison says so
    model.meta["rounded_weights"] = {"by": "gptq", "layers": sorted(report)}
    logger.info("gptq: %d layer(s) rounded", len(report))
    return model


def _gptq_site(
    pipeline: Pipeline, segment: Segment, site: Site, cfg: Mapping[str, Any], report: dict[str, dict[str, float]]
) -> None:
    """GPTQ of the layers of ``site`` on their inputs, gathered by running ``segment`` up to the last of them."""
    hessians: dict[str, Tensor] = {}
    tokens = {layer.name: 0 for layer in site.layers}

    def reduce(layer: Layer, rows: Tensor) -> None:  # each layer's sum of x^T x (float64: any batching, one sum)
        total = rows.T @ rows
        if layer.name in hessians:
            hessians[layer.name].add_(total)  # in place: one Hessian held, not two
        else:
            hessians[layer.name] = total
        tokens[layer.name] += rows.shape[0]

    # the block runs from the state before this site (the sites before it are rounded already) up to its last layer
    first, last = site.layers[0].node, site.layers[-1].node
    pipeline.gather(segment, site.layers, reduce, until=last, checkpoint=first)
    for layer in site.layers:
        if not tokens[layer.name]:
            logger.info("gptq: %s saw no input; left as it was", layer.name)
            continue
        started = time.perf_counter()
        H = hessians.pop(layer.name).mul_(2.0).div_(tokens[layer.name])  # 2 H / n, in place
        quantizer = layer.quantizer
        weight = quantizer.deploy_weight(layer.module.weight.detach()).clone()
        rounded, scales, zeros = gptq_quantize(
            weight,
            H,
            _qparams_of(quantizer),
            quantizer.quant_min,
            quantizer.quant_max,
            quantizer.group_size,
            cfg["block_size"],
            float(cfg["damp"]),
            bool(cfg["act_order"]),
        )
        nearest = rtn(quantizer, weight)
        with torch.no_grad():
            layer.module.weight.copy_(rounded.to(layer.module.weight.dtype))
        fix_qparams(quantizer, scales.reshape(-1).float(), zeros.reshape(-1))
        report[layer.name] = {
            "rtn": _output_error(weight, nearest, H),
            "gptq": _output_error(weight, rounded, H),
            "seconds": time.perf_counter() - started,
        }


def _qparams_of(quantizer: QuantizeBase) -> QParams:
    def qparams(columns: Tensor) -> tuple[Tensor, Tensor]:
        scale, zero = grid_qparams(quantizer, columns.float())
        return scale.reshape(columns.shape[0], -1)[:, 0], zero.reshape(columns.shape[0], -1)[:, 0]

    return qparams
