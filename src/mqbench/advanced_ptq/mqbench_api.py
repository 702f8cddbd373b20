"""MQBench's reconstruction helpers (``mqbench.advanced_ptq``'s public functions), on this package's pieces.

``ptq_reconstruction`` finds the units itself (:func:`~mqbench.advanced_ptq.units.find_units`);
these are for scripts that drive reconstruction by hand, MQBench's way: collect a module's inputs
and outputs with :func:`save_inp_oup_data`, then :func:`subgraph_reconstruction` on a subgraph with
:class:`LossFunction` (reconstruction error plus AdaRound's rounding regulariser, whose exponent
follows :class:`LinearTempDecay` or :class:`CosineTempDecay`).

MQBench's graph walkers that pick the nodes of a unit (``extract_layer``, ``extract_block``,
``extract_subgraph``, ``find_num_nodes``, ``get_io_of_block``, ``find_used_times``,
``find_cur_node``, ``insert_fake_modules``, ``prepare_fp_and_quant_model_for_ptq``) work on the
graphs of MQBench's tracer; here :func:`~mqbench.advanced_ptq.units.find_units` returns the units
(layers or blocks, their nodes, inputs and outputs) and calling one raises an error naming it.

Example:
    >>> import torch
    >>> from mqbench.advanced_ptq import lp_loss, CosineTempDecay
    >>> float(lp_loss(torch.ones(2, 3), torch.zeros(2, 3)))
    3.0
    >>> decay = CosineTempDecay(t_max=100, warm_up=0.2, start_b=20, end_b=2)
    >>> decay(0), decay(100)
    (20, 2.0)
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, fx, nn

from mqbench.advanced_ptq.reconstruction import LinearTempDecay, ReconstructionConfig, call_with
from mqbench.fake_quantize.adaround import AdaRoundFakeQuantize
from mqbench.fake_quantize.lsq import LearnableFakeQuantize
from mqbench.fake_quantize.qdrop import QDropFakeQuantize
from mqbench.utils.hook import DataSaverHook, StopForwardException
from mqbench.utils.logger import logger
from mqbench.utils.utils import USE_LINK

__all__ = [
    "USE_DDP",
    "USE_LINK",
    "CosineTempDecay",
    "LossFunction",
    "extract_block",
    "extract_layer",
    "extract_subgraph",
    "find_cur_node",
    "find_num_nodes",
    "find_used_times",
    "get_io_of_block",
    "insert_fake_modules",
    "layer_has_weights",
    "lp_loss",
    "node2modules",
    "prepare_fp_and_quant_model_for_ptq",
    "qnode2fpnode",
    "save_inp_oup_data",
    "subgraph_reconstruction",
    "tensor_detach",
    "to_device",
]

USE_DDP = False  # reconstruction here runs in one process (its gradients are never all-reduced)


def lp_loss(pred: Tensor, tgt: Tensor, p: float = 2.0, reduction: str = "none") -> Tensor:
    """``|pred - tgt| ** p`` summed over the features of each sample, averaged over the batch (``"all"``: mean)."""
    error = (pred - tgt).abs().pow(p)
    if reduction == "none":
        return error.flatten(1).sum(1).mean() if error.dim() > 1 else error.sum()
    return error.mean()


class CosineTempDecay:
    """The rounding regulariser's exponent: ``start_b`` during warm-up, then a cosine down to ``end_b``."""

    def __init__(self, t_max: int = 10000, warm_up: float = 0.2, start_b: float = 20, end_b: float = 2) -> None:
        self.t_max, self.start_decay, self.start_b, self.end_b = t_max, warm_up * t_max, start_b, end_b

    def __call__(self, t: int) -> float:
        if t < self.start_decay:
            return self.start_b
        rel_t = min(1.0, (t - self.start_decay) / max(self.t_max - self.start_decay, 1))
        return self.end_b + 0.5 * (self.start_b - self.end_b) * (1 + math.cos(rel_t * math.pi))


def _roundings(subgraph: nn.Module) -> list[tuple[Tensor, AdaRoundFakeQuantize]]:
    """(weight, its AdaRound quantizer) of each layer of ``subgraph`` quantized with learned rounding."""
    found = []
    for module in subgraph.modules():
        quantizer, weight = getattr(module, "weight_fake_quant", None), getattr(module, "weight", None)
        if isinstance(quantizer, AdaRoundFakeQuantize) and isinstance(weight, Tensor):
            found.append((weight, quantizer))
    return found


