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
* an ``AveragePool`` with ``ceil_mode=1`` and ``count_include_pad=1`` (``AvgPool2d(..., ceil_mode=True)``)
  is written without ceil mode: torch divides a window that runs past the input's edge by the part of it
  within the input and its padding, and so does onnxruntime's float kernel, but its fused int8 kernel
  (``QLinearAveragePool``) divides it by the whole kernel (34 steps off on a 3x3 pool). The same windows
  come from ``ceil_mode=0`` with extra end padding that is not counted (``count_include_pad=0``), where
  the pool has no padding of its own; where it ends without a partial window, ``ceil_mode=0`` alone;
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

import numpy as np
import onnx
from onnx import helper, numpy_helper
from torch import Tensor

from mqbench.deploy.onnx_graph import initializer_map, unique_name

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


def _shapes(model: onnx.ModelProto) -> dict[str, list[int | None]]:
    """Every tensor's inferred sizes (None where a size is not known)."""
    inferred = onnx.shape_inference.infer_shapes(model)
    return {
        v.name: [d.dim_value if d.HasField("dim_value") else None for d in v.type.tensor_type.shape.dim]
        for v in (*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output)
    }


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
    shapes = _shapes(model)
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
        if kernel is None:
            continue
        rank = len(kernel)
        strides = list(attributes["strides"].ints) if "strides" in attributes else [1] * rank
        dilations = list(attributes["dilations"].ints) if "dilations" in attributes else [1] * rank
        sizes: list[int | None] = list(spatial) if len(spatial) == rank else [None] * rank
        if None in sizes and any(stride != 1 for stride in strides):
            continue  # a size not known and a stride: the padding depends on the size; the runtime's own stays
        upper = attributes["auto_pad"].s == b"SAME_UPPER"
        begin, end = [], []
        for size, k, stride, dilation in zip(sizes, kernel, strides, dilations, strict=True):
            if size is None:  # stride 1 (torch's padding="same"): the padding is the kernel's reach, whatever the size
                total = (k - 1) * dilation
            else:
                total = max((-(-size // stride) - 1) * stride + (k - 1) * dilation + 1 - size, 0)
            small, large = total // 2, total - total // 2
            begin.append(small if upper else large)
            end.append(large if upper else small)
        kept = [a for a in node.attribute if a.name not in ("auto_pad", "pads")]
        del node.attribute[:]
        node.attribute.extend([*kept, helper.make_attribute("pads", begin + end)])


def _set_attributes(node: onnx.NodeProto, **values: int | list[int]) -> None:
    kept = [a for a in node.attribute if a.name not in values]
    del node.attribute[:]
    node.attribute.extend([*kept, *(helper.make_attribute(name, value) for name, value in values.items())])


def _ceil_mode_pools(model: onnx.ModelProto) -> None:
    """``AveragePool`` with ``ceil_mode=1, count_include_pad=1`` in a form without ceil mode (see the module)."""
    nodes = []
    for node in model.graph.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if (
            node.op_type == "AveragePool"
            and attrs.get("ceil_mode", 0)
            and attrs.get("count_include_pad", 0)
            and attrs.get("auto_pad", b"NOTSET") in (b"NOTSET", "NOTSET")
        ):
            nodes.append((node, attrs))
    if not nodes:
        return
    shapes = _shapes(model)
    added: list[tuple[onnx.NodeProto, onnx.NodeProto]] = []
    for node, attrs in nodes:
        kernel = list(attrs["kernel_shape"])
        rank = len(kernel)
        pads = list(attrs.get("pads", [0] * 2 * rank))
        strides = list(attrs.get("strides", [1] * rank))
        dilations = list(attrs.get("dilations", [1] * rank))
        spatial = (shapes.get(node.input[0]) or [])[2:]
        if len(spatial) != rank or None in spatial:
            if not any(pads):  # no padding of its own: nothing to count but the input
                _set_attributes(node, count_include_pad=0)
            continue
        extra = []
        for size, k, stride, dilation, begin, end in zip(
            spatial, kernel, strides, dilations, pads[:rank], pads[rank:], strict=True
        ):
            span = (k - 1) * dilation + 1
            out = -(-(size + begin + end - span) // stride) + 1  # torch's ceil mode:
            if (out - 1) * stride >= size + begin:  # no window starts in the end padding
                out -= 1
            extra.append(max((out - 1) * stride + span - (size + begin + end), 0))
        if not any(extra):
            _set_attributes(node, ceil_mode=0)
            continue
        if not any(pads):
            _set_attributes(node, ceil_mode=0, count_include_pad=0, pads=[0] * rank + extra)
            continue
        # Padding counted and a window past it: the counted padding becomes values (an explicit Pad of zeros),
        # and the pool counts the values in each window, as torch does.
        taken = {name for n in model.graph.node for name in (*n.input, *n.output)} | set(initializer_map(model.graph))
        padded = unique_name(f"{node.input[0]}_padded", taken)
        widths = unique_name(f"{padded}_pads", taken)
        model.graph.initializer.append(
            numpy_helper.from_array(np.array([0, 0, *pads[:rank], 0, 0, *pads[rank:]], np.int64), widths)
        )
        added.append(
            (node, helper.make_node("Pad", [node.input[0], widths], [padded], name=unique_name(f"{padded}_Pad", taken)))
        )
        node.input[0] = padded
        _set_attributes(node, ceil_mode=0, count_include_pad=0, pads=[0] * rank + extra)
    if added:
        before = {id(node): pad for node, pad in added}
        ordered = []
        for node in model.graph.node:
            if id(node) in before:
                ordered.append(before[id(node)])
            ordered.append(node)
        del model.graph.node[:]
        model.graph.node.extend(ordered)


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
    _ceil_mode_pools(model)
    _distinct_initializers(model.graph)
    _unused_inputs(model.graph, inputs)
