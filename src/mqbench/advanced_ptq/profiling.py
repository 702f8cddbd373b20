"""Where a quantized model's error comes from: each layer's output against the float model's.

A *layer* here is one quantized operation of a prepared model: a module with a weight quantizer
(and the activation quantizers on its output), or any other node whose output an activation
quantizer reads (an ``add``, a ``cat``, the network input). Each layer's output (after its
output quantizer, where it has one) is compared with the same tensor of the float model:

* ``standalone``: only that layer's quantizers quantize, everything else computes in float:
  the error the layer causes on its own. Weights (``part="weight"``), activations
  (``"activation"``) and both (``"both"``) are measured separately.
* ``interaction``: every layer up to and including it (in graph order) quantizes: the error that
  has accumulated by that point.

The metrics are the SQNR in dB (``10 log10(sum f^2 / sum (f - q)^2)``), the cosine similarity and
the mean squared error of the quantized output ``q`` against the float output ``f``, summed over
every batch. The model's quantizer switches are restored afterwards.

:func:`profiling` is MQBench's call (it logs the table); :func:`profile_layers` returns the rows.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from mqbench.prepare_by_platform import prepare_by_platform
    >>> from mqbench.utils.state import enable_calibration, enable_quantization
    >>> from mqbench.advanced_ptq.profiling import profile_layers
    >>> torch.manual_seed(0) and None
    >>> model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3)).eval()
    >>> qmodel = prepare_by_platform(model, "tensorrt")
    >>> data = [torch.randn(2, 3, 12, 12) for _ in range(2)]
    >>> enable_calibration(qmodel)
    >>> for batch in data:
    ...     _ = qmodel(batch)
    >>> enable_quantization(qmodel)
    >>> table = profile_layers(qmodel, data, modes=("standalone",), parts=("both",))
    >>> [row.name for row in table]
    ['input_1', '0', '2']
    >>> all(row.sqnr_db > 25 for row in table)
    True
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from contextlib import suppress
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor, fx, nn
from tqdm.auto import tqdm

from mqbench.advanced_ptq.mqbench_api import node2modules, to_device
from mqbench.advanced_ptq.reconstruction import call_with
from mqbench.utils.hook import StopForwardException
from mqbench.utils.logger import logger
from mqbench.utils.state import all_switched_off, is_quantizer

__all__ = [
    "QUANT_FUNCTION_TYPE",
    "QUANT_MODULE_TYPE",
    "LayerError",
    "ProfileTable",
    "ProfileUnit",
    "cosine",
    "find_units",
    "node2modules",
    "profile_layers",
    "profile_summary",
    "profiling",
    "to_device",
    "update_model_with_dummy_module",
]

MODES = ("standalone", "interaction")
PARTS = ("weight", "activation", "both")


@dataclass(frozen=True)
class ProfileUnit:
    """One quantized layer: its quantizers and the module whose output is measured."""

    name: str  # the module's qualified name, or the graph node's name for functions and inputs
    op: str  # the module class or function name
    weight: str | None  # the weight quantizer's qualified name
    activations: tuple[str, ...]  # the activation quantizers reading the layer's output
    endpoint: str  # the module whose output is compared (the output quantizer, else the layer)

    def quantizers(self, part: str) -> tuple[str, ...]:
        weight = () if self.weight is None else (self.weight,)
        return {"weight": weight, "activation": self.activations, "both": weight + self.activations}[part]


@dataclass(frozen=True)
class LayerError:
    """The error of one layer's output in one mode and part (see the module docstring)."""

    name: str
    op: str
    mode: str
    part: str
    quantizers: tuple[str, ...]
    sqnr_db: float
    cosine: float
    mse: float


