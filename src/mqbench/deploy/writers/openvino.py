"""The ``openvino_onnx`` artifact: the float model with OpenVINO FakeQuantize ops, and a runner for it.

Every table entry becomes one ``FakeQuantize`` (domain ``org.openvinotoolkit``, which
OpenVINO's ONNX front end reads) at the place where the standard Q/DQ model has its
DequantizeLinear: only the entry's ``consumers`` read the quantized value, and a quantized
network output keeps its name. Inputs are ``X, input_low, input_high, output_low,
output_high`` with ``levels = quant_max - quant_min + 1`` and low/high the entry's
:meth:`~mqbench.qparams.TensorQParams.float_range` (shaped to broadcast along the axis
for per-channel weights). OpenVINO computes::

    round((x - input_low) / (input_high - input_low) * (levels - 1)) / (levels - 1)
        * (output_high - output_low) + output_low

(clipped to the range), rounding half to even like QuantizeLinear. Only exact ties can round
differently from the Q/DQ model: FakeQuantize rounds ``x / scale - (quant_min - zero_point)``,
so the parity of the tie flips when ``quant_min - zero_point`` is odd (e.g. ``[-127, 127]``).

Example:
    >>> import numpy as np
    >>> from onnx import TensorProto, helper
    >>> from mqbench.qparams import QParamTable, TensorQParams
    >>> graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"], name="relu")], "g",
    ...     [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
    ...     [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])])
    >>> model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    >>> table = QParamTable({"x": TensorQParams(np.array([0.5]), np.array([0]), -128, 127)})
    >>> fq_model, quantized = to_openvino(model, table)
    >>> [(node.op_type, helper.get_attribute_value(node.attribute[0])) for node in fq_model.graph.node[:1]]
    [('FakeQuantize', 256)]
    >>> quantized["x"]
    'x_fq'
"""

from __future__ import annotations

import math
import pickle
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
import torch
from onnx import helper, numpy_helper

from mqbench.deploy.comparison import (
    REDUCE_RANGE_REMEDY,
    ArtifactReport,
    HostReport,
    TensorDiff,
    VerifyRun,
    compare,
    host_verdict,
    run_ort,
    served_outputs,
    simulate,
    tail_quantized,
    tensor_diff,
)
from mqbench.deploy.onnx_graph import (
    all_names,
    constant,
    consumers_of,
    free_output_name,
    initializer_map,
    save_model,
    topological_sort,
    unique_name,
)
from mqbench.functional import fake_quantize
from mqbench.nn.quantized.saturation import ONEDNN_AVX2
from mqbench.qparams import QParamTable, TensorQParams

if TYPE_CHECKING:
    from mqbench.deploy.context import DeployContext

__all__ = [
    "FAKE_QUANTIZE_DOMAIN",
    "fake_quantize_as_onnx",
    "fake_quantize_outputs",
    "run_openvino",
    "run_openvino_file",
    "run_openvino_isolated",
    "to_openvino",
    "write",
]

FAKE_QUANTIZE_DOMAIN = "org.openvinotoolkit"


def _shapes(model: onnx.ModelProto) -> dict[str, list[int | None]]:
    """Tensor -> its sizes where its rank is known (inputs, initializers, inferred shapes); None: a size unknown."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model).graph
    except Exception:  # shape inference is a convenience here; the declared shapes remain
        inferred = model.graph

    def sizes(value: onnx.ValueInfoProto) -> list[int | None]:
        return [d.dim_value if d.HasField("dim_value") else None for d in value.type.tensor_type.shape.dim]

    shapes = {v.name: sizes(v) for v in inferred.value_info if v.type.tensor_type.HasField("shape")}
    shapes.update({v.name: sizes(v) for v in model.graph.input})
    shapes.update({i.name: list(i.dims) for i in model.graph.initializer})
    return shapes


def _limits(tensor: str, entry: TensorQParams, rank: int | None) -> tuple[np.ndarray, np.ndarray]:
    low, high = entry.float_range()
    if entry.axis is None:
        return np.array(low, np.float32), np.array(high, np.float32)
    if rank is None:
        raise ValueError(f"per-channel quantization of {tensor!r} needs its rank; run shape inference first")
    shape = [1] * rank
    shape[entry.axis % rank] = -1
    return np.asarray(low, np.float32).reshape(shape), np.asarray(high, np.float32).reshape(shape)


def _constant_values(graph: onnx.GraphProto) -> dict[str, np.ndarray]:
    """The values of the initializers and of the Constant nodes' outputs."""
    constants = {name: numpy_helper.to_array(t) for name, t in initializer_map(graph).items()}
    for node in graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            constants[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)
    return constants


def _clip_bounds(node: onnx.NodeProto, constants: Mapping[str, np.ndarray]) -> tuple[float, float] | None:
    """A Clip's constant (min, max), infinite where absent; None where a bound is computed."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    bounds = [float(attrs.get("min", -np.inf)), float(attrs.get("max", np.inf))]
    for index in (1, 2):
        name = node.input[index] if len(node.input) > index else ""
        if not name:
            continue
        if name not in constants or constants[name].size != 1:
            return None
        bounds[index - 1] = float(constants[name].reshape(()))
    return bounds[0], bounds[1]


def _clipped_range(entry: TensorQParams, bounds: tuple[float, float]) -> tuple[int, int] | None:
    """The integers that ``quantize(clip(x, low, high))`` takes, ``[q(low), q(high)]`` by the simulation's own
    rounding (clamping and rounding are monotone, so they commute); None where that is not a grid of 2+ levels."""
    if entry.axis is not None or np.asarray(entry.scale).size != 1:
        return None
    scale = torch.tensor(np.asarray(entry.scale, np.float32).reshape(1))
    zero_point = torch.tensor(np.asarray(entry.zero_point, np.int32).reshape(1))
    ends = torch.tensor([max(bounds[0], -3.0e38), min(bounds[1], 3.0e38)], dtype=torch.float32)
    real = fake_quantize(ends, scale, zero_point, entry.quant_min, entry.quant_max)
    low, high = (int(v) for v in torch.round(real / scale).to(torch.int64) + zero_point.to(torch.int64))
    return (low, high) if high > low else None


def _clip_into_fake_quantize(graph: onnx.GraphProto, table: QParamTable) -> None:
    """A Clip with constant bounds that a FakeQuantize reads becomes that FakeQuantize's narrower integer range.

    OpenVINO's CPU plugin runs a Clip of an int8 tensor on its integers, with the bounds cut to whole steps of
    that tensor's grid: ``hardtanh`` after a quantized max pool (grid step 0.0265) clips at 37 steps, 0.980,
    not 1.0. Quantizing the clipped value onto a grid is quantizing the value onto the integers from
    ``q(low)`` to ``q(high)`` of that grid, which a FakeQuantize of that many levels over those limits holds.
    The layers after it read a copy of the original FakeQuantize (the same grid: the values pass unchanged): a
    grid of 255 levels, say, the plugin keeps as unsigned values around a zero point of 127, and pads them in a
    convolution with the unsigned zero, 127 steps off.
    """
    constants = _constant_values(graph)
    producers = {output: node for node in graph.node for output in node.output}
    taken = all_names(graph)
    copies: list[onnx.NodeProto] = []
    for node in list(graph.node):
        if node.op_type != "FakeQuantize" or node.domain != FAKE_QUANTIZE_DOMAIN or node.input[0] not in table:
            continue
        clip = producers.get(node.input[0])
        bounds = _clip_bounds(clip, constants) if clip is not None and clip.op_type == "Clip" else None
        span = _clipped_range(table[node.input[0]], bounds) if bounds is not None else None
        if clip is None or span is None:
            continue
        entry = table[node.input[0]]
        zero_point = int(np.asarray(entry.zero_point).reshape(-1)[0])
        scale = float(np.asarray(entry.scale, np.float64).reshape(-1)[0])
        names = []
        for tag, level in (("low", span[0]), ("high", span[1])):
            names.append(unique_name(f"{node.input[0]}_clipped_fq_{tag}", taken))
            graph.initializer.append(constant(names[-1], np.array((level - zero_point) * scale, np.float32)))
        output = node.output[0]
        copies.append(_fake_quantize_copy(node, unique_name(f"{output}_clipped", taken), output, taken))
        copies[-1].doc_string = f"{QUANTIZES}{node.input[0]}"  # the tensor it quantizes (read by verify)
        node.input[:] = [clip.input[0], names[0], names[1], names[0], names[1]]
        node.output[0] = copies[-1].input[0]
        kept = [a for a in node.attribute if a.name != "levels"]
        del node.attribute[:]
        node.attribute.extend([*kept, helper.make_attribute("levels", span[1] - span[0] + 1)])
    graph.node.extend(copies)  # (to_openvino sorts the nodes)


# The doc string of a FakeQuantize that quantizes a tensor other than the one it reads (a Clip folded into it).
QUANTIZES = "quantizes "


def _fake_quantize_copy(fake: onnx.NodeProto, source: str, output: str, taken: set[str]) -> onnx.NodeProto:
    """A FakeQuantize with ``fake``'s limits and levels, from ``source`` to ``output``."""
    copy = helper.make_node(
        "FakeQuantize",
        [source, *fake.input[1:]],
        [output],
        name=unique_name(f"{output}_FakeQuantize", taken),
        domain=FAKE_QUANTIZE_DOMAIN,
    )
    copy.attribute.extend(fake.attribute)
    return copy


