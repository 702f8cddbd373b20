"""ONNX export of a frozen model and the strip step: ONNX with Q/DQ -> float ONNX + QParamTable.

The frozen model (see :mod:`mqbench.deploy.freeze`) is exported with every quantizer call
also returning its input and output as extra, marked graph outputs. The marks tell which
ONNX tensor each quantizer read and which it wrote, whatever names the exporter chose and
whichever ``torch.onnx.export`` path ran. Stripping then points every reader of a
quantizer's output at its input (recording those readers), drops the marks, removes the
now-dead Q/DQ subgraph and records the quantizer's parameters under the input tensor.
"""

from __future__ import annotations

import contextlib
import io
import logging
import tempfile
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx
import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from mqbench.deploy.freeze import FrozenQuantizer
from mqbench.deploy.onnx_graph import (
    all_names,
    consumers_of,
    eliminate_dead_nodes,
    initializer_map,
    make_node,
    name_nodes,
    producers_of,
    rename_tensor,
    topological_sort,
    unique_name,
)
from mqbench.deploy.repair import repair_export
from mqbench.qparams import QParamTable, TensorQParams
from mqbench.utils.role import role_of

__all__ = ["ExportedGraph", "export_marked", "strip_quantizers"]

_IN, _OUT = "mqbench_mark_in_", "mqbench_mark_out_"


@dataclass
class ExportedGraph:
    """The raw export: the ONNX model with marks, and the quantizer behind each mark index."""

    model: onnx.ModelProto
    marks: list[FrozenQuantizer]
    output_names: list[str]
    input_names: list[str]


class _Marked(nn.Module):
    """The model called on its inputs' tensors (one ONNX input each), rebuilt into the structure it takes."""

    def __init__(self, model: nn.Module, structure: pytree.TreeSpec | None = None) -> None:
        super().__init__()
        self.model = model
        self.structure = structure
        self.calls: list[tuple[FrozenQuantizer, Tensor, Tensor]] = []

    def arguments(self, tensors: Sequence[Tensor]) -> tuple[Any, ...]:
        if self.structure is None:
            return tuple(tensors)
        return tuple(pytree.tree_unflatten(list(tensors), self.structure))

    def forward(self, *args: Any) -> tuple[Tensor, ...]:
        self.calls.clear()
        outputs = self.model(*self.arguments(args))
        flat, _ = pytree.tree_flatten(outputs)
        tensors = [t for t in flat if isinstance(t, Tensor)]
        marks = [t for _, x, y in self.calls for t in (x, y)]
        return (*tensors, *marks)


def export_marked(
    model: nn.Module,
    args: tuple[Tensor, ...],
    input_names: Sequence[str],
    structure: pytree.TreeSpec | None = None,
    **export_kwargs: Any,
) -> ExportedGraph:
    """Export ``model`` (frozen) with the quantizer marks; ``export_kwargs`` go to ``torch.onnx.export``.

    ``args`` are the input tensors (one ONNX input each, named ``input_names``); ``structure`` (a pytree spec
    of the forward's positional arguments) rebuilds the dicts, tuples and lists the model takes from them."""
    frozen = [m for m in model.modules() if isinstance(m, FrozenQuantizer)]
    wrapper = _Marked(model, structure)

    def tap(quantizer: FrozenQuantizer, x: Tensor, y: Tensor) -> None:
        # Clones: an in-place op after the quantizer (Hardswish(inplace=True)) must not change the marks.
        wrapper.calls.append((quantizer, x.clone(), y.clone()))

    for quantizer in frozen:
        quantizer.tap = tap
    try:
        with torch.no_grad():
            flat, _ = pytree.tree_flatten(model(*wrapper.arguments(args)))
        count = sum(isinstance(t, Tensor) for t in flat)
        marks = [quantizer for quantizer, _, _ in wrapper.calls]
        user_outputs = list(export_kwargs.pop("output_names", None) or [])
        if len(user_outputs) > count:
            raise ValueError(f"output_names has {len(user_outputs)} names but the model returns {count} tensors")
        default = [f"output_{i}" if count > 1 else "output" for i in range(len(user_outputs), count)]
        output_names = user_outputs + default
        names = output_names + [f"{prefix}{i}" for i in range(len(marks)) for prefix in (_IN, _OUT)]
        dynamic_axes = export_kwargs.pop("dynamic_axes", None)
        kwargs: dict[str, Any] = {"input_names": list(input_names), "output_names": names, **export_kwargs}
        dynamo = kwargs.setdefault("dynamo", False)
        if dynamic_axes is not None:
            kwargs["dynamic_axes"] = dynamic_axes
        if not dynamo:
            kwargs.setdefault("opset_version", 17)
        with (
            tempfile.TemporaryDirectory() as folder,
            warnings.catch_warnings(),
            _quiet_exporter_logs(),
            _positive_axes(None if dynamo else kwargs["opset_version"]),
        ):
            warnings.simplefilter("ignore")
            path = Path(folder) / "marked.onnx"
            torch.onnx.export(wrapper, args, str(path), **kwargs)
            exported = onnx.load(str(path), load_external_data=True)
        _name_outputs(exported.graph, names)
        repair_export(exported, list(zip(input_names, args, strict=False)))
    finally:
        for quantizer in frozen:
            quantizer.tap = None
    return ExportedGraph(exported, marks, output_names, list(input_names))