class ProfileTable(list[LayerError]):
    """The rows of a profile, in graph order; a list with a few views."""

    def select(self, mode: str | None = None, part: str | None = None) -> ProfileTable:
        return ProfileTable(r for r in self if (mode is None or r.mode == mode) and (part is None or r.part == part))

    def worst(self, count: int = 5, mode: str = "standalone", part: str = "both") -> ProfileTable:
        """The ``count`` rows of lowest SQNR in one mode and part."""
        return ProfileTable(sorted(self.select(mode, part), key=lambda r: r.sqnr_db)[:count])

    def as_dicts(self) -> list[dict[str, Any]]:
        return [{**asdict(r), "quantizers": list(r.quantizers)} for r in self]

    def to_markdown(self) -> str:
        """One line per layer; a column per (mode, part) measured, holding the SQNR in dB."""
        present = {(r.mode, r.part) for r in self}
        columns = [(m, p) for m in MODES for p in PARTS if (m, p) in present]
        layers = list(dict.fromkeys((r.name, r.op) for r in self))
        value = {(r.name, r.mode, r.part): r.sqnr_db for r in self}
        head = "| layer | op | " + " | ".join(f"{mode} {part} SQNR dB" for mode, part in columns) + " |"
        lines = [head, "|" + " --- |" * (2 + len(columns))]
        for name, op in layers:
            cells = [_format_db(value.get((name, mode, part))) for mode, part in columns]
            lines.append(f"| {name} | {op} | " + " | ".join(cells) + " |")
        return "\n".join(lines)


def _format_db(value: float | None) -> str:
    if value is None:
        return ""
    return "inf" if math.isinf(value) else f"{value:.1f}"


# -- the layers of a prepared graph ---------------------------------------------------------------
def _op_name(node: fx.Node, modules: dict[str, nn.Module]) -> str:
    if node.op == "call_module":
        return type(modules[str(node.target)]).__name__
    if node.op == "placeholder":
        return "input"
    target = node.target
    return getattr(target, "__name__", str(target))


def _graphs(model: nn.Module, module_list: Sequence[str] | None) -> list[tuple[str, fx.GraphModule]]:
    if module_list is None:
        if not isinstance(model, fx.GraphModule):
            raise TypeError(
                f"profiling needs a model prepared by prepare_by_platform (a torch.fx.GraphModule), not "
                f"{type(model).__name__}; for a model whose prepared parts are submodules, pass their names "
                "as module_list"
            )
        return [("", model)]
    graphs = []
    named = dict(model.named_modules())
    for name in module_list:
        child = named.get(name)
        if not isinstance(child, fx.GraphModule):
            raise ValueError(f"module_list names {name!r}, which is not a prepared GraphModule of the model")
        graphs.append((f"{name}.", child))
    return graphs


def find_units(model: nn.Module, module_list: Sequence[str] | None = None) -> list[ProfileUnit]:
    """The quantized layers of a prepared model, in graph order."""
    units: list[ProfileUnit] = []
    for prefix, graph_module in _graphs(model, module_list):
        modules = dict(graph_module.named_modules())
        outputs: dict[fx.Node, list[str]] = {}
        for node in graph_module.graph.nodes:
            if node.op == "call_module" and is_quantizer(modules[str(node.target)]):
                producer = node.args[0] if node.args else None
                if isinstance(producer, fx.Node):
                    outputs.setdefault(producer, []).append(str(node.target))
        for node in graph_module.graph.nodes:
            module = modules.get(str(node.target)) if node.op == "call_module" else None
            if module is not None and is_quantizer(module):
                continue
            weight = getattr(module, "weight_fake_quant", None) if module is not None else None
            weight_name = f"{prefix}{node.target}.weight_fake_quant" if is_quantizer_module(weight) else None
            activations = tuple(f"{prefix}{name}" for name in outputs.get(node, []))
            if weight_name is None and not activations:
                continue
            endpoint = activations[0] if len(activations) == 1 or module is None else f"{prefix}{node.target}"
            name = f"{prefix}{node.target}" if node.op == "call_module" else f"{prefix}{node.name}"
            units.append(ProfileUnit(name, _op_name(node, modules), weight_name, activations, endpoint))
    return units


def is_quantizer_module(module: object) -> bool:
    return isinstance(module, nn.Module) and is_quantizer(module)


# -- measuring ------------------------------------------------------------------------------------
def _first_tensor(value: Any) -> Tensor:
    if isinstance(value, Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], Tensor):
        return value[0]
    raise TypeError(f"a profiled layer returned {type(value).__name__}, not a tensor")


class _Sums:
    """Running sums of f^2, q^2, f q and (f - q)^2 in float64."""

    def __init__(self) -> None:
        self.ff = self.qq = self.fq = self.ee = 0.0
        self.count = 0

    def add(self, f: Tensor, q: Tensor) -> None:
        f, q = f.detach().double().flatten(), q.detach().double().flatten()
        self.ff += float(f @ f)
        self.qq += float(q @ q)
        self.fq += float(f @ q)
        self.ee += float((f - q) @ (f - q))
        self.count += f.numel()

    def sqnr_db(self) -> float:
        if self.ee == 0.0:
            return math.inf
        if self.ff == 0.0:
            return -math.inf
        return 10.0 * math.log10(self.ff / self.ee)

    def cosine(self) -> float:
        denominator = math.sqrt(self.ff * self.qq)
        return self.fq / denominator if denominator > 0 else (1.0 if self.ee == 0.0 else 0.0)

    def mse(self) -> float:
        return self.ee / max(self.count, 1)


