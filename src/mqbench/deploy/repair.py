"""Repairs of what ``torch.onnx.export`` writes, before anything reads the exported graph.

Each repair keeps the model's meaning and makes the file one every runtime and every
parameter file can take:

* a ``Transpose`` whose ``perm`` holds negative axes (``x.movedim(1, -1)`` exports so) is
  invalid ONNX; the axes are made positive (``perm`` has one entry per axis);
* the exporter merges initializers with equal contents (all-zero weights, as a residual
  block whose last BatchNorm starts at zero folds into) into one, read by ``Identity``
  nodes: each such weight becomes its own initializer again, under its own name, so that
  every quantized weight is a weight of the model;
* ``auto_pad=SAME_*`` (``padding="same"``) becomes explicit ``pads`` where the input's size is
  known: onnxruntime refuses SAME padding with dilations;
* a forward input nothing reads is dropped by the exporter: it is added back, so that the
  deployed model takes the inputs the model takes.

Example:
    >>> import onnx
    >>> from onnx import TensorProto, helper
    >>> node = helper.make_node("Transpose", ["x"], ["y"], perm=[0, -1, 1, 2])
    >>> graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 3, 4])],
    ...     [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    >>> model = helper.make_model(graph)
    >>> repair_export(model, [])
    >>> list(model.graph.node[0].attribute[0].ints)
    [0, 3, 1, 2]
"""

from __future__ import annotations

from collections.abc import Sequence

import onnx
from onnx import helper
from torch import Tensor

from mqbench.deploy.onnx_graph import initializer_map

__all__ = ["repair_export"]


def _positive_perms(model: onnx.ModelProto) -> None:
    repaired = False
    for node in model.graph.node:
        if node.op_type != "Transpose":
            continue
        for attribute in node.attribute:
            if attribute.name == "perm" and any(axis < 0 for axis in attribute.ints):
                rank = len(attribute.ints)
                attribute.ints[:] = [axis % rank for axis in attribute.ints]
                repaired = True
    if repaired:  # the exporter's shapes downstream were inferred from the wrong perm: infer them again
        del model.graph.value_info[:]
        written = [onnx.TypeProto.FromString(value.type.SerializeToString()) for value in model.graph.output]
        for value in model.graph.output:
            value.type.tensor_type.ClearField("shape")
        inferred = onnx.shape_inference.infer_shapes(model)
        # where inference cannot follow (a log-grid quantizer's ops), an output keeps its element type and rank
        # with every size unknown (the written sizes may come from the wrong perm)
        for value, before in zip(inferred.graph.output, written, strict=True):
            if not value.type.tensor_type.HasField("shape"):
                value.type.CopyFrom(before)
                for dim in value.type.tensor_type.shape.dim:
                    dim.Clear()
        model.CopyFrom(inferred)


def _explicit_pads(model: onnx.ModelProto) -> None:
    """``auto_pad=SAME_*`` (``padding="same"``) as explicit ``pads``: onnxruntime refuses it with dilations."""
    nodes = [
        n
        for n in model.graph.node
        if n.op_type in ("Conv", "MaxPool", "AveragePool")
        and any(a.name == "auto_pad" and a.s in (b"SAME_UPPER", b"SAME_LOWER") for a in n.attribute)
    ]
    if not nodes:
        return
    inferred = onnx.shape_inference.infer_shapes(model)
    shapes = {
        v.name: [d.dim_value if d.HasField("dim_value") else None for d in v.type.tensor_type.shape.dim]
        for v in (*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output)
    }
    initializers = initializer_map(model.graph)
    for node in nodes:
        attributes = {a.name: a for a in node.attribute}
        spatial = (shapes.get(node.input[0]) or [None, None])[2:]
        if node.op_type == "Conv":
            kernel = list(attributes["kernel_shape"].ints) if "kernel_shape" in attributes else None
            if kernel is None and node.input[1] in initializers:
                kernel = list(initializers[node.input[1]].dims[2:])
        else:
            kernel = list(attributes["kernel_shape"].ints)
        sizes = [d for d in spatial if d is not None]
        if not sizes or len(sizes) != len(spatial) or kernel is None:
            continue  # a dynamic size: the runtime's own SAME padding stays
        rank = len(sizes)
        strides = list(attributes["strides"].ints) if "strides" in attributes else [1] * rank
        dilations = list(attributes["dilations"].ints) if "dilations" in attributes else [1] * rank
        upper = attributes["auto_pad"].s == b"SAME_UPPER"
        begin, end = [], []
        for size, k, stride, dilation in zip(sizes, kernel, strides, dilations, strict=True):
            total = max((-(-size // stride) - 1) * stride + (k - 1) * dilation + 1 - size, 0)
            small, large = total // 2, total - total // 2
            begin.append(small if upper else large)
            end.append(large if upper else small)
        kept = [a for a in node.attribute if a.name not in ("auto_pad", "pads")]
        del node.attribute[:]
        node.attribute.extend([*kept, helper.make_attribute("pads", begin + end)])


def _distinct_initializers(graph: onnx.GraphProto) -> None:
    initializers = initializer_map(graph)
    outputs = {value.name for value in graph.output}
    kept = []
    for node in graph.node:
        source = node.input[0] if node.op_type == "Identity" and node.input else None
        if source in initializers and node.output[0] not in outputs and node.output[0] not in initializers:
            copy = onnx.TensorProto()
            copy.CopyFrom(initializers[source])
            copy.name = node.output[0]
            graph.initializer.append(copy)
            initializers[copy.name] = copy
            continue
        kept.append(node)
    if len(kept) != len(graph.node):
        del graph.node[:]
        graph.node.extend(kept)


_ELEMENT_TYPES = {
    "torch.float32": onnx.TensorProto.FLOAT,
    "torch.float64": onnx.TensorProto.DOUBLE,
    "torch.float16": onnx.TensorProto.FLOAT16,
    "torch.bfloat16": onnx.TensorProto.BFLOAT16,
    "torch.int64": onnx.TensorProto.INT64,
    "torch.int32": onnx.TensorProto.INT32,
    "torch.int16": onnx.TensorProto.INT16,
    "torch.int8": onnx.TensorProto.INT8,
    "torch.uint8": onnx.TensorProto.UINT8,
    "torch.bool": onnx.TensorProto.BOOL,
}


def _unused_inputs(graph: onnx.GraphProto, inputs: Sequence[tuple[str, Tensor]]) -> None:
    present = [value.name for value in graph.input]
    if all(name in present for name, _ in inputs):
        return
    values = {value.name: value for value in graph.input}
    ordered = []
    for name, tensor in inputs:
        if name in values:
            ordered.append(values.pop(name))
        else:
            ordered.append(helper.make_tensor_value_info(name, _ELEMENT_TYPES[str(tensor.dtype)], list(tensor.shape)))
    ordered.extend(values.values())  # (initializers listed as inputs by old exporters)
    del graph.input[:]
    graph.input.extend(ordered)


def repair_export(model: onnx.ModelProto, inputs: Sequence[tuple[str, Tensor]]) -> None:
    """Repair ``model`` in place; ``inputs`` are the (name, example tensor) pairs it was exported with."""
    _positive_perms(model)
    _explicit_pads(model)
    _distinct_initializers(model.graph)
    _unused_inputs(model.graph, inputs)
