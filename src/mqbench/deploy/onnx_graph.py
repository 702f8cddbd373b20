"""Small helpers over ONNX graphs shared by the deploy steps (no backend knowledge here)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

__all__ = [
    "ORT_MAX_IR_VERSION",
    "consumers_of",
    "eliminate_dead_nodes",
    "free_output_name",
    "initializer_map",
    "ort_session",
    "producers_of",
    "save_model",
    "unique_name",
]

# The newest IR version the supported onnxruntime releases load (onnx may stamp a newer one).
ORT_MAX_IR_VERSION = 10


def save_model(model: onnx.ModelProto, path: str | Path) -> str:
    """Write ``model`` (IR version lowered to what onnxruntime loads), checked first."""
    model.ir_version = min(model.ir_version, ORT_MAX_IR_VERSION)
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return str(path)


def ort_session(model: onnx.ModelProto | str | Path, threads: int = 2, optimize: bool = True):  # type: ignore[no-untyped-def]
    """An onnxruntime CPU session with ``threads`` intra-op threads and spinning off (steady timings).

    ``optimize=False`` disables graph optimizations: Q/DQ pairs then run as written (float ops on
    dequantized values) instead of fused into int8 kernels, whose results depend on the CPU.
    """
    import onnxruntime as ort

    if isinstance(model, onnx.ModelProto):
        stamped = model.ir_version
        model.ir_version = min(stamped, ORT_MAX_IR_VERSION)  # serialized with the version lowered, then restored
        try:
            source: bytes | str = model.SerializeToString()
        finally:
            model.ir_version = stamped
    else:
        source = str(model)
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.add_session_config_entry("session.inter_op.allow_spinning", "0")
    if not optimize:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    disabled = []
    if optimize and _has_float8(model):
        # onnxruntime's Clip -> QuantizeLinear fusion reads the zero point as an integer and fails to build the
        # session on a FLOAT8 one (onnxruntime 1.32); the fusion only removes a Clip the saturation makes redundant
        disabled.append("ClipQuantRewrite")
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"], disabled_optimizers=disabled)


_FLOAT8 = {
    onnx.TensorProto.FLOAT8E4M3FN,
    onnx.TensorProto.FLOAT8E4M3FNUZ,
    onnx.TensorProto.FLOAT8E5M2,
    onnx.TensorProto.FLOAT8E5M2FNUZ,
}


def _has_float8(model: onnx.ModelProto | str | Path) -> bool:
    proto = model if isinstance(model, onnx.ModelProto) else onnx.load(str(model), load_external_data=False)
    return any(init.data_type in _FLOAT8 for init in proto.graph.initializer)


def initializer_map(graph: onnx.GraphProto) -> dict[str, onnx.TensorProto]:
    return {init.name: init for init in graph.initializer}


def producers_of(graph: onnx.GraphProto) -> dict[str, onnx.NodeProto]:
    return {output: node for node in graph.node for output in node.output if output}


def consumers_of(graph: onnx.GraphProto) -> dict[str, list[onnx.NodeProto]]:
    users: dict[str, list[onnx.NodeProto]] = defaultdict(list)
    for node in graph.node:
        for name in node.input:
            if name:
                users[name].append(node)
    return users


def unique_name(base: str, taken: set[str]) -> str:
    """``base`` or ``base_1``, ``base_2``, ... whichever is not in ``taken`` (which it is added to)."""
    name, k = base, 0
    while name in taken:
        k += 1
        name = f"{base}_{k}"
    taken.add(name)
    return name


def all_names(graph: onnx.GraphProto) -> set[str]:
    names = {v.name for v in graph.input} | {v.name for v in graph.output} | {i.name for i in graph.initializer}
    for node in graph.node:
        names.update(node.input)
        names.update(node.output)
        names.add(node.name)
    return names


def name_nodes(graph: onnx.GraphProto) -> None:
    """Give every node a unique name (reports and consumer lists refer to nodes by name)."""
    taken: set[str] = set()
    for node in graph.node:
        if not node.name or node.name in taken:
            node.name = unique_name(node.name or f"{node.op_type}_node", taken)
        else:
            taken.add(node.name)


def eliminate_dead_nodes(graph: onnx.GraphProto) -> None:
    """Drop nodes, initializers and value infos nothing needed for the graph outputs reads."""
    needed = {v.name for v in graph.output}
    keep: list[onnx.NodeProto] = []
    for node in reversed(list(graph.node)):
        if any(out in needed for out in node.output) or _has_subgraph(node):
            keep.append(node)
            needed.update(name for name in node.input if name)
    keep.reverse()
    del graph.node[:]
    graph.node.extend(keep)
    inits = [init for init in graph.initializer if init.name in needed]
    del graph.initializer[:]
    graph.initializer.extend(inits)
    infos = [v for v in graph.value_info if v.name in needed]
    del graph.value_info[:]
    graph.value_info.extend(infos)


def _has_subgraph(node: onnx.NodeProto) -> bool:
    return any(attr.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for attr in node.attribute)


def rename_tensor(graph: onnx.GraphProto, old: str, new: str) -> None:
    """Rename a tensor everywhere it appears (node inputs/outputs, graph inputs/outputs, initializers)."""
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name == old:
                node.input[i] = new
        for i, name in enumerate(node.output):
            if name == old:
                node.output[i] = new
    for collection in (graph.input, graph.output, graph.value_info):
        for value in collection:
            if value.name == old:
                value.name = new
    for init in graph.initializer:
        if init.name == old:
            init.name = new


def constant(name: str, value: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(np.array(value, copy=True, order="C"), name)


def topological_sort(graph: onnx.GraphProto) -> None:
    """Order nodes so every input is produced before it is read (stable for already-sorted graphs)."""
    available = {v.name for v in graph.input} | {i.name for i in graph.initializer} | {""}
    pending = list(graph.node)
    ordered: list[onnx.NodeProto] = []
    while pending:
        progressed = False
        rest = []
        for node in pending:
            if all(name in available for name in node.input):
                ordered.append(node)
                available.update(node.output)
                progressed = True
            else:
                rest.append(node)
        if not progressed:
            missing = sorted({n for node in rest for n in node.input if n not in available})[:5]
            raise ValueError(f"the graph reads tensors nothing produces: {missing}")
        pending = rest
    del graph.node[:]
    graph.node.extend(ordered)


def make_node(op_type: str, inputs: Iterable[str], outputs: Iterable[str], name: str, **attrs: Any) -> onnx.NodeProto:
    return helper.make_node(op_type, list(inputs), list(outputs), name=name, **attrs)


def free_output_name(
    graph: onnx.GraphProto, users: dict[str, list[onnx.NodeProto]], tensor: str, taken: set[str]
) -> str:
    """Move network output ``tensor``'s value to a new name (returned) so that another node can write ``tensor``."""
    moved = unique_name(f"{tensor}_float", taken)
    for node in graph.node:
        node.output[:] = [moved if name == tensor else name for name in node.output]
        node.input[:] = [moved if name == tensor else name for name in node.input]
    users[moved] = users.pop(tensor, [])
    return moved
