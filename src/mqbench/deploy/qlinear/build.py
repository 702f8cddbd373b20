"""The QLinear form of a Q/DQ model (:func:`to_qlinear`), its integer tensors, and the ``qlinear_onnx`` artifact."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnx

from mqbench.deploy.onnx_graph import save_model
from mqbench.deploy.qlinear.commuting import COMMUTING_RULES, DATA_MOVEMENT
from mqbench.deploy.qlinear.converter import METADATA_KEY, Converter, IntegerTensors
from mqbench.deploy.qlinear.grid import Input
from mqbench.deploy.qlinear.operators import OPERATOR_RULES
from mqbench.qparams import QParamTable

if TYPE_CHECKING:
    from mqbench.deploy.context import DeployContext

__all__ = ["exposed_tensors", "float_ops", "to_qlinear", "write"]


def _sources(converter: Converter, table: QParamTable) -> dict[str, Input]:
    """Table tensor -> (its integer tensor, grid) in the Q/DQ model: the input of its DequantizeLinear."""
    sources: dict[str, Input] = {}
    for node in converter.nodes:
        grid = converter.grid_of(node, "DQ")
        quantize = converter.producer(node.input[0]) if grid is not None else None
        tensor = quantize.input[0] if quantize is not None and quantize.op_type == "QuantizeLinear" else ""
        while tensor and tensor not in table:  # a narrow range is a Clip (or Max/Min) in front of the Q
            clip = converter.producer(tensor)
            tensor = clip.input[0] if clip is not None and clip.op_type in ("Clip", "Max", "Min") else ""
        if grid is not None and not tensor:  # a quantized network output: DQ -> Identity -> output name
            named = [r.output[0] for r in converter.readers(node.output[0]) if r.op_type == "Identity"]
            tensor = next((t for t in named if t in table), "")
        if grid is not None and tensor and tensor not in sources:
            sources[tensor] = (node.input[0], grid)
    return sources


def to_qlinear(
    qdq_model: onnx.ModelProto, table: QParamTable, activation_type: str = "uint8", weight_type: str | None = None
) -> tuple[onnx.ModelProto, IntegerTensors]:
    """The integer form of ``qdq_model`` (from :func:`~mqbench.deploy.qdq.insert_qdq` with ``table``).

    ``activation_type`` ("uint8" or "int8") holds the integer activations; int8 x int8
    convolution has no fast kernel in onnxruntime on x86. ``weight_type`` ("int8", "uint8" or
    None to keep the Q/DQ model's) does the same for constant weights: "int8" takes the
    uint8 x int8 kernels, about twice as fast as uint8 x uint8 on CPUs with VNNI (without VNNI
    those may saturate 16-bit intermediate sums, which is why weights keep their type unless asked).

    Also returns (and records in the model's metadata, see :func:`exposed_tensors`), for every
    table tensor that exists as an 8-bit integer tensor in the result, ``(integer tensor name,
    scale, zero_point)``: floats per tensor, arrays per channel; the zero point is that of the
    tensor's 8-bit type.
    """
    for label, value, allowed in (("activation_type", activation_type, ("uint8", "int8")),
                                  ("weight_type", weight_type, ("uint8", "int8", None))):  # fmt: skip
        if value not in allowed:
            raise ValueError(f"{label} must be one of {allowed}, got {value!r}")
    versions = {o.domain: o.version for o in qdq_model.opset_import}
    version = versions.get("", versions.get("ai.onnx", 0))
    if version < 13:
        raise ValueError(f"the QLinear form needs ONNX opset 13 or newer (integer Clip), got opset {version}")
    weights = None if weight_type is None else np.dtype(weight_type)
    converter = Converter(qdq_model, weights, OPERATOR_RULES, COMMUTING_RULES)
    known = (
        set(converter.inits) | {v.name for v in converter.graph.input} | {o for n in converter.nodes for o in n.output}
    )
    missing = [t for t in table if t not in known]
    if missing:
        raise ValueError(f"the parameter table names tensors the model does not have: {missing[:5]}")
    sources = _sources(converter, table)
    converter.sweep(converter.fold_constant)
    converter.switch_activation_type(np.dtype(activation_type))
    for rewrite in (converter.sink_dequantize, converter.hoist_quantize, converter.fold_requantize):
        converter.sweep(rewrite)
    converter.sweep(converter.convert)
    converter.sweep(converter.merge_clips)
    return converter.finish(sources)


def exposed_tensors(model: onnx.ModelProto, table: QParamTable) -> IntegerTensors:
    """The integer tensors of ``table``'s tensors in a model :func:`to_qlinear` wrote (from its metadata)."""
    props = {p.key: p.value for p in model.metadata_props}
    if METADATA_KEY not in props:
        raise ValueError(f"the model has no {METADATA_KEY!r} metadata; it was not written by to_qlinear")
    present = {i.name for i in model.graph.initializer} | {o for n in model.graph.node for o in n.output}
    result: IntegerTensors = {}
    for tensor, (name, scale, zero) in json.loads(props[METADATA_KEY]).items():
        if tensor in table and name in present:
            per_channel = isinstance(scale, list)
            result[tensor] = (
                name,
                np.asarray(scale, np.float32) if per_channel else float(np.float32(scale)),
                np.asarray(zero, np.int32) if per_channel else int(zero),
            )
    return result


def float_ops(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """Compute operators of a converted model that still run in float on dequantized inputs."""
    dequantized = {n.output[0] for n in model.graph.node if n.op_type == "DequantizeLinear"}
    return [
        node
        for node in model.graph.node
        if node.op_type not in DATA_MOVEMENT | {"Shape", "Size", "QuantizeLinear", "DequantizeLinear"}
        and any(name in dequantized for name in node.input)
    ]


def write(context: DeployContext) -> Path:
    """The ``qlinear_onnx`` artifact: ``<model_name>_qlinear.onnx``; warns naming the ops left in float.

    MQBench's ONNX QNN deployment writes its QLinear model over ``<model_name>.onnx``; here that
    name is the Q/DQ model every deployment holds (the ``onnx`` artifact), which verification
    compares the QLinear model with, so the QLinear model keeps a name of its own.
    """
    model, _ = to_qlinear(context.qdq_model, context.table, weight_type=context.qlinear_weight_type)
    left = float_ops(model)
    if left:
        shown = ", ".join(f"{node.op_type} {node.name!r}" for node in left[:8])
        more = f" and {len(left) - 8} more" if len(left) > 8 else ""
        warnings.warn(
            f"{len(left)} op(s) have no integer kernel in onnxruntime and run in float between "
            f"DequantizeLinear and QuantizeLinear in the QLinear graph: {shown}{more}",
            stacklevel=2,
        )
    path = context.path("_qlinear.onnx")
    save_model(model, path)
    return path
