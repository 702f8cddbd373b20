"""ONNX Resize in float64 for the integer reference: nearest, linear and cubic, one axis at a time.

``onnx.reference`` interpolates wrongly where a Resize shrinks one axis and grows another (its
result then parts from onnxruntime and from PyTorch by whole units), so the reference computes
Resize itself, as the ONNX operator defines it: each output coordinate ``x`` maps to the input
coordinate ``x_original`` by ``coordinate_transformation_mode`` with ``scale = output / input``
(from ``sizes``, or the ``scales`` input as given), in float32 as onnxruntime computes it, and the
modes take their samples there:

* ``nearest``: the sample at ``x_original`` rounded by ``nearest_mode``, clamped into the axis (a pick,
  so integer tensors resize too);
* ``linear``: the two neighbours of ``x_original`` clamped into ``[0, input - 1]``, weighted by distance;
* ``cubic``: the four neighbours with the cubic kernel of ``cubic_coeff_a``, indices clamped to the
  edge (``exclude_outside`` drops the taps outside and renormalizes).

Each axis is a matrix of weights ``(output, input)``, so the N-d resize is one product per axis that
changes. Attributes it does not model (``antialias``, ``tf_crop_and_resize``, a region of interest,
``keep_aspect_ratio_policy`` other than stretch, a ``axes`` subset) return ``None``, and the node runs
in ``onnx.reference`` as before.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx

from mqbench.deploy.reference.values import Value, to_array

__all__ = ["axis_weights", "float_resize"]

_MODES = frozenset({"nearest", "linear", "cubic"})
_COORDINATES = frozenset({"half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric", "tf_half_pixel_for_nn"})


def _text(value: Any, default: str) -> str:
    if value is None:
        return default
    return value.decode() if isinstance(value, bytes) else str(value)


def _original(coordinate: str, size_in: int, size_out: int, scale: float) -> np.ndarray:
    """Input coordinates of the output samples, in float32 as onnxruntime computes them.

    The precision matters: nearest mode floors (or rounds) these, and ``9 / (18 / 14)`` is 7 in
    float32 but ``6.999...`` in float64, which picks a different sample.
    """
    f = np.float32
    x = np.arange(size_out, dtype=f)
    s = f(scale)
    if coordinate == "half_pixel":
        return (x + f(0.5)) / s - f(0.5)
    if coordinate == "pytorch_half_pixel":
        return (x + f(0.5)) / s - f(0.5) if size_out > 1 else np.zeros(size_out, f)
    if coordinate == "align_corners":
        return x * f(size_in - 1) / f(size_out - 1) if size_out > 1 else np.zeros(size_out, f)
    if coordinate == "asymmetric":
        return x / s
    return (x + f(0.5)) / s  # tf_half_pixel_for_nn


def _nearest(original: np.ndarray, rule: str) -> np.ndarray:
    if rule == "floor":
        return np.floor(original)
    if rule == "ceil":
        return np.ceil(original)
    ties = original - np.floor(original) == 0.5
    if rule == "round_prefer_ceil":
        return np.where(ties, np.ceil(original), np.round(original))
    return np.where(ties, np.floor(original), np.round(original))  # round_prefer_floor


def _cubic(distance: np.ndarray, a: float) -> np.ndarray:
    d = np.abs(distance)
    near = ((a + 2) * d - (a + 3)) * d * d + 1
    far = ((a * d - 5 * a) * d + 8 * a) * d - 4 * a
    return np.where(d <= 1, near, np.where(d < 2, far, 0.0))


def axis_weights(size_in: int, size_out: int, scale: float, attrs: dict[str, Any]) -> np.ndarray:
    """The ``(size_out, size_in)`` interpolation matrix of one axis, as ONNX Resize defines it."""
    mode = _text(attrs.get("mode"), "nearest")
    coordinate = _text(attrs.get("coordinate_transformation_mode"), "half_pixel")
    original = _original(coordinate, size_in, size_out, scale).astype(np.float64)
    weights = np.zeros((size_out, size_in))
    rows = np.arange(size_out)
    if mode == "nearest":
        index = np.clip(_nearest(original, _text(attrs.get("nearest_mode"), "round_prefer_floor")), 0, size_in - 1)
        weights[rows, index.astype(np.int64)] = 1.0
        return weights
    if mode == "linear":
        clamped = np.clip(original, 0, size_in - 1)
        low = np.floor(clamped).astype(np.int64)
        high = np.minimum(low + 1, size_in - 1)
        fraction = clamped - low
        np.add.at(weights, (rows, low), 1.0 - fraction)
        np.add.at(weights, (rows, high), fraction)
        return weights
    a = float(attrs.get("cubic_coeff_a", -0.75))
    base = np.floor(original).astype(np.int64)
    exclude = bool(attrs.get("exclude_outside", 0))
    for offset in (-1, 0, 1, 2):
        tap = base + offset
        w = _cubic(original - tap, a)
        if exclude:
            w = np.where((tap >= 0) & (tap < size_in), w, 0.0)
        np.add.at(weights, (rows, np.clip(tap, 0, size_in - 1)), w)
    if exclude:
        weights /= weights.sum(axis=1, keepdims=True)
    return weights


def float_resize(node: onnx.NodeProto, inputs: list[Any], attrs: dict[str, Any]) -> list[Value] | None:
    """Resize as ONNX defines it (float64, then the input's type); ``None`` for what it does not model."""
    x = to_array(inputs[0])
    mode = _text(attrs.get("mode"), "nearest")
    if mode not in _MODES or (x.dtype.kind != "f" and mode != "nearest"):
        return None
    if _text(attrs.get("coordinate_transformation_mode"), "half_pixel") not in _COORDINATES:
        return None
    if attrs.get("antialias", 0) or attrs.get("axes") is not None:
        return None
    if _text(attrs.get("keep_aspect_ratio_policy"), "stretch") != "stretch":
        return None
    roi = inputs[1] if len(inputs) > 1 else None
    scales = inputs[2] if len(inputs) > 2 else None
    sizes = inputs[3] if len(inputs) > 3 else None
    if roi is not None and to_array(roi).size:
        return None
    if sizes is not None and to_array(sizes).size:
        out_shape = [int(s) for s in to_array(sizes).reshape(-1)]
        factors = [float(np.float32(o) / np.float32(i)) if i else 1.0 for o, i in zip(out_shape, x.shape, strict=False)]
    elif scales is not None and to_array(scales).size:
        factors = [float(s) for s in to_array(scales).reshape(-1)]
        out_shape = [int(np.floor(i * f)) for i, f in zip(x.shape, factors, strict=False)]
    else:
        return None
    if len(out_shape) != x.ndim or len(factors) != x.ndim or min(out_shape) < 0 or min(x.shape) < 1:
        return None
    y = x if mode == "nearest" else x.astype(np.float64)
    for axis, (size_in, size_out, factor) in enumerate(zip(x.shape, out_shape, factors, strict=True)):
        if size_in == size_out and factor == 1.0:
            continue
        weights = axis_weights(size_in, size_out, factor, attrs)
        if mode == "nearest":  # a pick: the values themselves, integers included
            y = np.take(y, np.argmax(weights, axis=1), axis=axis)
        else:
            y = np.moveaxis(np.tensordot(weights, np.moveaxis(y, axis, 0), axes=(1, 0)), 0, axis)
    return [y.astype(x.dtype)]