def _explicit_pool_padding(graph: onnx.GraphProto) -> None:
    """Give each AveragePool that counts its zero padding (``count_include_pad=1``) an explicit Pad instead.

    OpenVINO's CPU plugin may keep a signed int8 tensor as unsigned values shifted by 128 (an int8
    convolution writes it so); padding that tensor, in the pool or by a Pad after its FakeQuantize, adds
    the shifted zero, i.e. ``-128`` steps, and every border value is off. So the float tensor is padded
    and then quantized by a FakeQuantize of the same grid (zero is on every grid: the same values), and
    the pool, without padding, reads that: the same sum of the same window, divided by the window size.
    """
    taken = all_names(graph)
    producers = {output: node for node in graph.node for output in node.output}
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        pads = list(attrs.get("pads", []))
        padded_sum = attrs.get("count_include_pad") and not attrs.get("ceil_mode") and any(pads)
        if node.op_type != "AveragePool" or not padded_sum or attrs.get("auto_pad", b"NOTSET") != b"NOTSET":
            nodes.append(node)
            continue
        half = len(pads) // 2
        full = [0, 0, *pads[:half], 0, 0, *pads[half:]]  # ONNX Pad: begins of every axis, then ends
        pads_name = unique_name(f"{node.name or node.output[0]}_pads", taken)
        graph.initializer.append(constant(pads_name, np.array(full, np.int64)))
        producer = producers.get(node.input[0])
        fake = producer if producer is not None and producer.op_type == "FakeQuantize" else None
        fake = fake if fake is not None and fake.domain == FAKE_QUANTIZE_DOMAIN else None
        source = fake.input[0] if fake is not None else node.input[0]
        padded = unique_name(f"{source}_padded", taken)
        nodes.append(helper.make_node("Pad", [source, pads_name], [padded], name=unique_name(f"{padded}_Pad", taken)))
        if fake is not None:
            requantized = unique_name(f"{padded}_fq", taken)
            nodes.append(_fake_quantize_copy(fake, padded, requantized, taken))
            padded = requantized
        node.input[0] = padded
        kept = [a for a in node.attribute if a.name not in ("pads", "count_include_pad")]
        del node.attribute[:]
        node.attribute.extend(kept)
        nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)


def _scale_before_pool(graph: onnx.GraphProto) -> None:
    """Rewrite ``AveragePool -> Mul / Div by a constant`` (a scalar or one value per channel) as the scaling first.

    OpenVINO's CPU plugin averages an int8 tensor into int8, rounded to the input's grid, unless a
    FakeQuantize takes the average directly; a scaling in between (``-0.5 * avg_pool(x)``) then reads a
    rounded average (one step of the input's grid off on 13% of the values at a 3x3 window). Averaging
    commutes with a per-channel scaling, and the pool then feeds the FakeQuantize.
    """
    constants = _constant_values(graph)
    users = consumers_of(graph)
    outputs = {v.name for v in graph.output}
    pools = {node.output[0]: node for node in graph.node if node.op_type in ("AveragePool", "GlobalAveragePool")}
    for node in list(graph.node):
        if node.op_type not in ("Mul", "Div"):
            continue
        sides = (0, 1) if node.op_type == "Mul" else (0,)
        for index in sides:
            pool = pools.get(node.input[index])
            factor = constants.get(node.input[1 - index])
            if pool is None or factor is None or factor.dtype.kind != "f" or pool.output[0] in outputs:
                continue
            if len(users.get(pool.output[0], [])) != 1 or any(
                size != 1 for axis, size in enumerate(factor.shape[::-1]) if axis != 2
            ):
                continue  # another reader of the average, or a factor that varies over space (or the batch)
            scaled = pool.output[0]
            node.input[index], node.output[0], pool.input[0], pool.output[0] = (
                pool.input[0],
                scaled,
                scaled,
                node.output[0],
            )
            break  # the order of the nodes is restored by to_openvino