class LossFunction:
    """Reconstruction loss of a subgraph: ``lp_loss(pred, tgt, p)`` + ``weight`` x AdaRound's rounding regulariser.

    The regulariser (``sum(1 - |2h - 1| ** b)`` over the subgraph's AdaRound weight quantizers that
    learn their rounding) starts after ``warm_up * max_count`` calls, its exponent ``b`` decaying
    linearly over ``b_range``.
    """

    def __init__(
        self,
        subgraph: nn.Module,
        weight: float = 1.0,
        max_count: int = 10000,
        b_range: tuple[float, float] = (20, 2),
        warm_up: float = 0.0,
        p: float = 2.0,
    ) -> None:
        self.subgraph, self.weight, self.p = subgraph, weight, p
        self.loss_start = max_count * warm_up
        self.temp_decay = LinearTempDecay(max_count, rel_start_decay=warm_up, start_b=b_range[0], end_b=b_range[1])
        self.count = 0

    def __call__(self, pred: Tensor, tgt: Tensor) -> Tensor:
        self.count += 1
        rec_loss = lp_loss(pred, tgt, p=self.p)
        b = self.temp_decay(self.count)
        learning = [q for _, q in _roundings(self.subgraph) if q.alpha is not None]
        if self.count < self.loss_start or not learning:
            round_loss = torch.zeros((), device=pred.device)
        else:
            round_loss = self.weight * torch.stack([q.rounding_loss(b) for q in learning]).sum()
        if self.count % 500 == 0:
            rec, rnd = float(rec_loss), float(round_loss)
            logger.info(f"loss {rec + rnd:.4g} (rec {rec:.4g}, round {rnd:.4g}, b {b:.1f}) at {self.count}")
        return rec_loss + round_loss