def _capture(modules: dict[str, nn.Module], names: Iterable[str], stop: bool) -> tuple[dict[str, Tensor], list[Any]]:
    store: dict[str, Tensor] = {}
    remaining = set(names)
    handles = []
    for name in remaining.copy():

        def hook(module: nn.Module, args: Any, output: Any, name: str = name) -> None:
            store[name] = _first_tensor(output).detach().clone()
            remaining.discard(name)
            if stop and not remaining:
                raise StopForwardException

        handles.append(modules[name].register_forward_hook(hook))
    return store, handles


def _run(model: nn.Module, batch: Any) -> None:
    with suppress(StopForwardException):
        call_with(model, batch)


def profile_layers(
    model: nn.Module,
    data: Iterable[Any],
    modes: Sequence[str] = MODES,
    parts: Sequence[str] = PARTS,
    module_list: Sequence[str] | None = None,
    progress: bool = False,
) -> ProfileTable:
    """Every layer's error against float (see the module docstring); rows in graph order, modes then parts.

    ``model`` is prepared and calibrated; ``data`` is a re-iterable of batches (a tensor or a tuple of
    the model's positional arguments). ``interaction`` is measured with ``part="both"`` only.
    """
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"unknown profiling mode {mode!r}; use one of {', '.join(MODES)}")
    for part in parts:
        if part not in PARTS:
            raise ValueError(f"unknown part {part!r}; use one of {', '.join(PARTS)}")
    batches = list(data)
    if not batches:
        raise ValueError("profiling needs at least one batch of data")
    units = find_units(model, module_list)
    if not units:
        raise ValueError("the model has no quantized layer to profile (was it prepared by prepare_by_platform?)")
    configurations: list[tuple[ProfileUnit, str, str, tuple[str, ...]]] = []
    for index, unit in enumerate(units):
        for mode in modes:
            if mode == "standalone":
                configurations += [(unit, mode, part, unit.quantizers(part)) for part in parts if unit.quantizers(part)]
            else:
                upto = tuple(name for earlier in units[: index + 1] for name in earlier.quantizers("both"))
                configurations.append((unit, mode, "both", upto))
    sums = [_Sums() for _ in configurations]
    modules = dict(model.named_modules())
    was_training = model.training
    model.eval()
    try:
        with all_switched_off(model) as found, torch.no_grad():
            iterator: Iterable[Any] = batches
            if progress:
                iterator = tqdm(batches, desc="profiling", unit="batch", leave=False)
            for batch in iterator:
                reference, handles = _capture(modules, {unit.endpoint for unit in units}, stop=False)
                try:
                    _run(model, batch)
                finally:
                    for handle in handles:
                        handle.remove()
                for (unit, _, _, enabled), total in zip(configurations, sums, strict=True):
                    for name in enabled:
                        found[name].enable_fake_quant(True)
                    captured, handles = _capture(modules, [unit.endpoint], stop=True)
                    try:
                        _run(model, batch)
                    finally:
                        for handle in handles:
                            handle.remove()
                        for name in enabled:
                            found[name].enable_fake_quant(False)
                    total.add(reference[unit.endpoint], captured[unit.endpoint])
    finally:
        model.train(was_training)
    return ProfileTable(
        LayerError(unit.name, unit.op, mode, part, enabled, total.sqnr_db(), total.cosine(), total.mse())
        for (unit, mode, part, enabled), total in zip(configurations, sums, strict=True)
    )


