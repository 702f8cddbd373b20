"""Window geometry (pads, strides, dilations as ONNX gives them) and the float convolution kernels of the
integer reference: Conv and ConvTranspose (any groups) in float64, where onnx.reference is slow or wrong."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import onnx

from mqbench.deploy.reference.resize import float_resize
from mqbench.deploy.reference.values import Value, to_array
from mqbench.nn.quantized.functional import (
    conv_accumulate,
    conv_transpose_accumulate,
    sliding_windows,
)

__all__ = [
    "FLOAT_KERNELS",
    "conv2d",
    "conv_transpose",
    "float_conv",
    "float_conv_transpose",
    "transpose_geometry",
    "window_args",
    "window_geometry",
    "window_view",
]


def window_geometry(
    attrs: dict[str, Any], spatial: Sequence[int], kernel: Sequence[int]
) -> tuple[list[int], ...] | None:
    """(strides, pads, dilations) of a 2-d window op, ``None`` where not 2-d."""
    strides = list(attrs.get("strides", [1, 1]))
    dilations = list(attrs.get("dilations", [1, 1]))
    pads = list(attrs.get("pads", [0, 0, 0, 0]))
    if len(spatial) != 2 or len(kernel) != 2 or len(strides) != 2 or len(dilations) != 2 or len(pads) != 4:
        return None
    auto = attrs.get("auto_pad", b"NOTSET")
    auto = auto.decode() if isinstance(auto, bytes) else auto
    if auto == "VALID":
        pads = [0, 0, 0, 0]
    elif auto in ("SAME_UPPER", "SAME_LOWER"):
        for i in range(2):
            out = -(-spatial[i] // strides[i])
            total = max(0, (out - 1) * strides[i] + (kernel[i] - 1) * dilations[i] + 1 - spatial[i])
            begin = total // 2 if auto == "SAME_UPPER" else total - total // 2
            pads[i], pads[i + 2] = begin, total - begin
    return strides, pads, dilations


def window_args(geometry: tuple[list[int], ...]) -> tuple[list[int], list[tuple[int, int]], list[int]]:
    """(strides, (begin, end) pads, dilations) of a 2-d ONNX geometry, for the shared window kernels."""
    strides, pads, dilations = geometry
    return strides, [(pads[0], pads[2]), (pads[1], pads[3])], dilations


def window_view(x: np.ndarray, kernel: Sequence[int], geometry: tuple[list[int], ...], fill: Any) -> np.ndarray:
    """``(N, C, OH, OW, kh, kw)`` view of every window of the padded 4-d ``x``."""
    return sliding_windows(x, kernel, *window_args(geometry), fill=fill)


def conv2d(x: np.ndarray, w: np.ndarray, group: int, geometry: tuple[list[int], ...]) -> np.ndarray:
    """2-d convolution without bias: exact int64 for integers, float64 for floats."""
    return conv_accumulate(x, w, *window_args(geometry), groups=group)


def float_conv(node: onnx.NodeProto, inputs: list[Any], attrs: dict[str, Any]) -> list[Value] | None:
    x, w = to_array(inputs[0]), to_array(inputs[1])
    if x.ndim != 4 or w.ndim != 4:
        return None
    geometry = window_geometry(attrs, x.shape[2:], w.shape[2:])
    if geometry is None:
        return None
    out = conv2d(x, w, int(attrs.get("group", 1)), geometry)
    if len(inputs) > 2 and inputs[2] is not None:
        out = out + to_array(inputs[2]).astype(np.float64).reshape(1, -1, 1, 1)
    return [out.astype(x.dtype)]


def transpose_geometry(
    attrs: dict[str, Any], spatial: Sequence[int], kernel: Sequence[int]
) -> tuple[list[int], list[tuple[int, int]], list[int], list[int]] | None:
    """(strides, (begin, end) pads, dilations, output padding) of a ConvTranspose, as ONNX defines them.

    ``output_shape`` (or ``auto_pad`` SAME_*, which asks for ``input * stride``) sets the pads:
    ``total = stride * (input - 1) + output_padding + dilation * (kernel - 1) + 1 - output_shape``,
    the odd one at the end for SAME_UPPER, at the beginning otherwise. ``None`` where the attributes do not fit.
    """
    dims = len(spatial)
    strides = list(attrs.get("strides", [1] * dims))
    dilations = list(attrs.get("dilations", [1] * dims))
    extra = list(attrs.get("output_padding", [0] * dims))
    pads = list(attrs.get("pads", [0] * (2 * dims)))
    auto = attrs.get("auto_pad", b"NOTSET")
    auto = auto.decode() if isinstance(auto, bytes) else auto
    shape = list(attrs.get("output_shape", []))
    if auto in ("SAME_UPPER", "SAME_LOWER") and not shape:
        shape = [size * stride for size, stride in zip(spatial, strides, strict=False)]
    if any(len(v) != dims for v in (kernel, strides, dilations, extra)) or len(pads) != 2 * dims:
        return None
    if shape:
        if len(shape) != dims:
            return None
        for i in range(dims):
            total = strides[i] * (spatial[i] - 1) + extra[i] + dilations[i] * (kernel[i] - 1) + 1 - shape[i]
            small, large = total // 2, total - total // 2
            pads[i], pads[i + dims] = (small, large) if auto == "SAME_UPPER" else (large, small)
    elif auto == "VALID":
        pads = [0] * (2 * dims)
    if min(pads) < 0 or min(extra) < 0:
        return None
    return strides, [(pads[i], pads[i + dims]) for i in range(dims)], dilations, extra


def conv_transpose(
    x: np.ndarray, w: np.ndarray, group: int, geometry: tuple[list[int], list[tuple[int, int]], list[int], list[int]]
) -> np.ndarray | None:
    """N-d transposed convolution without bias: exact int64 for integers, float64 for floats.

    The unpadded result (every input sample spread over its window), ``output_padding`` zeros added
    at the end, the pads cut off both ends; ``None`` where the channels do not fit ``group``.
    """
    strides, pads, dilations, extra = geometry
    if x.shape[1] != w.shape[0] or w.shape[0] % group:
        return None
    full = conv_transpose_accumulate(x, w, strides, 0, 0, dilations, group)
    full = np.pad(full, [(0, 0), (0, 0), *[(0, e) for e in extra]])
    if any(begin + end >= size for (begin, end), size in zip(pads, full.shape[2:], strict=True)):
        return None
    return full[
        (
            slice(None),
            slice(None),
            *[slice(begin, size - end) for (begin, end), size in zip(pads, full.shape[2:], strict=True)],
        )
    ]


def float_conv_transpose(node: onnx.NodeProto, inputs: list[Any], attrs: dict[str, Any]) -> list[Value] | None:
    x, w = to_array(inputs[0]), to_array(inputs[1])
    geometry = transpose_geometry(attrs, x.shape[2:], w.shape[2:]) if x.ndim == w.ndim >= 3 else None
    out = None if geometry is None else conv_transpose(x, w, int(attrs.get("group", 1)), geometry)
    if out is None:
        return None
    if len(inputs) > 2 and inputs[2] is not None:
        out = out + to_array(inputs[2]).astype(np.float64).reshape(1, -1, *[1] * (x.ndim - 2))
    return [out.astype(x.dtype)]


FLOAT_KERNELS: dict[str, Callable[[onnx.NodeProto, list[Any], dict[str, Any]], list[Value] | None]] = {
    "Conv": float_conv,
    "ConvTranspose": float_conv_transpose,
    "Resize": float_resize,
}  # the reference's own float kernels, where onnx.reference is slow (Conv) or wrong (grouped ConvTranspose, Resize)
