"""Operators that commute with quantization: one :data:`~mqbench.deploy.qlinear.converter.CommutingRule` per family.

A DequantizeLinear sinks below them and a QuantizeLinear rises above them, so they run on the
integers: Relu and Clip become an integer Clip at the quantized bounds (``Q(relu(x)) ==
max(Q(x), zero_point)``, quantization being monotone), or nothing where the bound is the lowest
integer anyway; MaxPool and the data-movement operators (:data:`DATA_MOVEMENT`) run as they are on
the integers, and so does Resize in nearest mode. :data:`COMMUTING_RULES` maps each operator to its rule.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import numpy as np
import onnx

from mqbench.deploy.qlinear.converter import CommutingRule, Converter
from mqbench.deploy.qlinear.grid import Grid, attributes

__all__ = ["COMMUTING_RULES", "DATA_MOVEMENT"]

DATA_MOVEMENT = frozenset({"Identity", "Flatten", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Gather", "Slice"})
"""Operators that move data without computing: run on the integers, never counted as left in float."""


def _clip(
    converter: Converter, node: onnx.NodeProto, source: str, target: str, grid: Grid, sinking: bool
) -> bool | None:
    """Relu and Clip (constant bounds): an integer Clip, or the identity at the type's own bounds."""
    bounds: list[Any] = [0.0, None] if node.op_type == "Relu" else [None, None]
    for i, name in enumerate(node.input[1:3] if node.op_type == "Clip" else []):
        value = converter.inits.get(name) if name else None
        if name and (value is None or value.size != 1):
            return False
        bounds[i] = None if value is None else float(value.reshape(-1)[0])
    ints = [None if b is None else int(grid.quantize(np.array(b))) for b in bounds]
    exact = all(b is None or grid.dequantize(np.array(i)) == np.float32(b) for b, i in zip(bounds, ints, strict=True))
    if sinking and not exact:
        return False  # a bound between grid points: clipping the float is no integer clip
    low = ints[0] if ints[0] is not None and ints[0] > grid.bounds[0] else None
    high = ints[1] if ints[1] is not None and ints[1] < grid.bounds[1] else None
    if low is None and high is None:
        return None
    converter.int_clip(source, target, low, high, grid.dtype)
    return True


def _move(
    converter: Converter, node: onnx.NodeProto, source: str, target: str, grid: Grid, sinking: bool
) -> bool | None:
    """The operator itself on the integers (its other inputs unchanged); not where it has a second output."""
    if any(node.output[1:]):
        return False
    attrs = attributes(node)
    converter.add(node.op_type, [source, *node.input[1:]], target, node.name or node.op_type, node.domain, **attrs)
    return True


def _resize(
    converter: Converter, node: onnx.NodeProto, source: str, target: str, grid: Grid, sinking: bool
) -> bool | None:
    """Resize in nearest mode picks input values, so it runs on the integers; other modes interpolate."""
    attrs = attributes(node)
    nearest = attrs.get("mode", b"nearest") == b"nearest"
    nearest &= attrs.get("coordinate_transformation_mode", b"") != b"tf_crop_and_resize"
    return _move(converter, node, source, target, grid, sinking) if nearest else False


COMMUTING_RULES: Mapping[str, CommutingRule] = MappingProxyType(
    {
        "Relu": _clip,
        "Clip": _clip,
        "MaxPool": _move,
        "Resize": _resize,
        **dict.fromkeys(DATA_MOVEMENT, _move),  # (Shape reads no values: the driver points it at the integers)
    }
)
"""Operator -> the rule writing it on the integers."""