def to_device(data: Any, device: torch.device | str) -> Any:
    """Tensors in ``data`` (nested lists, tuples, dicts) moved to ``device``."""
    if isinstance(data, Tensor):
        return data.to(device)
    if isinstance(data, dict):
        return {k: to_device(v, device) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return type(data)(to_device(v, device) for v in data)
    return data


def tensor_detach(data: Any) -> Any:
    """Tensors in ``data`` (nested lists, tuples, dicts) detached."""
    if isinstance(data, Tensor):
        return data.detach()
    if isinstance(data, dict):
        return {k: tensor_detach(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return type(data)(tensor_detach(v) for v in data)
    return data


def save_inp_oup_data(
    model: nn.Module,
    inp_module: nn.Module | None,
    oup_module: nn.Module | None,
    cali_data: Sequence[Any],
    store_inp: bool = True,
    store_oup: bool = True,
    keep_gpu: bool = True,
) -> tuple[list[Any], list[Any]]:
    """Run ``model`` on each batch; the inputs of ``inp_module`` and outputs of ``oup_module`` per batch.

    The forward stops once both are seen. With ``keep_gpu=False`` the values are moved to the CPU.
    """
    if (store_inp and inp_module is None) or (store_oup and oup_module is None):
        raise ValueError("give the module whose inputs (inp_module) / outputs (oup_module) are stored")
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    inputs: list[Any] = []
    outputs: list[Any] = []
    for batch in cali_data:
        inp_saver = DataSaverHook(store_input=True, store_output=False, stop_forward=not store_oup)
        oup_saver = DataSaverHook(store_input=False, store_output=True, stop_forward=True)
        handles = []
        if store_inp and inp_module is not None:
            handles.append(inp_module.register_forward_hook(inp_saver))
        if store_oup and oup_module is not None:
            handles.append(oup_module.register_forward_hook(oup_saver))
        try:
            with torch.no_grad():
                call_with(model, to_device(batch, device))
        except StopForwardException:
            pass
        finally:
            for handle in handles:
                handle.remove()
        keep = (lambda v: v) if keep_gpu else (lambda v: to_device(v, "cpu"))
        if store_inp:
            args = inp_saver.input_store
            inputs.append(keep(tensor_detach(args[0] if isinstance(args, tuple) and len(args) == 1 else args)))
        if store_oup:
            outputs.append(keep(tensor_detach(oup_saver.output_store)))
    return inputs, outputs


def subgraph_reconstruction(
    subgraph: nn.Module, cached_inps: Sequence[Any], cached_oups: Sequence[Any], config: Any
) -> None:
    """Learn the rounding of ``subgraph``'s AdaRound weight quantizers (and with ``scale_lr`` its activation scales)
    so that ``subgraph(cached_inps[i])`` reconstructs ``cached_oups[i]``; the weights then hold the hard rounding.

    ``config`` takes :func:`~mqbench.advanced_ptq.ptq_reconstruction`'s keys (``max_count``, ``weight``,
    ``b_range``, ``warm_up``, ``scale_lr``, ``round_mode``, ``prob``). Each cached input is one argument
    (a tensor) or a tuple of them. In place; returns None as MQBench's does.
    """
    cfg = ReconstructionConfig.from_mapping(config)
    roundings = _roundings(subgraph)
    if not roundings:
        raise ValueError(
            "the subgraph has no AdaRoundFakeQuantize weight quantizer: prepare with w_fakequantize "
            "'AdaRoundFakeQuantize' (ptq_reconstruction sets it up itself)"
        )
    if len(cached_inps) != len(cached_oups) or not cached_inps:
        raise ValueError(f"give one cached output per cached input, got {len(cached_inps)} and {len(cached_oups)}")
    for weight, rounding in roundings:
        rounding.init(weight, cfg.round_mode)
    alphas = [q.alpha for _, q in roundings if q.alpha is not None]
    states = {p: p.requires_grad for p in subgraph.parameters()}
    for parameter in subgraph.parameters():
        parameter.requires_grad_(False)
    scales = [
        m.scale
        for m in subgraph.modules()
        if isinstance(m, LearnableFakeQuantize) and not isinstance(m, AdaRoundFakeQuantize)
    ]
    for parameter in [*alphas, *(scales if cfg.scale_lr > 0 else [])]:
        parameter.requires_grad_(True)
    optimizers: list[torch.optim.Optimizer] = [torch.optim.Adam(alphas)]
    if scales and cfg.scale_lr > 0:
        optimizers.append(torch.optim.Adam(scales, lr=cfg.scale_lr))
    for quantizer in subgraph.modules():
        if isinstance(quantizer, QDropFakeQuantize):
            quantizer.prob = cfg.prob
    loss_function = LossFunction(subgraph, cfg.weight, cfg.max_count, cfg.b_range, cfg.warm_up)
    generator = random.Random(cfg.seed)
    for _ in range(cfg.max_count):
        index = generator.randrange(len(cached_inps))
        inputs = cached_inps[index] if isinstance(cached_inps[index], tuple) else (cached_inps[index],)
        loss = loss_function(subgraph(*inputs), cached_oups[index])
        for optimizer in optimizers:
            optimizer.zero_grad()
        loss.backward()
        for optimizer in optimizers:
            optimizer.step()
    with torch.no_grad():
        for weight, rounding in roundings:
            weight.copy_(rounding.get_hard_value(weight))
            rounding.finish()
    for quantizer in subgraph.modules():
        if isinstance(quantizer, QDropFakeQuantize):
            quantizer.prob = 1.0
    for parameter, requires_grad in states.items():
        parameter.requires_grad_(requires_grad)


def node2modules(name2modules: dict[str, nn.Module], nodes: Sequence[fx.Node]) -> dict[fx.Node, nn.Module]:
    """The module each ``call_module`` node of ``nodes`` calls."""
    return {node: name2modules[str(node.target)] for node in nodes if node.op == "call_module"}


def qnode2fpnode(quant_modules: dict[str, nn.Module], fp32_modules: dict[str, nn.Module]) -> dict[nn.Module, nn.Module]:
    """Each module of the quantized model to the float model's module of the same name."""
    return {module: fp32_modules[name] for name, module in quant_modules.items() if name in fp32_modules}


def layer_has_weights(nodes: Sequence[fx.Node], modules: dict[str, nn.Module]) -> bool:
    """Whether a ``call_module`` node of ``nodes`` calls a module with a weight quantizer."""
    return any(
        node.op == "call_module" and hasattr(modules.get(str(node.target)), "weight_fake_quant") for node in nodes
    )


def _graph_walker(name: str) -> Callable[..., Any]:
    def walker(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"{name} walks the graphs of MQBench's tracer to pick a unit's nodes; here "
            "mqbench.advanced_ptq.find_units(model, 'layer' | 'block') returns the units (their nodes, inputs and "
            "outputs) and mqbench.advanced_ptq.ptq_reconstruction reconstructs them"
        )

    walker.__name__ = walker.__qualname__ = name
    return walker


extract_layer = _graph_walker("extract_layer")
extract_block = _graph_walker("extract_block")
extract_subgraph = _graph_walker("extract_subgraph")
find_num_nodes = _graph_walker("find_num_nodes")
get_io_of_block = _graph_walker("get_io_of_block")
find_used_times = _graph_walker("find_used_times")
find_cur_node = _graph_walker("find_cur_node")
insert_fake_modules = _graph_walker("insert_fake_modules")
prepare_fp_and_quant_model_for_ptq = _graph_walker("prepare_fp_and_quant_model_for_ptq")