def _divisors(node: onnx.NodeProto, shape: list[int | None] | None) -> int | None:
    """A common multiple of every count an AveragePool divides a window's sum by; None where unknown."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    spatial = (shape or [])[2:]
    kernel = list(attrs.get("kernel_shape", []))
    rank = len(kernel)
    pads = list(attrs.get("pads", [0] * 2 * rank))
    if attrs.get("ceil_mode", 0) or any(d != 1 for d in attrs.get("dilations", [1] * rank)):
        return None
    if not any(pads) or attrs.get("count_include_pad", 0):
        return math.prod(kernel)
    if len(spatial) != rank or None in spatial:
        return None
    counts: set[int] = {1}
    strides = list(attrs.get("strides", [1] * rank))
    sizes = [int(v) for v in spatial if v is not None]
    for size, k, stride, begin, end in zip(sizes, kernel, strides, pads[:rank], pads[rank:], strict=True):
        starts = np.arange((size + begin + end - k) // stride + 1) * stride - begin
        within = {int(v) for v in np.minimum(starts + k, size) - np.maximum(starts, 0)}
        counts = {a * b for a in counts for b in within}
    return math.lcm(*counts)


def _exact_averages(graph: onnx.GraphProto, shapes: Mapping[str, list[int | None]]) -> None:
    """Give an AveragePool of a quantized tensor a FakeQuantize that holds its averages exactly, unless one
    FakeQuantize alone reads it.

    OpenVINO's CPU plugin averages an int8 tensor into int8, rounded to the input's grid, unless a
    FakeQuantize takes the average directly (``x = avg_pool(q); return fq(x), x.mean()``: half a step of
    the input's grid, two steps of a finer grid after it). Every average of a grid's values divided by one
    of the pool's counts lies on that grid refined by a common multiple of the counts, which a FakeQuantize
    with as many more levels over the same limits holds: the averages pass unchanged.
    """
    producers = {output: node for node in graph.node for output in node.output}
    users = consumers_of(graph)
    taken = all_names(graph)
    outputs = {value.name for value in graph.output}
    added: list[onnx.NodeProto] = []
    for node in graph.node:
        # (not a GlobalAveragePool: served exactly as written, and off by up to a step given this FakeQuantize)
        fake = producers.get(node.input[0]) if node.op_type == "AveragePool" else None
        if fake is None or fake.op_type != "FakeQuantize" or fake.domain != FAKE_QUANTIZE_DOMAIN:
            continue
        readers = users.get(node.output[0], [])
        if len(readers) == 1 and readers[0].op_type == "FakeQuantize" and readers[0].domain == FAKE_QUANTIZE_DOMAIN:
            continue
        if node.output[0] in outputs:  # served exactly as a network output; with this FakeQuantize, a step off
            continue
        divisor = _divisors(node, shapes.get(fake.input[0]))
        levels_in = next((a.i for a in fake.attribute if a.name == "levels"), 256)
        levels = (levels_in - 1) * divisor + 1 if divisor is not None else None
        if levels is None or levels > 2**22:  # float32 resolves a grid of at most ~2**24 steps
            continue
        output = node.output[0]
        node.output[0] = unique_name(f"{output}_sum_divided", taken)
        added.append(
            helper.make_node(
                "FakeQuantize",
                [node.output[0], fake.input[3], fake.input[4], fake.input[3], fake.input[4]],
                [output],
                name=unique_name(f"{output}_exact_FakeQuantize", taken),
                domain=FAKE_QUANTIZE_DOMAIN,
                levels=levels,
            )
        )
    graph.node.extend(added)


def _reductions_keep_dims(graph: onnx.GraphProto, shapes: Mapping[str, list[int | None]]) -> None:
    """A reduction with ``keepdims=0`` that a FakeQuantize reads keeps its dimensions, then a Squeeze drops them.

    OpenVINO's CPU plugin computes ``ReduceMean(axes=[1], keepdims=0) -> FakeQuantize`` after an int8
    MatMul off by up to 7 steps in the file as written (the same mean with ``keepdims=1`` is exact).
    """
    users = consumers_of(graph)
    constants = _constant_values(graph)
    taken = all_names(graph)
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        nodes.append(node)
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        readers = users.get(node.output[0], []) if node.op_type.startswith("Reduce") else []
        if attrs.get("keepdims", 1) or not any(r.op_type == "FakeQuantize" for r in readers):
            continue
        axes = attrs.get("axes")
        if axes is None and len(node.input) > 1 and node.input[1] in constants:
            axes = constants[node.input[1]].reshape(-1).tolist()
        rank = len(shapes.get(node.input[0]) or [])
        if not axes or not rank:
            continue  # all axes, or a rank not known: left as written
        axes_name = unique_name(f"{node.output[0]}_squeezed_axes", taken)
        graph.initializer.append(constant(axes_name, np.array(sorted(int(a) % rank for a in axes), np.int64)))
        output = node.output[0]
        node.output[0] = unique_name(f"{output}_kept", taken)
        for attribute in node.attribute:
            if attribute.name == "keepdims":
                attribute.i = 1
        nodes.append(
            helper.make_node(
                "Squeeze", [node.output[0], axes_name], [output], name=unique_name(f"{output}_Squeeze", taken)
            )
        )
    del graph.node[:]
    graph.node.extend(nodes)


def _pad_before_fake_quantize(graph: onnx.GraphProto) -> None:
    """A zero ``Pad`` of a FakeQuantize's output pads the float tensor instead, and quantizes it again.

    The same reason as for :func:`_explicit_pool_padding`: the CPU plugin pads a signed int8 tensor it keeps
    shifted by 128 with the shifted zero. Zero is on every grid, so the values are the same.
    """
    taken = all_names(graph)
    producers = {output: node for node in graph.node for output in node.output}
    initializers = initializer_map(graph)
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        nodes.append(node)
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        fake = producers.get(node.input[0]) if node.op_type == "Pad" else None
        if fake is None or fake.op_type != "FakeQuantize" or fake.domain != FAKE_QUANTIZE_DOMAIN:
            continue
        value = node.input[2] if len(node.input) > 2 else ""
        if attrs.get("mode", b"constant") not in (b"constant", "constant") or len(node.input) > 3:
            continue
        if value and (value not in initializers or numpy_helper.to_array(initializers[value]).any()):
            continue
        output = node.output[0]
        padded = unique_name(f"{output}_float", taken)
        node.input[0], node.output[0] = fake.input[0], padded
        nodes.append(_fake_quantize_copy(fake, padded, output, taken))
    del graph.node[:]
    graph.node.extend(nodes)


def _scale_before_relu(graph: onnx.GraphProto, table: QParamTable) -> None:
    """Rewrite ``Relu -> Mul / Div by a constant with negative elements`` as the scaling, then a clamp.

    OpenVINO's CPU plugin folds such a constant into the output scale of an int8 convolution or
    matrix product before the Relu it fuses, which turns ``k * relu(x)`` into ``relu(k * x)`` where
    ``k < 0`` (every value of those channels wrong). ``k * relu(x)`` is exactly
    ``min(max(k * x, low), high)`` with ``low = 0, high = +max`` where ``k >= 0`` and
    ``low = -max, high = 0`` where ``k < 0`` (``max`` the largest float32), which it serves as
    written. A Relu output the table quantizes is left alone (its FakeQuantize stops the folding).
    """
    inits = initializer_map(graph)
    producers = {output: node for node in graph.node for output in node.output}
    users = consumers_of(graph)
    taken = all_names(graph)
    top = np.finfo(np.float32).max
    added: list[onnx.NodeProto] = []
    bypassed: list[onnx.NodeProto] = []
    for node in list(graph.node):
        if node.op_type not in ("Mul", "Div") or len(node.input) != 2:
            continue
        operands = [1] if node.op_type == "Div" else [0, 1]
        for index in operands:
            relu, factor = producers.get(node.input[1 - index]), inits.get(node.input[index])
            if relu is None or relu.op_type != "Relu" or factor is None or relu.output[0] in table:
                continue
            k = numpy_helper.to_array(factor)
            if k.dtype.kind != "f" or not np.any(k < 0):
                continue
            low = np.where(k < 0, -top, 0).astype(np.float32)
            high = np.where(k < 0, 0, top).astype(np.float32)
            names = {tag: unique_name(f"{node.name or node.output[0]}_{tag}", taken) for tag in ("low", "high")}
            graph.initializer.extend(constant(names[tag], value) for tag, value in (("low", low), ("high", high)))
            scaled, floor = (unique_name(f"{node.output[0]}_{tag}", taken) for tag in ("scaled", "floor"))
            output = node.output[0]
            node.input[1 - index] = relu.input[0]
            node.output[0] = scaled
            added += [
                helper.make_node("Max", [scaled, names["low"]], [floor], name=unique_name(f"{output}_Max", taken)),
                helper.make_node("Min", [floor, names["high"]], [output], name=unique_name(f"{output}_Min", taken)),
            ]
            users[relu.output[0]] = [n for n in users.get(relu.output[0], []) if n is not node]
            bypassed.append(relu)
            break
    graph.node.extend(added)
    outputs = {v.name for v in graph.output}
    for relu in bypassed:  # a Relu no one reads any more
        if relu in graph.node and not users[relu.output[0]] and relu.output[0] not in outputs:
            graph.node.remove(relu)


def _normalization_keeps_epsilon(graph: onnx.GraphProto) -> None:
    """Every normalized tensor that a node computes is read by its normalization through ``Max(x, x)`` (``x``
    exactly, NaN included).

    Measured on OpenVINO 2026.4: where a LayerNormalization (or the ReduceMean / Sub / ... form the plugin fuses into
    one) reads an ``Add`` of two FakeQuantize outputs, the CPU plugin's low-precision pass moves the sum's
    dequantization scale past the normalization, which is scale-invariant only without epsilon: the plugin then
    normalizes by the square root of the variance alone, and rows whose variance is within a few hundred times
    epsilon come out steps off. The plugin moves no scale through a ``Max``, so it normalizes the float sum as ONNX
    and the simulation do (with the ``Max``: 0 steps off on the rows that were 19 off).
    """
    producers = {output: node for node in graph.node for output in node.output}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        if node.op_type == "LayerNormalization" and node.domain in ("", "ai.onnx"):
            readers.setdefault(node.input[0], []).append(node)
        elif node.op_type == "Sub" and len(node.input) == 2:
            mean = producers.get(node.input[1])
            if mean is not None and mean.op_type == "ReduceMean" and mean.input[0] == node.input[0]:
                readers.setdefault(node.input[0], []).extend([mean, node])  # x - mean(x): a normalization's centering
    taken = all_names(graph)
    added = []
    for tensor, nodes in readers.items():
        if tensor not in producers:  # a network input or a constant: no scale to move
            continue
        kept = unique_name(f"{tensor}_normalized", taken)
        added.append(helper.make_node("Max", [tensor, tensor], [kept], name=unique_name(f"{tensor}_Max", taken)))
        for node in nodes:
            node.input[:] = [kept if name == tensor else name for name in node.input]
    graph.node.extend(added)


def _attention_outputs_kept(graph: onnx.GraphProto) -> None:
    """An attention output (a MatMul reading a Softmax, directly or through its FakeQuantize; the output's
    FakeQuantize when it has one) added to a residual whose sum feeds a linear layer and an elementwise op that
    also reads that layer's result (``fc(z) - z``) is read by its readers through ``Max(x, x)`` (``x`` exactly).

    Measured on OpenVINO 2026.4: a file with that pattern (MatMul, Mul, Softmax, FakeQuantize, MatMul,
    FakeQuantize, Add, then the sum into a MatMul and into an elementwise op with that MatMul's result) ends the
    process with a segmentation fault in ``compile_model`` (every precision and thread count; without the linear
    layer and the elementwise op, or with either FakeQuantize around the second MatMul's output or the Softmax
    removed, it compiles). With a ``Max`` between the attention output and its readers it compiles, and the plugin
    still fuses the attention itself. The ``Max`` is written only for that pattern, so that every other file stays
    as it was (a ``Max`` after every attention output of a ViT: benchmarks/openvino_attention.py).
    """
    producers = {output: node for node in graph.node for output in node.output}
    readers = consumers_of(graph)
    elementwise = {"Add", "Sub", "Mul", "Div"}

    def through_fake_quantize(tensor: str) -> str:  # the producer's input past a FakeQuantize
        node = producers.get(tensor)
        is_fq = node is not None and node.op_type == "FakeQuantize" and node.domain == FAKE_QUANTIZE_DOMAIN
        return node.input[0] if is_fq and node is not None else tensor

    def quantized_form(tensor: str) -> str:  # the tensor's FakeQuantize output when that is its only reader
        after = readers.get(tensor, [])
        only = len(after) == 1 and after[0].op_type == "FakeQuantize" and after[0].domain == FAKE_QUANTIZE_DOMAIN
        return after[0].output[0] if only else tensor

    def linear_results(tensor: str) -> set[str]:  # what MatMuls reading ``tensor`` (or its FakeQuantize) give
        results = set()
        for form in {tensor} | {n.output[0] for n in readers.get(tensor, []) if n.op_type == "FakeQuantize"}:
            for matmul in readers.get(form, []):
                if matmul.op_type in ("MatMul", "Gemm") and matmul.input[0] == form:
                    results.add(matmul.output[0])
                    results |= {n.output[0] for n in readers.get(matmul.output[0], []) if n.op_type == "Add"}
        return results

    def crashes_past(tensor: str) -> bool:  # a residual sum of ``tensor`` read as ``fc(z) - z`` reads it
        for add in readers.get(tensor, []):
            if add.op_type != "Add":
                continue
            total = add.output[0]
            results = linear_results(total)
            for reader in readers.get(total, []):
                if reader.op_type in elementwise and any(name in results for name in reader.input):
                    return True
        return False

    taken = all_names(graph)
    added = []
    for node in list(graph.node):
        softmax = producers.get(through_fake_quantize(node.input[0])) if node.op_type == "MatMul" else None
        if softmax is None or softmax.op_type != "Softmax":
            continue
        tensor = quantized_form(node.output[0])
        if not crashes_past(tensor):
            continue
        kept = unique_name(f"{tensor}_kept", taken)
        for reader in readers[tensor]:
            reader.input[:] = [kept if name == tensor else name for name in reader.input]
        added.append(helper.make_node("Max", [tensor, tensor], [kept], name=unique_name(f"{tensor}_Max", taken)))
    graph.node.extend(added)


def to_openvino(
    model: onnx.ModelProto, table: QParamTable, use_consumers: bool = True
) -> tuple[onnx.ModelProto, dict[str, str]]:
    """A copy of the float ``model`` with every table entry as a FakeQuantize; also tensor -> its quantized name.

    ``use_consumers`` works as in :func:`~mqbench.deploy.qdq.insert_qdq`: an entry's consumers
    alone read the quantized value (all readers when it has none or when this is False).
    """
    model = onnx.ModelProto.FromString(model.SerializeToString())
    graph = model.graph
    shapes = _shapes(model)
    taken = all_names(graph)
    users = consumers_of(graph)
    known = {v.name for v in graph.input} | set(initializer_map(graph)) | {o for n in graph.node for o in n.output}
    output_names = {v.name for v in graph.output}
    added: list[onnx.NodeProto] = []
    quantized: dict[str, str] = {}
    for tensor, entry in table.items():
        if tensor not in known:
            raise ValueError(f"the parameter table names tensor {tensor!r}, which the model does not have")
        if entry.grid != "linear":
            raise ValueError(f"FakeQuantize holds linear grids only; {tensor!r} is on the {entry.grid!r} grid")
        wanted = set(entry.consumers) if use_consumers and entry.consumers is not None else None
        source = tensor  # a network output reads the float value unless every reader is quantized (insert_qdq)
        if wanted is None and tensor in output_names:
            source = free_output_name(graph, users, tensor, taken)
        low, high = _limits(tensor, entry, len(shapes[tensor]) if tensor in shapes else None)
        names = []
        for tag, value in (("low", low), ("high", high)):
            name = unique_name(f"{tensor}_fq_{tag}", taken)
            graph.initializer.append(constant(name, value))
            names.append(name)
        result = unique_name(f"{tensor}_fq", taken)
        added.append(
            helper.make_node(
                "FakeQuantize",
                [source, names[0], names[1], names[0], names[1]],
                [result],
                name=unique_name(f"{tensor}_FakeQuantize", taken),
                domain=FAKE_QUANTIZE_DOMAIN,
                levels=entry.quant_max - entry.quant_min + 1,
            )
        )
        for node in users.get(source, []):
            if wanted is None or node.name in wanted:
                node.input[:] = [result if name == source else name for name in node.input]
        if source != tensor:
            added.append(helper.make_node("Identity", [result], [tensor], name=unique_name(f"{tensor}_output", taken)))
            result = tensor
        quantized[tensor] = result
    graph.node.extend(added)
    _scale_before_relu(graph, table)  # on the quantized graph: each rewritten op reads what it read
    _clip_into_fake_quantize(graph, table)
    _explicit_pool_padding(graph)
    _scale_before_pool(graph)
    _exact_averages(graph, shapes)
    _reductions_keep_dims(graph, shapes)
    _pad_before_fake_quantize(graph)
    _normalization_keeps_epsilon(graph)
    _attention_outputs_kept(graph)
    topological_sort(graph)
    if all(o.domain != FAKE_QUANTIZE_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(FAKE_QUANTIZE_DOMAIN, 1))
    return model, quantized


def fake_quantize_outputs(model: onnx.ModelProto, table: QParamTable) -> dict[str, str]:
    """Tensor -> the name of its quantized value in a model :func:`to_openvino` wrote (for ``table``'s tensors)."""
    found: dict[str, str] = {}
    fake = {n.output[0] for n in model.graph.node if n.op_type == "FakeQuantize" and n.domain == FAKE_QUANTIZE_DOMAIN}
    for node in model.graph.node:
        if node.output[0] in fake:
            tensor = node.doc_string[len(QUANTIZES) :] if node.doc_string.startswith(QUANTIZES) else node.input[0]
            if tensor in table:
                found.setdefault(tensor, node.output[0])
        elif node.op_type == "Identity" and node.input[0] in fake and node.output[0] in table:
            found[node.output[0]] = node.output[0]  # a quantized network output keeps its name
    return found


def fake_quantize_as_onnx(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of a FakeQuantize model with OpenVINO's formula in standard ONNX ops (run on any ONNX runtime).

    Each FakeQuantize becomes ``Round(Clip((x - input_low) * k, 0, levels - 1)) * m + output_low`` with
    ``k = (levels - 1) / (input_high - input_low)`` and ``m = (output_high - output_low) / (levels - 1)``:
    what the artifact means, independent of the int8 kernels OpenVINO picks on a given CPU. The
    quantized value keeps the FakeQuantize's output name.
    """
    model = onnx.ModelProto.FromString(model.SerializeToString())
    graph = model.graph
    inits = initializer_map(graph)
    taken = all_names(graph)
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        if node.op_type != "FakeQuantize" or node.domain != FAKE_QUANTIZE_DOMAIN:
            nodes.append(node)
            continue
        x, *limits = node.input
        missing = [name for name in limits if name not in inits]
        if missing:
            raise ValueError(f"FakeQuantize {node.name!r}: limits {missing} are not constants")
        in_low, in_high, out_low, out_high = (numpy_helper.to_array(inits[n]).astype(np.float32) for n in limits)
        steps = float(helper.get_attribute_value(next(a for a in node.attribute if a.name == "levels")) - 1)
        consts = {
            "low": in_low,
            "k": (np.float32(steps) / (in_high - in_low)).astype(np.float32),
            "zero": np.array(0, np.float32),
            "top": np.array(steps, np.float32),
            "m": ((out_high - out_low) / np.float32(steps)).astype(np.float32),
            "out_low": out_low,
        }
        names = {key: unique_name(f"{node.name}_{key}", taken) for key in consts}
        graph.initializer.extend(constant(names[key], value) for key, value in consts.items())
        t = [unique_name(f"{node.name}_t{i}", taken) for i in range(5)]
        nodes += [
            helper.make_node("Sub", [x, names["low"]], [t[0]]),
            helper.make_node("Mul", [t[0], names["k"]], [t[1]]),
            helper.make_node("Clip", [t[1], names["zero"], names["top"]], [t[2]]),
            helper.make_node("Round", [t[2]], [t[3]]),
            helper.make_node("Mul", [t[3], names["m"]], [t[4]]),
            helper.make_node("Add", [t[4], names["out_low"]], [node.output[0]], name=node.name),
        ]
    del graph.node[:]
    graph.node.extend(nodes)
    read = {name for node in nodes for name in node.input}
    unused = [init for init in graph.initializer if init.name not in read]
    for init in unused:
        graph.initializer.remove(init)
    kept = [o for o in model.opset_import if o.domain != FAKE_QUANTIZE_DOMAIN]
    del model.opset_import[:]
    model.opset_import.extend(kept)
    return model


def write(context: DeployContext) -> Path:
    """The ``openvino_onnx`` artifact: ``<model_name>_openvino.onnx``.

    MQBench writes its FakeQuantize model as ``<model_name>_deploy_model.onnx``; here that name is
    the float model every backend's deployment holds (the ``deploy_onnx`` artifact), so the
    FakeQuantize model keeps a name of its own.
    """
    model, _ = to_openvino(context.float_model, context.table)
    path = context.path("_openvino.onnx")
    save_model(model, path)
    return path


def run_openvino(
    path: str | Path,
    inputs: Mapping[str, np.ndarray],
    outputs: Sequence[str] | None = None,
    threads: int = 2,
    precision: str | None = "f32",
) -> dict[str, np.ndarray]:
    """Run an ONNX model with OpenVINO's CPU plugin; ``outputs`` may name intermediate tensors too.

    Requested tensors that are not graph outputs become outputs of an in-memory copy first.
    ``precision`` sets ``INFERENCE_PRECISION_HINT`` ("f32" by default: on CPUs with bf16 support
    the plugin's default is bf16, far from the Q/DQ arithmetic); None leaves the plugin's choice.
    """
    import openvino as ov

    model = onnx.load(str(path))
    declared = [v.name for v in model.graph.output]
    names = list(outputs) if outputs is not None else declared
    produced = {o for n in model.graph.node for o in n.output} | {v.name for v in model.graph.input}
    unknown = [name for name in names if name not in produced and name not in declared]
    if unknown:
        raise ValueError(f"the model has no tensors named {unknown[:5]}")
    for name in names:
        if name not in declared:
            model.graph.output.append(helper.make_empty_tensor_value_info(name))
            declared.append(name)
    core = ov.Core()
    with tempfile.TemporaryDirectory() as folder:
        copy = Path(folder) / "model.onnx"
        onnx.save(model, str(copy))
        ov_model = core.read_model(str(copy))
    compiled = core.compile_model(ov_model, "CPU", _compile_config(threads, precision))
    results = compiled({name: np.ascontiguousarray(value) for name, value in inputs.items()})
    by_name: dict[str, np.ndarray] = {}
    for port, value in results.items():
        for name in port.get_names():
            by_name[name] = np.asarray(value)
    missing = [name for name in names if name not in by_name]
    if missing:
        raise ValueError(f"OpenVINO returned no tensors named {missing[:5]}")
    return {name: by_name[name] for name in names}


def _compile_config(threads: int, precision: str | None) -> dict[str, object]:
    config: dict[str, object] = {"INFERENCE_NUM_THREADS": int(threads)}
    if precision is not None:
        config["INFERENCE_PRECISION_HINT"] = precision
    return config


# The child process of run_openvino_file: only OpenVINO and numpy (no torch to import first).
_SERVE_FILE = """
import pickle, sys
from pathlib import Path
import numpy as np
import openvino as ov
model, inputs, outputs, threads, copy_threads, precision = sys.argv[1:7]
config = {"INFERENCE_NUM_THREADS": int(threads)}
copy_config = {"INFERENCE_NUM_THREADS": int(copy_threads)}
if precision:
    config["INFERENCE_PRECISION_HINT"] = copy_config["INFERENCE_PRECISION_HINT"] = precision
feeds, copies = pickle.loads(Path(inputs).read_bytes())
feeds = {name: np.ascontiguousarray(value) for name, value in feeds.items()}
core = ov.Core()
def run(compiled):
    return {name: np.asarray(value) for port, value in compiled(feeds).items() for name in port.get_names()}
served = run(core.compile_model(model, "CPU", config))
exposed = []
for expose in copies:
    copy = core.read_model(model)
    known = {name for op in copy.get_ops() for port in op.outputs() for name in port.get_names()}
    if any(name in known for name in expose):  # a tensor no output depends on is not in OpenVINO's model
        copy.add_outputs([name for name in expose if name in known])
    exposed.append(run(core.compile_model(copy, "CPU", copy_config)))
Path(outputs).write_bytes(pickle.dumps((served, exposed)))
"""


def run_openvino_file(
    path: str | Path,
    inputs: Mapping[str, np.ndarray],
    threads: int = 2,
    precision: str | None = "f32",
    timeout: float = 900.0,
) -> dict[str, np.ndarray]:
    """Compile the file at ``path`` as written (``Core().compile_model(path, "CPU")``) and run it: every output.

    It runs in a child process, so that a runtime crashing on the file (a segmentation fault while
    compiling or running) is reported as a :class:`RuntimeError` naming the exit status instead of
    ending the caller. ``threads`` and ``precision`` as in :func:`run_openvino` (the configuration
    :func:`serve` compiles with).
    """
    return run_openvino_isolated(path, inputs, [], threads, precision, timeout)[0]


def run_openvino_isolated(
    path: str | Path,
    inputs: Mapping[str, np.ndarray],
    copies: Sequence[Sequence[str]],
    threads: int = 2,
    precision: str | None = "f32",
    timeout: float = 900.0,
    copy_threads: int = 1,
) -> tuple[dict[str, np.ndarray], list[dict[str, np.ndarray]]]:
    """:func:`run_openvino_file`'s outputs, and in the same fresh process, for each list of tensor names in
    ``copies``, the values of a copy with those tensors as extra outputs (those that OpenVINO's model of the
    file has: it drops what no output depends on).

    Extra outputs change which kernels OpenVINO fuses, and with them how exact rounding ties are
    decided; a fresh process keeps the runs alike (results can depend on what ran before in a process).
    The copies run on ``copy_threads`` threads: on two, OpenVINO 2026.4 computes an int8 ``ConvTranspose``
    (stride 2) differently from run to run (1.5% of it 178 steps off in about 40% of the runs; the file and its
    copies alike), on one it is the same every time; the file itself runs on ``threads``, as a user serves it
    (verify names such a race: ``_thread_race``).
    """
    with tempfile.TemporaryDirectory() as folder:
        feeds, results = Path(folder) / "inputs.pkl", Path(folder) / "outputs.pkl"
        arrays = {name: np.asarray(value) for name, value in inputs.items()}
        feeds.write_bytes(pickle.dumps((arrays, [list(names) for names in copies])))
        command = [sys.executable, "-c", _SERVE_FILE, str(path), str(feeds), str(results), str(int(threads))]
        command += [str(int(copy_threads)), precision or ""]
        child = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        if child.returncode != 0 or not results.exists():
            status = f"signal {-child.returncode}" if child.returncode < 0 else f"exit status {child.returncode}"
            tail = child.stderr.strip().splitlines()[-3:]
            raise RuntimeError(f"OpenVINO ended with {status} compiling or running {str(path)!r}: {' | '.join(tail)}")
        served, exposed = pickle.loads(results.read_bytes())
    return served, exposed


# -- verification ----------------------------------------------------------------------------------
def verify(result: Any, feeds: Mapping[str, np.ndarray], run: VerifyRun) -> ArtifactReport:
    """The FakeQuantize model: its formula on onnxruntime, then OpenVINO's CPU plugin on this host.

    On OpenVINO, in one fresh process (:func:`run_openvino_isolated`): the file compiled and run as
    written, whose outputs the verdict compares with the simulation (each computed from the quantized
    tensors it reads, taken from a copy that exposes only those, so that OpenVINO fuses and rounds the
    rest as in the file); and a copy exposing every quantized tensor, which says where a difference
    starts (each from the copy's tensors before it). A file OpenVINO cannot compile or run fails it.
    """
    path = result.artifacts["openvino_onnx"]
    model = onnx.load(path)
    exposed = fake_quantize_outputs(model, result.table)  # tensor -> FakeQuantize output name
    names = list(result.output_names) + list(exposed.values())
    args = (result.table, exposed, run, result.output_names)
    values = run_ort(fake_quantize_as_onnx(model), feeds, names, optimize=False)
    report = compare(ArtifactReport("openvino_onnx", "FakeQuantize formula"), values, *args)
    if run.host:
        crash = None
        outputs = set(result.output_names)
        # weights are constants (the formula above checks them); exposing one can make the plugin compute the layer
        # wrongly (a per-channel scale after a depthwise convolution is folded into the exposed weights)
        extra = [
            name for tensor, name in exposed.items() if name not in outputs and result.table[tensor].kind != "weight"
        ]
        tail = [
            name for name in tail_quantized(model, result.output_names, exposed, result.table) if name not in outputs
        ]
        try:
            served, (values, tail_values) = run_openvino_isolated(path, feeds, [extra, tail])
        except RuntimeError as error:
            crash, served, values, tail_values = str(error), {}, {}, {}
        host = compare(HostReport("openvino_onnx", "OpenVINO CPU"), values, *args)
        # the file as written: its outputs, from the quantized tensors they are computed from (a copy exposing
        # only those fuses the rest as the file does)
        tail_shown = {name: tail_values[name] for name in tail if name in tail_values}
        as_written = served_outputs(HostReport("openvino_onnx", "OpenVINO CPU"), served, tail_shown, *args)
        file_values = {**tail_shown, **served}
        explained = _dropped_rounding(model, result, run, file_values) if as_written.diverging(run.tolerance) else None
        if explained is not None:
            as_written.local_outputs, effect = explained
            host.per_tensor.update({f"{tensor} (as written)": diff for tensor, diff in effect.items()})
        host.outputs, host.local_outputs, host.missing = (
            as_written.outputs,
            as_written.local_outputs,
            as_written.missing,
        )
        for tensor, name in exposed.items():
            if name in outputs and tensor in as_written.per_tensor:
                host.per_tensor[tensor] = as_written.per_tensor[tensor]
        predicted = run.predicted(result, feeds, ONEDNN_AVX2) if run.wants_prediction(host) else {}
        report.host = host_verdict(host, predicted, ONEDNN_AVX2, REDUCE_RANGE_REMEDY, run.tolerance)
        if explained is not None and report.host.cause is not None:
            report.host.cause = (
                "OpenVINO's CPU plugin computes the file as written with the rounding of the FakeQuantize between "
                "a convolution or matrix product and the Add after it left out (the Add fused into the layer), "
                f"which moves {', '.join(t for t, d in explained[1].items() if (d.max_lsb_diff or 0) > run.tolerance)}"
                " beyond the tolerance"
            )
        if crash is not None:
            report.host.cause = f"the file as written does not run: {crash}"
        elif (
            explained is None
            and as_written.diverging(run.tolerance)
            and not _normalized_without_epsilon(report.host, path, model, feeds, run)
        ):
            _thread_race(report.host, path, feeds, served, tail_shown, args)
        if crash is None and explained is None and report.host.remedy is None and report.host.diverging(run.tolerance):
            _static_shapes(report.host, model, feeds, [extra, tail], args)
    return report


def _with_dynamic_batch(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[str]] | None:
    """A copy of ``model`` whose inputs' and outputs' first dimension is symbolic ("batch"), and the inputs it
    changed; None where every input's first dimension is symbolic already."""
    changed = [value.name for value in model.graph.input if _static_first(value)]
    if not changed:
        return None
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    del copy.graph.value_info[:]  # intermediate shapes inferred for the static batch
    for value in [*copy.graph.input, *copy.graph.output]:
        if _static_first(value):
            value.type.tensor_type.shape.dim[0].dim_param = "batch"
    return copy, changed


def _static_first(value: onnx.ValueInfoProto) -> bool:
    dims = value.type.tensor_type.shape.dim
    return len(dims) > 0 and dims[0].HasField("dim_value")


def _static_shapes(
    host: HostReport,
    model: onnx.ModelProto,
    feeds: Mapping[str, np.ndarray],
    copies: Sequence[Sequence[str]],
    args: tuple[Any, ...],
) -> None:
    """Where the file parts from the simulation and nothing else explains it: whether that depends on its static
    shapes. OpenVINO's CPU plugin picks other kernels for a static batch (measured on OpenVINO 2026.4: a padded
    3x3 average pool 2 steps off); if the same file with a dynamic batch dimension computes what the simulation
    computes, at every tensor verify shows and at the outputs, the cause says so and the remedy is a dynamic batch
    axis."""
    run: VerifyRun = args[2]
    dynamic = _with_dynamic_batch(model)
    if dynamic is None:
        return
    copy, inputs = dynamic
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "dynamic_batch.onnx"
        onnx.save(copy, str(path))
        try:
            served, (values, tail_values) = run_openvino_isolated(path, feeds, copies)
        except RuntimeError:
            return
    shown = compare(HostReport("openvino_onnx", "OpenVINO CPU"), values, *args)
    tail = {name: tail_values[name] for name in copies[1] if name in tail_values}
    outputs = served_outputs(HostReport("openvino_onnx", "OpenVINO CPU"), served, tail, *args)
    if shown.diverging(run.tolerance) or outputs.diverging(run.tolerance) or outputs.missing:
        return
    parted = ", ".join(host.diverging(run.tolerance)[:5])
    host.cause = (
        f"OpenVINO's CPU plugin computes this file, whose inputs have a static batch dimension, differently at "
        f"{parted}; the same file with a dynamic batch dimension computes what the simulation computes (the "
        "plugin picks other kernels for static shapes)"
    )
    axes = ", ".join(f"{name!r}: {{0: 'batch'}}" for name in inputs)
    host.remedy = (
        f"deploy with a dynamic batch axis: convert_deploy(..., dynamic_axes={{{axes}}}) (a model captured with "
        "torch.export gets one by default)"
    )


def _normalized_without_epsilon(
    host: HostReport, path: str | Path, model: onnx.ModelProto, feeds: Mapping[str, np.ndarray], run: VerifyRun
) -> bool:
    """Where the file parts from the simulation: whether OpenVINO computes its LayerNormalizations without their
    epsilon. Measured on OpenVINO 2026.4: where a normalization reads a sum of FakeQuantize outputs directly, the
    CPU plugin normalizes by the square root of the variance alone (to float32 rounding), while ONNX, like the
    simulation, adds epsilon to the variance (:func:`_normalization_keeps_epsilon` keeps the writer's own files
    from it); a row whose variance is within a few hundred times epsilon comes out steps off (the relative
    difference is about epsilon / (2 variance)). The check serves a copy showing each LayerNormalization's input
    and output, and compares the output with both formulas; if so, the cause says so (True)."""
    norms = [
        node for node in model.graph.node if node.op_type == "LayerNormalization" and node.domain in ("", "ai.onnx")
    ]
    if not norms:
        return False
    try:
        _, (values,) = run_openvino_isolated(
            path, feeds, [[n for node in norms for n in (node.input[0], node.output[0])]]
        )
    except RuntimeError:
        return False
    constants = _constant_values(model.graph)
    found = []
    for node in norms:
        x, y = values.get(node.input[0]), values.get(node.output[0])
        if x is None or y is None:
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        epsilon, axis = float(attrs.get("epsilon", 1e-5)), int(attrs.get("axis", -1))
        axes = tuple(range(axis % x.ndim, x.ndim))
        weight = constants.get(node.input[1], 1.0) if len(node.input) > 1 else 1.0
        bias = constants.get(node.input[2], 0.0) if len(node.input) > 2 and node.input[2] else 0.0
        centered = x.astype(np.float64) - x.astype(np.float64).mean(axis=axes, keepdims=True)
        variance = (centered**2).mean(axis=axes, keepdims=True)
        with np.errstate(divide="ignore", invalid="ignore"):
            kept = np.abs(centered / np.sqrt(variance + epsilon) * weight + bias - y).max()
            left_out = np.abs(centered / np.sqrt(variance) * weight + bias - y).max()
        size = max(float(np.abs(y).max()), 1.0)
        if left_out <= 1e-5 * size < kept:
            found.append((node.output[0], epsilon, float(variance.min()), float(kept) / size))
    if not found:
        return False
    parted = ", ".join(host.diverging(run.tolerance)[:5])
    names = ", ".join(name for name, _, _, _ in found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
    epsilon, variance = found[0][1], min(v for _, _, v, _ in found)
    worst = max(off for _, _, _, off in found)
    host.cause = (
        f"OpenVINO's CPU plugin computes the LayerNormalization of {names} without its epsilon ({epsilon:g}), which "
        f"ONNX and the simulation add to the variance: rows with a variance down to {variance:.2g} come out up to "
        f"{worst:.2%} off, which moves {parted}"
    )
    host.remedy = (
        "have the normalization read its input through an op the plugin moves no scale through, such as "
        "Max(x, x) (the writer does so for each LayerNormalization and ReduceMean / Sub normalization it finds; "
        "this one is written otherwise); the difference is about epsilon / (2 x variance) of a row, below one step "
        "where the rows' variance is far above epsilon (as in a trained model)"
    )
    return True


SERVED_THREADS = 2  # the threads verify serves the file on (run_openvino_isolated's default)
RACE_RUNS = 3  # how many more times verify serves a file whose outputs part from the simulation


def _thread_race(
    host: HostReport,
    path: str | Path,
    feeds: Mapping[str, np.ndarray],
    served: Mapping[str, np.ndarray],
    tail: Mapping[str, np.ndarray],
    args: tuple[Any, ...],
) -> None:
    """Where the file's outputs part from the simulation: whether that depends on OpenVINO's threads.

    The file is served once on one thread. If its outputs there are what the simulation computes (from the same
    quantized tensors), it is served :data:`RACE_RUNS` more times on :data:`SERVED_THREADS` threads, and the cause
    says so, and whether the outputs on more threads changed from run to run (a race in the plugin: measured on
    OpenVINO 2026.4 with an int8 stride-2 ``ConvTranspose``), and the remedy is serving it on one thread.
    """
    run: VerifyRun = args[2]
    try:  # where one thread parts from the simulation too, threads are not the cause: no more runs
        single = run_openvino_file(path, feeds, threads=1)
        if served_outputs(HostReport("openvino_onnx", "OpenVINO CPU"), single, tail, *args).diverging(run.tolerance):
            return
        again = [run_openvino_file(path, feeds, threads=SERVED_THREADS) for _ in range(RACE_RUNS)]
    except RuntimeError:
        return
    changed = sum(any(not np.array_equal(run[name], served[name]) for name in served if name in run) for run in again)
    how = (
        f"differently from run to run on {SERVED_THREADS} threads ({changed} of {RACE_RUNS} more runs gave other "
        "outputs: a race in the plugin)"
        if changed
        else f"differently on {SERVED_THREADS} threads"
    )
    parted = ", ".join(host.diverging(run.tolerance)[:5])
    host.cause = (
        f"OpenVINO's CPU plugin computes the file as written {how} at {parted}; on one thread it computes what the "
        "simulation computes"
    )
    host.remedy = "serve this file on one thread: core.compile_model(path, 'CPU', {'INFERENCE_NUM_THREADS': 1})"


def _rounding_before_add(model: onnx.ModelProto, table: QParamTable) -> dict[tuple[str, int], tuple[float, float]]:
    """The quantizer calls whose FakeQuantize reads a Conv, MatMul or Gemm and is read by an Add: their limits."""
    producers = {name: node for node in model.graph.node for name in node.output}
    users = consumers_of(model.graph)
    constants = _constant_values(model.graph)
    found: dict[tuple[str, int], tuple[float, float]] = {}
    for node in model.graph.node:
        if node.op_type != "FakeQuantize" or node.domain != FAKE_QUANTIZE_DOMAIN or node.input[0] not in table:
            continue
        producer = producers.get(node.input[0])
        if producer is not None and producer.op_type == "Add":  # a Linear on 3-d inputs: MatMul, then its bias
            layer = [producers.get(name) for name in producer.input if name not in constants]
            producer = layer[0] if len(layer) == 1 else None
        entry = table[node.input[0]]
        if producer is None or producer.op_type not in ("Conv", "MatMul", "Gemm") or entry.axis is not None:
            continue
        if any(user.op_type in ("Add", "Sum") for user in users.get(node.output[0], [])):
            found[entry.quantizer, int(entry.extra.get("call", 0))] = entry.float_range()
    return found


def _dropped_rounding(
    model: onnx.ModelProto, result: Any, run: VerifyRun, values: Mapping[str, np.ndarray]
) -> tuple[dict[str, TensorDiff], dict[str, TensorDiff]] | None:
    """Where the file as written parts from the simulation at its outputs: whether OpenVINO's CPU plugin left out
    the rounding of a FakeQuantize before an Add it fused into the layer in front (it clamps, but does not round,
    that layer's output; exposing a tensor undoes the fusion, so no copy shows it).

    If the outputs of the file equal those of the simulation with those roundings left out, returns them compared
    with it, and what leaving them out does to each quantized tensor (in its steps, each computed from the same
    values before it, as verify measures every tensor); else None.
    """
    unrounded = _rounding_before_add(model, result.table)
    if not unrounded:
        return None
    sim = simulate(run.model, run.inputs, None, unrounded)
    by_output = {out: entry for entry in result.table.values() for out in entry.extra.get("outputs", ())}
    outputs = {}
    for index, name in enumerate(result.output_names):
        if name not in values or index >= len(sim.outputs):
            return None
        diff = tensor_diff(name, by_output.get(name), sim.outputs[index], values[name])
        if diff.float_mismatch() or (diff.max_lsb_diff is not None and diff.max_lsb_diff > run.tolerance):
            return None
        outputs[name] = diff
    # each quantized tensor as the simulation computes it from the values before it with those roundings left out:
    # its own difference, as verify measures every tensor
    local = simulate(run.model, run.inputs, sim.quantized)
    effect = {}
    for tensor, entry in result.table.items():
        key = (entry.quantizer, int(entry.extra.get("call", 0)))
        if key in sim.quantized and key in local.quantized:
            diff = tensor_diff(tensor, entry, local.quantized[key], sim.quantized[key])
            if diff.exact_fraction < 1.0:
                effect[tensor] = diff
    return outputs, effect


def serve(result: Any, threads: int = 2) -> Callable[[Mapping[str, np.ndarray]], list[np.ndarray]]:
    """The FakeQuantize model on OpenVINO's CPU plugin, compiled once (f32 inference precision, as verified)."""
    import openvino as ov

    path, outputs = result.artifacts["openvino_onnx"], list(result.output_names)
    config: dict[str, object] = {"INFERENCE_NUM_THREADS": int(threads), "INFERENCE_PRECISION_HINT": "f32"}
    compiled = ov.Core().compile_model(str(path), "CPU", config)
    ports = {name: port for port in compiled.outputs for name in port.get_names()}
    missing = [name for name in outputs if name not in ports]
    if missing:
        raise ValueError(f"OpenVINO's compiled model has no outputs named {missing[:5]}")

    def run(feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        values = compiled({name: np.ascontiguousarray(value) for name, value in feeds.items()})
        return [np.asarray(values[ports[name]]) for name in outputs]

    return run
