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
whole model as one segment, the same results). Within a segment each site's gathering runs from the state kept
just after the value the site before it reads, up to the value this site reads (its layers do not run; one Hessian
serves them all): each layer runs once per batch, after it is rounded.
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
    GridQParams,
    Layer,
    Site,
    calibrate_weights,
    config_with,
    fix_qparams,
    linear_sites,
    rtn,
)
from mqbench.fake_quantize.quantize_base import QuantizeBase
from mqbench.utils.lazy_weights import pending_weights
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

    The Hessian is factored in float64; the columns are rounded and updated in the weight's own precision (float32
    for a model's weights, as GPTQ is commonly run; a float64 weight is updated in float64) and the rounded weight
    comes back in it. A column is held as a row of the transposed weight, so that each step reads and updates
    contiguous memory.
    """
    dtype = weight.dtype if weight.dtype in (torch.float32, torch.float64) else torch.float32
    W = weight.detach().to(dtype).clone()
    rows, columns = W.shape
    diagonal = torch.diag(hessian.detach()).double()
    dead = diagonal == 0  # inputs never seen: their columns zeroed, their diagonal taken as 1
    diagonal[dead] = 1.0
    W[:, dead] = 0.0
    size = group_size or columns
    groups = (columns + size - 1) // size
    device = W.device
    scales = torch.zeros(rows, groups, dtype=torch.float64, device=device)
    zeros = torch.zeros(rows, groups, dtype=torch.float64, device=device)
    grid: dict[int, tuple[Tensor, Tensor]] = {}  # group: its (scale, zero point) as the rounding uses them

    def known(g: int, s: Tensor, z: Tensor) -> None:
        scales[:, g], zeros[:, g] = s.double().reshape(-1), z.double().reshape(-1)
        grid[g] = (s.float().reshape(-1), z.float().reshape(-1))

    if group_size is None or act_order:  # from the weights before any update
        for g in range(groups):
            known(g, *qparams(W[:, g * size : (g + 1) * size]))
    perm = torch.argsort(diagonal, descending=True) if act_order else None
    order = perm.tolist() if perm is not None else range(columns)  # the column each step rounds, read once
    if perm is not None:
        W = W[:, perm]
    # U, the upper Cholesky factor of H^-1 (H in the order the columns are rounded), from one factorisation and one
    # triangular solve: with J the reversal of the columns, J H J = L L^T gives H^-1 = U^T U with U = (J L J)^-1
    # (upper triangular, positive diagonal); several times faster than factoring H^-1 itself. The memory: one
    # float64 copy of H, factored in place, then U in the weight's precision (a large layer's float64 Hessian is
    # hundreds of MiB)
    if perm is None:
        F = hessian.detach().to(torch.float64).flip(0, 1)  # J H J: a copy (H is the caller's)
    else:
        back = perm.flip(0)
        F = hessian.detach()[back][:, back].to(torch.float64)
    reversed_dead = dead.flip(0) if perm is None else dead[perm.flip(0)]
    F[reversed_dead, reversed_dead] = 1.0
    F.diagonal().add_(damp * torch.mean(torch.diag(F)))
    torch.linalg.cholesky(F.mT, out=F.mT)  # in place: F (symmetric) read column-major holds L, so F is L^T
    T = F.to(dtype)
    del F
    A = T.flip(0, 1)  # J L^T J = (J L J)^T
    del T
    U = torch.eye(columns, dtype=dtype, device=device)
    torch.linalg.solve_triangular(A.mT, U, upper=True, out=U)  # (J L J)^-1, in place
    del A
    pivots = U.diagonal().tolist()
    Wt = W.t().contiguous()  # [in, out]: column i of W is row i here
    del W
    Qt = torch.empty_like(Wt)
    fast = dtype == torch.float32
    for i1 in range(0, columns, block_size):
        i2 = min(i1 + block_size, columns)
        W1, U1 = Wt[i1:i2], U[i1:i2, i1:i2]  # W1: a view, updated in place
        Err1 = torch.empty(i2 - i1, rows, dtype=dtype, device=device)
        for i in range(i2 - i1):
            g = order[i1 + i] // size
            if g not in grid:  # its first column (no act_order: columns in order): the weights as updated so far
                span = min(size, columns - i1 - i)
                current = W1[i : i + span]
                if len(current) < span:  # the group runs past this block: its columns there, updated so far
                    need = span - len(current)
                    pending = Wt[i2 : i2 + need] - U[i1 : i1 + i, i2 : i2 + need].t() @ Err1[:i]
                    current = torch.cat([current, pending])
                known(g, *qparams(current.t().contiguous()))
            s, z = grid[g]
            w = W1[i]
            if fast:  # round_to_grid's arithmetic without its conversions (a column is rounded 10^4 times a block)
                q = torch.clamp(torch.round(w / s).add_(z), quant_min, quant_max).sub_(z).mul_(s)
            else:
                q = round_to_grid(w, s, z, quant_min, quant_max)
            Qt[i1 + i] = q
            err = (w - q).div_(pivots[i1 + i])
            W1[i + 1 :].addmm_(U1[i, i + 1 :, None], err[None], alpha=-1.0)  # rank one (faster than addr_)
            Err1[i] = err
        Wt[i2:].addmm_(U[i1:i2, i2:].t(), Err1, alpha=-1.0)
    Q = Qt.t()
    return (Q[:, torch.argsort(perm)] if perm is not None else Q).contiguous(), scales, zeros


def _output_error(weight: Tensor, rounded: Tensor, hessian: Tensor) -> float:
    """``tr((W - Q) H (W - Q)^T)``: the output error the Hessian measures (mean over calibration tokens, x2), in
    ``hessian``'s precision (a report: float32 halves the cost of a product as large as GPTQ's Hessian)."""
    delta = (weight.to(hessian.dtype) - rounded.to(hessian.dtype)).detach()
    return float(((delta @ hessian) * delta).sum(dtype=torch.float64))


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
    calibrate_weights(model, skip=pending_weights(model))  # weights on disk: calibrated as each block is loaded
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
    """GPTQ of the layers of ``site`` on their inputs, gathered by running ``segment`` up to the last of them.

    The layers of a site read one value, so they share one Hessian: it is summed once (for a transformer's query,
    key and value projections, a third of the work and of the memory of one per layer)."""
    summed: list[Tensor] = []  # the site's sum of x^T x (float64: any batching, one sum)
    tokens = [0]

    def reduce(_: Layer, rows: Tensor) -> None:
        if summed:
            summed[0].addmm_(rows.T, rows)  # in place: one Hessian held, not two
        else:
            summed.append(rows.T @ rows)
        tokens[0] += rows.shape[0]

    # the block runs from the state kept after the site before it (rounded already) up to the value the layers
    # read; where that value cannot be reached from there, with hooks on the layers from the state before them
    if not pipeline.gather_value(segment, site.source, lambda rows: reduce(site.layers[0], rows)):
        first, last = site.layers[0].node, site.layers[-1].node
        pipeline.gather(segment, site.layers[:1], reduce, until=last, checkpoint=first)
    if not tokens[0]:
        logger.info("gptq: %s saw no input; left as it was", ", ".join(layer.name for layer in site.layers))
        return
    H = summed.pop().mul_(2.0).div_(tokens[0])  # 2 H / n, in place; gptq_quantize leaves it as it is
    measure = H.float()  # for the report of each layer's output error
    for layer in site.layers:
        started = time.perf_counter()
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
            "rtn": _output_error(weight, nearest, measure),
            "gptq": _output_error(weight, rounded, measure),
            "seconds": time.perf_counter() - started,
        }


def _qparams_of(quantizer: QuantizeBase) -> QParams:
    grid = GridQParams(quantizer)

    def qparams(columns: Tensor) -> tuple[Tensor, Tensor]:
        scale, zero = grid(columns.float())
        return scale.reshape(columns.shape[0], -1)[:, 0], zero.reshape(columns.shape[0], -1)[:, 0]

    return qparams