def _name_outputs(graph: onnx.GraphProto, names: Sequence[str]) -> None:
    """Give every output the name asked for: an output the exporter folded into a constant (a quantizer's
    input computed from parameters alone, as a layer scale ``gamma.reshape(...)`` or a relative position
    bias gathered from its table) carries the constant's name; an Identity gives it the asked one."""
    if len(graph.output) != len(names):
        raise RuntimeError(f"the exporter wrote {len(graph.output)} outputs for {len(names)} asked")
    for value, name in zip(graph.output, names, strict=True):
        if value.name != name:
            graph.node.append(make_node("Identity", [value.name], [name], f"{name}_identity"))
            value.name = name


@contextlib.contextmanager
def _quiet_exporter_logs() -> Iterator[None]:
    """The exporters log progress and optimizer notes at INFO/WARNING; deployment reports its own errors."""
    loggers = [logging.getLogger(name) for name in ("torch.onnx", "onnxscript", "onnx_ir", "torch.export")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def _transpose(g: Any, x: Any, perm: list[int]) -> Any:
    return x if perm == list(range(len(perm))) else g.op("Transpose", x, perm_i=perm)


def _permute(g: Any, x: Any, dims: list[int]) -> Any:
    return _transpose(g, x, [d % len(dims) for d in dims])


def _movedim(g: Any, x: Any, source: Tensor, destination: Tensor) -> Any:
    from torch.onnx import symbolic_helper

    rank = symbolic_helper._get_tensor_rank(x)
    if rank is None:
        raise NotImplementedError("torch.movedim on a tensor whose rank the ONNX exporter does not know")
    moved = [int(d) % rank for d in source.view(-1).tolist()]
    placed = [int(d) % rank for d in destination.view(-1).tolist()]
    perm: list[int | None] = [None] * rank
    for src, dst in zip(moved, placed, strict=True):
        perm[dst] = src
    rest = iter(d for d in range(rank) if d not in moved)
    return _transpose(g, x, [next(rest) if p is None else p for p in perm])


@contextlib.contextmanager
def _positive_axes(opset: int | None) -> Iterator[None]:
    """While exporting with TorchScript (``opset`` given), write ``permute`` and ``movedim`` with positive axes.

    torch's own rules copy negative axes into the Transpose's ``perm`` (``x.movedim(-1, 1)`` writes
    ``perm=[0, -1, 1, 2]``): the file is invalid, and the exporter folds shapes computed from the wrong
    permutation into constants (a later ``x.reshape(x.shape[0], ...)`` reshapes to a batch of 32 for 2).
    """
    if opset is None:
        yield
        return
    from torch.onnx import symbolic_helper

    rules: dict[str, Callable[..., Any]] = {
        "aten::permute": symbolic_helper.parse_args("v", "is")(_permute),
        "aten::movedim": symbolic_helper.parse_args("v", "t", "t")(_movedim),
    }
    for name, rule in rules.items():
        torch.onnx.register_custom_op_symbolic(name, rule, opset)
    try:
        yield
    finally:
        for name in rules:
            torch.onnx.unregister_custom_op_symbolic(name, opset)


def _resolve(name: str, producers: Mapping[str, onnx.NodeProto]) -> str:
    """Follow Identity nodes (the exporter's, for mark outputs and for a network input returned) to the real tensor."""
    node = producers.get(name)
    while node is not None and node.op_type == "Identity":
        name = node.input[0]
        node = producers.get(name)
    return name


def _depends_only_on(
    output: str, source: str, producers: Mapping[str, onnx.NodeProto], constants: set[str]
) -> str | None:
    """None if ``output`` is computed from ``source`` and constants alone; else a tensor it also reads."""
    stack, seen = [output], set()
    while stack:
        name = stack.pop()
        if name in seen or name == source or name in constants or not name:
            continue
        seen.add(name)
        node = producers.get(name)
        if node is None:
            return name
        stack.extend(node.input)
    return None


def strip_quantizers(exported: ExportedGraph) -> tuple[onnx.ModelProto, QParamTable]:
    """The float model (marks and quantizer subgraphs removed) and the parameters of each quantized tensor."""
    model = onnx.ModelProto.FromString(exported.model.SerializeToString())
    graph = model.graph
    name_nodes(graph)
    mark_names = {v.name for v in graph.output if v.name.startswith((_IN, _OUT))}
    producers = producers_of(graph)
    constants = set(initializer_map(graph))
    entries: dict[str, TensorQParams] = {}
    rewires: list[tuple[str, str, str]] = []
    calls: dict[str, int] = {}
    readers_of = consumers_of(graph)  # the loop below does not change the graph
    for index, quantizer in enumerate(exported.marks):
        source = _resolve(f"{_IN}{index}", producers)
        result = _resolve(f"{_OUT}{index}", producers)
        stray = _depends_only_on(result, source, producers, constants)
        if stray is not None:
            raise RuntimeError(
                f"the exported form of {quantizer.name} reads {stray!r} besides its input {source!r}; "
                "this exporter output is not supported"
            )
        call = calls.get(quantizer.name, 0)
        calls[quantizer.name] = call + 1
        readers = readers_of.get(result, [])
        consumers = tuple(n.name for n in readers if not (n.op_type == "Identity" and n.output[0] in mark_names))
        entry = TensorQParams(
            quantizer.scale.numpy(),
            quantizer.zero_point.numpy(),
            quantizer.quant_min,
            quantizer.quant_max,
            1 if quantizer.group_size is not None else quantizer.axis,  # group-wise: blocked along axis 1
            kind=quantizer.kind,
            consumers=None if quantizer.kind == "weight" else consumers,
            grid=quantizer.grid,
            data_max=quantizer.data_max,
            quantizer=quantizer.name,
            extra={"call": call},
            group_size=quantizer.group_size,
        )
        previous = entries.get(source)
        if previous is not None:
            if not previous.same_quantization(entry):
                raise RuntimeError(
                    f"tensor {source!r} is quantized by {previous.quantizer} and {quantizer.name} with different "
                    "parameters; deployment formats hold one set per tensor (make the two quantizers share one)"
                )
            if previous.consumers is not None and entry.consumers is not None:
                entries[source] = previous.with_changes(consumers=previous.consumers + entry.consumers)
        else:
            entries[source] = entry
        rewires.append((result, source, source))
    # Point readers of each quantizer output at its input; graph outputs get an Identity.
    output_names = {v.name for v in graph.output}
    taken = all_names(graph)
    rewiring = _Rewiring([(result, source) for result, source, _ in rewires])
    rewiring.apply(graph)
    for position, (result, source, key) in enumerate(rewires):
        if result in output_names and result not in mark_names:
            # (an Identity added here would have been rewired by the later pairs)
            reads = rewiring.final(source, position)
            identity = make_node("Identity", [reads], [result], unique_name(f"{result}_identity", taken))
            graph.node.append(identity)
            entry = entries[key]
            if entry.consumers is not None:  # the network output reads the quantized value
                entry = entry.with_changes(consumers=(*entry.consumers, identity.name))
            entries[key] = entry.with_changes(
                extra={**entry.extra, "outputs": (*entry.extra.get("outputs", ()), result)}
            )
            # The Q/DQ subgraph that produced it must no longer write the same name.
            producer = producers.get(result)
            if producer is not None and producer.op_type != "Identity":
                renamed = unique_name(f"{result}_quantized", taken)
                for i, name in enumerate(producer.output):
                    if name == result:
                        producer.output[i] = renamed
    kept = [v for v in graph.output if v.name not in mark_names]
    del graph.output[:]
    graph.output.extend(kept)
    eliminate_dead_nodes(graph)
    topological_sort(graph)
    entries = _drop_wrapper_prefix(graph, entries)
    subjects = {q.name: role_of(q.name, q).subject for q in exported.marks}
    entries = _readable_names(graph, entries, subjects)
    return model, QParamTable(entries)


class _Rewiring:
    """Renaming node inputs by a list of (old, new) pairs as applying each in turn to the whole graph would."""

    def __init__(self, rewires: list[tuple[str, str]]) -> None:
        self.first: dict[str, tuple[int, str]] = {}
        for index, (old, new) in enumerate(rewires):
            self.first.setdefault(old, (index, new))

    def final(self, name: str, after: int = -1) -> str:
        """The name an input ``name`` ends as when the pairs after position ``after`` are applied."""
        while name in self.first and self.first[name][0] > after:
            after, name = self.first[name]
        return name

    def apply(self, graph: onnx.GraphProto) -> None:
        for node in graph.node:
            for i, name in enumerate(node.input):
                if name in self.first:
                    node.input[i] = self.final(name)


def _drop_wrapper_prefix(graph: onnx.GraphProto, entries: dict[str, TensorQParams]) -> dict[str, TensorQParams]:
    """Names the exporter derived from the marking wrapper (``model.conv1.weight``, ``/model/conv1/Conv``) lose it."""
    taken = all_names(graph)

    def strip(name: str) -> str:
        for prefix, replacement in (("model.", ""), ("/model/", "/")):
            if name.startswith(prefix):
                new = replacement + name[len(prefix) :]
                if new not in taken:
                    return new
        return name

    tensors = {v.name for v in graph.input} | {i.name for i in graph.initializer}
    tensors |= {name for node in graph.node for name in (*node.input, *node.output) if name}
    mapping = {name: strip(name) for name in tensors}
    mapping = {old: new for old, new in mapping.items() if old != new}
    for node in graph.node:
        node.name = strip(node.name)
        node.input[:] = [mapping.get(name, name) for name in node.input]
        node.output[:] = [mapping.get(name, name) for name in node.output]
    for collection in (graph.input, graph.output, graph.value_info, graph.initializer):
        for value in collection:
            value.name = mapping.get(value.name, value.name)
    renamed = {}
    for name, entry in entries.items():
        if entry.consumers is not None:
            entry = entry.with_changes(consumers=tuple(strip(c) for c in entry.consumers))
        renamed[mapping.get(name, name)] = entry
    return renamed


def _readable_names(
    graph: onnx.GraphProto, entries: dict[str, TensorQParams], subjects: Mapping[str, str]
) -> dict[str, TensorQParams]:
    """Rename tensors still carrying a mark name after what their quantizer quantizes (its role's subject:
    ``conv1`` for the quantizer of value ``conv1``, ``layer1.conv.weight`` for a weight quantizer)."""
    taken = all_names(graph)
    renamed: dict[str, TensorQParams] = {}
    for name, entry in entries.items():
        if name.startswith((_IN, _OUT)):
            new = unique_name(subjects.get(entry.quantizer, "tensor"), taken)
            rename_tensor(graph, name, new)
            name = new
        renamed[name] = entry
    for value in graph.output:
        if value.name.startswith((_IN, _OUT)):
            raise RuntimeError(f"a mark output survived stripping: {value.name}")
    return renamed
