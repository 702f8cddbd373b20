"""The ``openvino_onnx`` file: the float model with OpenVINO FakeQuantize ops, written in the layouts OpenVINO's CPU
plugin serves exactly.

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
from collections.abc import Mapping

import numpy as np
import onnx
import torch
from onnx import helper, numpy_helper

from mqbench.deploy.onnx_graph import (
    all_names,
    constant,
    consumers_of,
    free_output_name,
    initializer_map,
    topological_sort,
    unique_name,
)
from mqbench.functional import fake_quantize
from mqbench.qparams import QParamTable, TensorQParams

__all__ = ["FAKE_QUANTIZE_DOMAIN", "fake_quantize_as_onnx", "fake_quantize_outputs", "to_openvino"]

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
    """Every normalized tensor that a node computes from a FakeQuantize output is read by its normalization through
    ``Max(x, x)`` (``x`` exactly, NaN included).

    Measured on OpenVINO 2026.4: where a LayerNormalization (or the ReduceMean / Sub / ... form the plugin fuses into
    one) reads an ``Add`` of two FakeQuantize outputs, the CPU plugin's low-precision pass moves the sum's
    dequantization scale past the normalization, which is scale-invariant only without epsilon: the plugin then
    normalizes by the square root of the variance alone, and rows whose variance is within a few hundred times
    epsilon come out steps off. The plugin moves no scale through a ``Max``, so it normalizes the float sum as ONNX
    and the simulation do (with the ``Max``: 0 steps off on the rows that were 19 off). A tensor computed from float
    values alone (a transformer's float residual add) has no scale to move: it is read as it is (the ``Max`` costs
    OpenVINO about 5% of all-MiniLM-L6-v2's latency, one memory pass before each of its 13 normalizations).
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
    fake_quantized = {node.output[0] for node in graph.node if node.op_type == "FakeQuantize"}
    for tensor, nodes in readers.items():
        if tensor not in producers or not fake_quantized & set(producers[tensor].input):
            continue  # a network input, a constant or a sum of float values: no scale to move
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


def _seven_bit_weights(graph: onnx.GraphProto, tensor: str, entry: TensorQParams, users: Mapping) -> bool:
    """Whether ``tensor`` is a weight initializer on the signed 7-bit grid [-64, 63] that only its layer reads."""
    grid = (entry.quant_min, entry.quant_max) == (-64, 63) and not np.any(np.asarray(entry.zero_point))
    return entry.kind == "weight" and grid and tensor in initializer_map(graph) and len(users.get(tensor, [])) == 1


def _on_int8_grid(
    graph: onnx.GraphProto, tensor: str, entry: TensorQParams, low: np.ndarray, high: np.ndarray
) -> tuple[np.ndarray, np.ndarray, int]:
    """7-bit weights as the CPU plugin runs them in int8 kernels: clamped to the 7-bit limits in the file, under a
    FakeQuantize of 256 levels of the same step (one of 128 levels leaves the layer in float: MobileNetV2 with 19
    such layers took 8.6 ms a call instead of 6.0). Clamping commutes with rounding (the limits are grid points),
    so these are the 7-bit weights exactly, and the kernel's integers stay within [-64, 63]."""
    weight = initializer_map(graph)[tensor]
    value = numpy_helper.to_array(weight)
    weight.CopyFrom(numpy_helper.from_array(np.clip(value, low, high).astype(value.dtype), tensor))
    step_low, step_high = low / entry.quant_min, high / entry.quant_max  # the step, shaped as the limits
    return (step_low * -128).astype(np.float32), (step_high * 127).astype(np.float32), 256


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
        levels = entry.quant_max - entry.quant_min + 1
        if _seven_bit_weights(graph, tensor, entry, users):
            low, high, levels = _on_int8_grid(graph, tensor, entry, low, high)
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
                levels=levels,
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