def profiling(
    model: nn.Module,
    cali_data: Iterable[Any],
    profiling_type: str = "standalone",
    module_list: Sequence[str] | None = None,
) -> ProfileTable:
    """MQBench's per-layer profile: each layer's output cosine against float, logged as a table.

    ``profiling_type`` is ``"standalone"`` (only that layer quantized) or ``"interaction"``
    (every layer up to it quantized); the layer's weight and output quantizers are both on. Logs
    the table and the worst layer, and returns the rows (see :func:`profile_layers` for the
    weight / activation split). The model's quantizer switches are left as they were.
    """
    if profiling_type not in MODES:
        raise ValueError(f"unknown profiling_type {profiling_type!r}; use 'standalone' or 'interaction'")
    table = profile_layers(model, cali_data, modes=(profiling_type,), parts=("both",), module_list=module_list)
    lines = [f"Profile type {profiling_type}", "| op | layer | quantizers | cosine | SQNR dB |", "|" + " --- |" * 5]
    for row in table:
        enabled = ", ".join(row.quantizers) if len(row.quantizers) <= 2 else f"{len(row.quantizers)} quantizers"
        lines.append(f"| {row.op} | {row.name} | {enabled} | {row.cosine:.6f} | {_format_db(row.sqnr_db)} |")
    logger.info("\n".join(lines))
    logger.info(profile_summary(table))
    return table


# -- MQBench's helper names ---------------------------------------------------------------------------------
# The module and function types whose outputs MQBench's profiling compared (here: every quantized op).
QUANT_MODULE_TYPE = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose2d, nn.Linear, nn.Embedding)
QUANT_FUNCTION_TYPE = (torch.add, torch.cat, torch.matmul, torch.nn.functional.linear, torch.nn.functional.conv2d)


def cosine(x: Tensor, y: Tensor) -> float:
    """The cosine similarity of two tensors, flattened."""
    x, y = x.detach().flatten().double(), y.detach().flatten().double()
    return float((x @ y) / (x.norm() * y.norm()).clamp_min(1e-30))


def profile_summary(result: Iterable[LayerError | Mapping[str, Any]]) -> str:
    """MQBench's summary of a profile: the mean cosine and the worst layer, from :func:`profiling`'s rows or from
    MQBench's result dicts (``name``, ``op``, ``nodes``, ``cos``)."""
    rows = [
        (r["name"], r["op"], r.get("nodes"), float(r["cos"]))
        if isinstance(r, Mapping)
        else (r.name, r.op, list(r.quantizers), r.cosine)
        for r in result
    ]
    if not rows:
        raise ValueError("profile_summary needs the rows of at least one profiled layer")
    name, op, nodes, worst = min(rows, key=lambda row: row[3])
    return (
        f"avg cos: {sum(row[3] for row in rows) / len(rows)}\nworst layer: {name}({op}) with nodes {nodes} cos {worst}"
    )


def update_model_with_dummy_module(
    fp_model: fx.GraphModule,
    quant_model: fx.GraphModule,
    quant_node: fx.Node,
    fp_node: fx.Node,
    quant_nodes: Sequence[fx.Node],
    fp_nodes: Sequence[fx.Node],
    quant_node2module: dict[fx.Node, nn.Module],
    fp_node2module: dict[fx.Node, nn.Module],
) -> tuple[fx.Node, fx.Node, fx.GraphModule, fx.GraphModule, dict[fx.Node, nn.Module], dict[fx.Node, nn.Module]]:
    """MQBench's step for profiling a function's output: an ``nn.Identity`` module (``<node name>_dummy``) after
    ``quant_node`` in ``quant_model`` and after ``fp_node`` in ``fp_model``, read in the node's place by the nodes
    of ``quant_nodes`` / ``fp_nodes`` that read it, so that a forward hook on the module sees the function's
    output. The maps get each new node's module; returns ``(quant dummy node, fp dummy node, fp_model,
    quant_model, quant_node2module, fp_node2module)``, the models changed in place."""
    if not isinstance(fp_model, fx.GraphModule) or not isinstance(quant_model, fx.GraphModule):
        raise ValueError(
            "update_model_with_dummy_module takes the float and the quantized model as torch.fx.GraphModule, got "
            f"{type(fp_model).__name__} and {type(quant_model).__name__}"
        )
    inserted = []
    for model, node, readers, node2module in (
        (quant_model, quant_node, quant_nodes, quant_node2module),
        (fp_model, fp_node, fp_nodes, fp_node2module),
    ):
        dummy = nn.Identity()
        target = f"{node.name}_dummy"
        model.add_submodule(target, dummy)
        with model.graph.inserting_after(node):
            new = model.graph.call_module(target, args=(node,))
        for reader in readers:
            if reader is not new and node in reader.all_input_nodes:
                reader.replace_input_with(node, new)
        node2module[new] = dummy
        model.graph.lint()
        model.recompile()
        inserted.append(new)
    return inserted[0], inserted[1], fp_model, quant_model, quant_node2module, fp_node2module
