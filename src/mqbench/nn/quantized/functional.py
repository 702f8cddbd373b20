"""Integer kernels of quantized inference, on NumPy arrays: what int8 hardware computes.

One implementation, used by the integer reference modules of :mod:`mqbench.nn.quantized`
and by the ONNX reference executor :mod:`mqbench.deploy.reference`:

* :func:`quantize` / :func:`dequantize`: ``clamp(rint(x / scale) + zero_point, qmin, qmax)``
  with a float32 true division and round half to even (as the simulation and ONNX
  QuantizeLinear do), and ``(q - zero_point) * scale`` rounded once to float32;
* :func:`conv_accumulate`, :func:`conv_transpose_accumulate`, :func:`linear_accumulate` and
  :func:`exact_matmul`: exact integer accumulation of zero-point-centred integers;
* :func:`quantize_bias`: the bias on the accumulator grid ``input_scale * weight_scale``,
  round half to even;
* :func:`requantize_multiplier` and :func:`requantize`: the fixed-point rescale of an int32
  accumulator to the output grid, ``clamp(((acc * m0 + 2**(n-1)) >> n) + zp, qmin, qmax)``
  with ``acc_scale / out_scale ~= m0 * 2**-n`` and a 31-bit ``m0``;
* :func:`add_rescale`: two operands brought to a common fixed point (``ADD_FRACTION_BITS``
  fraction bits) and added.

Rounding of the requantization shift is a parameter (``ROUNDINGS``): ``"half_up"`` (the
default: one add and an arithmetic shift, ties towards +inf), ``"half_even"`` (what a float
graph does at exact ties) or ``"half_away"`` (ties away from zero).

Exactness: products of centred ``b``-bit integers are below ``2**(2b)`` in magnitude (``2**16``
for 8 bits). :func:`exact_matmul` multiplies in float64, where every partial sum is an exact
integer, while ``K * max|a| * max|b| <= 2**53`` (for 8 bits: reduction lengths up to ``2**37``),
and in int64 beyond that; the fixed-point rescale checks that accumulators fit in int32.

Example:
    >>> import numpy as np
    >>> from mqbench.nn.quantized import functional as QF
    >>> x_scale, w_scale, y_scale = 2.0**-6, 2.0**-5, 2.0**-3
    >>> x = QF.quantize(np.array([[0.5, -0.25]], np.float32), x_scale, 0, -128, 127)
    >>> w = np.array([[3, -2]])  # the int8 weight on w_scale, zero point 0
    >>> acc = QF.linear_accumulate(x, w) + QF.quantize_bias(np.array([0.0625]), x_scale * w_scale)
    >>> m0, shift = QF.requantize_multiplier(x_scale * w_scale / y_scale)
    >>> y = QF.requantize(acc, m0, shift, zero_point=0)
    >>> x.tolist(), acc.tolist(), y.tolist(), QF.dequantize(y, y_scale, 0).tolist()
    ([[32, -16]], [[256]], [[1]], [[0.125]])
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

__all__ = [
    "ADD_FRACTION_BITS",
    "FLOAT64_EXACT",
    "INT32_RANGE",
    "ROUNDINGS",
    "add_rescale",
    "check_int32",
    "conv_accumulate",
    "conv_transpose_accumulate",
    "dequantize",
    "exact_matmul",
    "fixed_point_multiply",
    "linear_accumulate",
    "quantize",
    "quantize_bias",
    "requantize",
    "requantize_multiplier",
    "requantize_multipliers",
    "rescale",
    "round_to_grid",
    "sliding_windows",
]

ADD_FRACTION_BITS = 20  # left shift of the 8-bit operands of an integer Add / Sub before rescaling
ROUNDINGS = ("half_up", "half_even", "half_away")  # how the requantization shift settles exact ties
INT32_RANGE = (-(2**31), 2**31 - 1)
FLOAT64_EXACT = 2**53  # integers up to this magnitude are exact in float64

Padding = int | Sequence[int] | Sequence[tuple[int, int]]


# -- fixed-point requantization ----------------------------------------------------------------
def requantize_multiplier(real: float) -> tuple[int, int]:
    """``(m0, shift)`` with ``real ~= m0 * 2**-shift``, ``2**30 <= m0 < 2**31`` and ``shift >= 1``.

    ``m0`` is the 31-bit fixed-point multiplier of an int32 datapath; the relative error is at
    most ``2**-31``. Raises ``ValueError`` for non-positive or non-finite values and for values
    too large for a positive shift (about ``2**30`` and above).

    >>> requantize_multiplier(0.5)
    (1073741824, 31)
    >>> m0, shift = requantize_multiplier(0.0123)
    >>> 2**30 <= m0 < 2**31, abs(m0 * 2.0**-shift / 0.0123 - 1) <= 2**-31
    (True, True)
    """
    real = float(real)
    if not math.isfinite(real) or real <= 0:
        raise ValueError(f"the real multiplier must be positive and finite, got {real!r}")
    mantissa, exponent = math.frexp(real)  # real == mantissa * 2**exponent, 0.5 <= mantissa < 1
    m0 = round(mantissa * 2**31)
    if m0 == 2**31:  # the mantissa rounded up to 1.0
        m0, exponent = 2**30, exponent + 1
    shift = 31 - exponent
    if shift < 1:
        raise ValueError(f"the real multiplier {real!r} is too large for a 31-bit fixed point (needs < 2**30)")
    return m0, shift


def requantize_multipliers(real: Any) -> tuple[np.ndarray, np.ndarray]:
    """:func:`requantize_multiplier` elementwise: int64 arrays ``(m0, shift)`` shaped like ``real``.

    >>> requantize_multipliers([0.5, 0.25])
    (array([1073741824, 1073741824]), array([31, 32]))
    """
    real = np.asarray(real, np.float64)
    pairs = [requantize_multiplier(float(r)) for r in real.reshape(-1)]
    m0 = np.array([p[0] for p in pairs], np.int64).reshape(real.shape)
    return m0, np.array([p[1] for p in pairs], np.int64).reshape(real.shape)


def check_int32(values: Any, what: str = "accumulator values") -> np.ndarray:
    """``values`` as int64, or ``ValueError`` where any lies outside the int32 range.

    >>> check_int32(np.array([2**31]), "bias")
    Traceback (most recent call last):
    ...
    ValueError: bias 2147483648..2147483648 exceed the int32 range
    """
    values = np.asarray(values, np.int64)
    if values.size and (values.min() < INT32_RANGE[0] or values.max() > INT32_RANGE[1]):
        raise ValueError(f"{what} {values.min()}..{values.max()} exceed the int32 range")
    return values


def fixed_point_multiply(acc: Any, m0: Any, shift: Any, rounding: str = "half_up") -> np.ndarray:
    """``round(acc * m0 * 2**-shift)`` on int64 for int32 ``acc``; ``m0`` and ``shift`` broadcast.

    >>> fixed_point_multiply(np.array([-3, -1, 1, 3]), 2**30, 31)  # times 0.5, ties up
    array([-1,  0,  1,  2])
    """
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
    acc = check_int32(acc)
    m0, shift = np.asarray(m0, np.int64), np.asarray(shift, np.int64)
    if np.any(m0 < 0) or np.any(m0 >= 2**31) or np.any(shift < 1):
        raise ValueError("m0 must lie in [0, 2**31) and shift be at least 1")
    # |acc * m0| < 2**62, so adding 2**61 cannot overflow; a shift past 62 leaves |value| < 0.5, i.e. 0.
    capped = np.minimum(shift, 62)
    half = np.int64(1) << (capped - 1)
    product = acc * m0
    if rounding == "half_away":
        rounded = np.sign(product) * ((np.abs(product) + half) >> capped)
    else:
        rounded = (product + half) >> capped  # arithmetic shift: floor, so ties go up
        if rounding == "half_even":
            tie = (product & ((half << 1) - 1)) == half
            rounded = rounded - (tie & ((rounded & 1) == 1))
    return np.where(shift > 62, np.int64(0), rounded)


def requantize(
    acc: Any,
    m0: Any,
    shift: Any,
    zero_point: Any = 0,
    qmin: int = -128,
    qmax: int = 127,
    rounding: str = "half_up",
) -> np.ndarray:
    """Fixed-point requantization: ``clamp(((acc * m0 + 2**(shift-1)) >> shift) + zero_point, qmin, qmax)``.

    ``acc`` holds int32 accumulators; ``m0`` and ``shift`` (see :func:`requantize_multiplier`)
    and ``zero_point`` broadcast against it (per channel). ``rounding`` settles exact ties of
    the shift: ``"half_up"`` (towards +inf, the default: one add and an arithmetic shift),
    ``"half_even"`` (what the float graph does) or ``"half_away"`` (from zero). Returns int64.

    >>> m0, shift = requantize_multiplier(0.25)
    >>> requantize(np.array([-6, -2, 2, 6, 1000]), m0, shift, zero_point=1)
    array([  0,   1,   2,   3, 127])
    >>> requantize(np.array([-6, -2, 2, 6]), m0, shift, rounding="half_even")
    array([-2,  0,  0,  2])
    >>> requantize(np.array([-6, -2, 2, 6]), m0, shift, rounding="half_away")
    array([-2, -1,  1,  2])
    """
    if qmin > qmax:
        raise ValueError(f"qmin {qmin} must not exceed qmax {qmax}")
    return np.clip(fixed_point_multiply(acc, m0, shift, rounding) + np.asarray(zero_point, np.int64), qmin, qmax)


def rescale(values: Any, ratio: Any, rounding: str = "half_up") -> np.ndarray:
    """``values * ratio`` rounded by the fixed-point multiply (unclamped int64); unchanged where every ratio is 1.

    >>> rescale(np.array([3, 5]), 1.0).tolist(), rescale(np.array([3, 5]), 0.5).tolist()
    ([3, 5], [2, 3])
    """
    ratio = np.asarray(ratio, np.float64)
    if np.all(ratio == 1.0):
        return np.asarray(values, np.int64)
    return fixed_point_multiply(values, *requantize_multipliers(ratio), rounding)


def add_rescale(
    a: Any, a_scale: Any, b: Any, b_scale: Any, rounding: str = "half_up", subtract: bool = False
) -> tuple[np.ndarray, float]:
    """Centred integers ``a`` and ``b`` on their scales, brought to one fixed point and added (or subtracted).

    Each operand is shifted left by ``ADD_FRACTION_BITS`` and rescaled by ``scale / base`` with
    ``base = 2 * max(scales)`` (so both multipliers are at most 0.5), then the two are added.
    Returns the int64 sum and its scale ``base * 2**-ADD_FRACTION_BITS``; scales may be arrays
    broadcasting against the operands.

    >>> total, scale = add_rescale(np.array([10]), 0.1, np.array([4]), 0.05)
    >>> total.tolist(), round(float(total[0] * scale), 6)
    ([6291456], 1.2)
    """
    base = 2.0 * max(float(np.max(a_scale)), float(np.max(b_scale)))
    terms = [
        fixed_point_multiply(
            np.asarray(v, np.int64) << ADD_FRACTION_BITS,
            *requantize_multipliers(np.asarray(s, np.float64) / base),
            rounding,
        )
        for v, s in ((a, a_scale), (b, b_scale))
    ]
    total = terms[0] - terms[1] if subtract else terms[0] + terms[1]
    return total, base * 2.0**-ADD_FRACTION_BITS


# -- the float <-> integer boundary ------------------------------------------------------------
def round_to_grid(x: Any, scale: Any, zero_point: Any) -> np.ndarray:
    """``rint(x / scale) + zero_point`` before saturation, as float64 (a float32 true division; infinities stay).

    >>> round_to_grid(np.array([0.25, 0.75, np.inf]), 0.5, 1).tolist()
    [1.0, 3.0, inf]
    """
    scale32 = np.asarray(scale, np.float32)
    return np.rint(np.asarray(x, np.float32) / scale32).astype(np.float64) + np.asarray(zero_point, np.float64)


def quantize(x: Any, scale: Any, zero_point: Any, quant_min: int, quant_max: int) -> np.ndarray:
    """``clamp(rint(x / scale) + zero_point, quant_min, quant_max)`` as int64 (float32 division, half to even).

    ``scale`` and ``zero_point`` broadcast against ``x`` (reshape per-channel values first).

    >>> quantize(np.array([-1.0, 0.05, 0.15, 9.0]), 0.1, 3, 0, 15).tolist()
    [0, 3, 5, 15]
    """
    if quant_min > quant_max:
        raise ValueError(f"quant_min {quant_min} must not exceed quant_max {quant_max}")
    q = round_to_grid(x, scale, zero_point)
    if np.isnan(q).any():
        raise ValueError("cannot quantize NaN")
    return np.clip(q, quant_min, quant_max).astype(np.int64)


def dequantize(q: Any, scale: Any, zero_point: Any) -> np.ndarray:
    """``(q - zero_point) * scale`` in float32, rounded once (the float64 product of these is exact).

    >>> dequantize(np.array([0, 3, 5]), 0.5, 3).tolist()
    [-1.5, 0.0, 1.0]
    """
    centred = np.asarray(q, np.int64) - np.asarray(zero_point, np.int64)
    return (centred * np.asarray(scale, np.float32).astype(np.float64)).astype(np.float32)


def quantize_bias(bias: Any, accumulator_scale: Any) -> np.ndarray:
    """The bias on the accumulator grid: ``rint(bias / accumulator_scale)`` (float64, half to even), int64.

    ``accumulator_scale`` is ``input_scale * weight_scale`` (per output channel for per-channel
    weights), computed in float64 from the float32 scales (an exact product).

    >>> quantize_bias(np.array([0.375, -0.125, 0.625]), 0.25).tolist()  # ties to even
    [2, 0, 2]
    """
    return np.rint(np.asarray(bias, np.float64) / np.asarray(accumulator_scale, np.float64)).astype(np.int64)


# -- exact integer accumulation ----------------------------------------------------------------
def exact_matmul(a: Any, b: Any) -> np.ndarray:
    """``a @ b`` of integer arrays (NumPy broadcasting of batch axes), exact, as int64.

    Runs as a float64 matrix product while ``K * max|a| * max|b| <= 2**53`` (every partial sum
    is then an exact integer, in any summation order), otherwise in int64.

    >>> exact_matmul(np.array([[1, -2]]), np.array([[3], [4]]))
    array([[-5]])
    """
    a, b = np.asarray(a), np.asarray(b)
    if not (np.issubdtype(a.dtype, np.integer) and np.issubdtype(b.dtype, np.integer)):
        raise ValueError(f"exact_matmul takes integer arrays, got {a.dtype} and {b.dtype}")
    if a.size == 0 or b.size == 0:
        return np.matmul(a.astype(np.int64), b.astype(np.int64))
    bound = a.shape[-1] * int(np.abs(a).max()) * int(np.abs(b).max())
    if bound <= FLOAT64_EXACT:
        return np.matmul(a.astype(np.float64), b.astype(np.float64)).astype(np.int64)
    if bound >= 2**63:
        raise ValueError(f"the integer product may reach {bound}, beyond int64")
    return np.matmul(a.astype(np.int64), b.astype(np.int64))


def linear_accumulate(x: Any, weight: Any) -> np.ndarray:
    """``x @ weight.T`` for centred integers ``x`` ``[..., in]`` and ``weight`` ``[out, in]``, exact, int64.

    >>> linear_accumulate(np.array([[2, -1, 3]]), np.array([[1, 1, 1], [0, -5, 2]])).tolist()
    [[4, 11]]
    """
    x, weight = np.asarray(x), np.asarray(weight)
    if weight.ndim != 2 or x.ndim < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"linear: input of shape {x.shape} does not fit a weight of shape {weight.shape}")
    return exact_matmul(x, weight.T)


def _per_dim(value: int | Sequence[int], dims: int, what: str) -> list[int]:
    values = [int(value)] * dims if isinstance(value, int | np.integer) else [int(v) for v in value]
    if len(values) != dims:
        raise ValueError(f"{what} {value!r} does not fit {dims} spatial dimensions")
    return values


def _pads(padding: Padding, dims: int) -> list[tuple[int, int]]:
    """``padding`` as (begin, end) pairs: an int, one int per dimension or one pair per dimension."""
    if isinstance(padding, int | np.integer):
        return [(int(padding), int(padding))] * dims
    items: list[Any] = list(padding)
    if len(items) != dims:
        raise ValueError(f"padding {padding!r} does not fit {dims} spatial dimensions")
    pairs = [(int(p), int(p)) if isinstance(p, int | np.integer) else (int(p[0]), int(p[1])) for p in items]
    if any(begin < 0 or end < 0 for begin, end in pairs):
        raise ValueError(f"padding must not be negative, got {padding!r}")
    return pairs


def sliding_windows(
    x: np.ndarray,
    kernel: Sequence[int],
    stride: int | Sequence[int] = 1,
    padding: Padding = 0,
    dilation: int | Sequence[int] = 1,
    fill: Any = 0,
) -> np.ndarray:
    """``(N, C, *out, *kernel)`` view of every window of ``x`` ``(N, C, *spatial)``, padded with ``fill``.

    >>> sliding_windows(np.arange(5).reshape(1, 1, 5), [2], stride=2, padding=1, fill=-1)[0, 0].tolist()
    [[-1, 0], [1, 2], [3, 4]]
    """
    dims = len(kernel)
    if x.ndim != dims + 2:
        raise ValueError(f"a {dims}-d window op takes inputs of rank {dims + 2}, got shape {x.shape}")
    strides, dilations = _per_dim(stride, dims, "stride"), _per_dim(dilation, dims, "dilation")
    pads = _pads(padding, dims)
    padded = np.pad(x, [(0, 0), (0, 0), *pads], constant_values=fill)
    span = [(k - 1) * d + 1 for k, d in zip(kernel, dilations, strict=True)]
    if any(s > size for s, size in zip(span, padded.shape[2:], strict=True)):
        raise ValueError(f"the window {list(span)} is larger than the padded input {list(padded.shape[2:])}")
    view = sliding_window_view(padded, span, axis=tuple(range(2, dims + 2)))
    outer = tuple(slice(None, None, s) for s in strides)
    inner = tuple(slice(None, None, d) for d in dilations)
    return view[(slice(None), slice(None), *outer, *inner)]


def conv_accumulate(
    x: np.ndarray,
    weight: np.ndarray,
    stride: int | Sequence[int] = 1,
    padding: Padding = 0,
    dilation: int | Sequence[int] = 1,
    groups: int = 1,
) -> np.ndarray:
    """N-d convolution without bias by im2col and one matrix product per group.

    ``x`` is ``(N, C, *spatial)``, ``weight`` ``(out_channels, C / groups, *kernel)``; padding
    is an int, one int per spatial dimension or (begin, end) pairs and pads with zeros (the
    zero point of centred integers). Integer operands give an exact int64 result
    (:func:`exact_matmul`), float operands a float64 one.

    >>> x = np.arange(8).reshape(1, 2, 4)
    >>> conv_accumulate(x, np.array([[[1, -1], [0, 2]]]), padding=[(0, 1)]).tolist()
    [[[9, 11, 13, 3]]]
    """
    x, weight = np.asarray(x), np.asarray(weight)
    dims = weight.ndim - 2
    if dims < 1 or x.ndim != weight.ndim:
        raise ValueError(f"conv: input of shape {x.shape} does not fit a weight of shape {weight.shape}")
    n, channels = x.shape[:2]
    out_channels, group_channels = weight.shape[:2]
    kernel = weight.shape[2:]
    if groups < 1 or channels != group_channels * groups or out_channels % groups:
        raise ValueError(f"conv: {channels} input channels and weights {weight.shape} do not fit groups={groups}")
    integer = np.issubdtype(x.dtype, np.integer) and np.issubdtype(weight.dtype, np.integer)
    work = np.int64 if integer else np.float64
    win = sliding_windows(x.astype(work), kernel, stride, padding, dilation, 0)
    out_shape = win.shape[2 : 2 + dims]
    order = (0, 1, *range(3, 3 + dims), 2, *range(3 + dims, 3 + 2 * dims))
    cols = win.reshape(n, groups, group_channels, *out_shape, *kernel).transpose(order)
    cols = cols.reshape(n, groups, int(np.prod(out_shape)), -1)
    weights = weight.astype(work).reshape(groups, out_channels // groups, -1).transpose(0, 2, 1)
    out = exact_matmul(cols, weights) if integer else np.matmul(cols, weights)  # (n, groups, positions, out/groups)
    return out.transpose(0, 1, 3, 2).reshape(n, out_channels, *out_shape)


def conv_transpose_accumulate(
    x: np.ndarray,
    weight: np.ndarray,
    stride: int | Sequence[int] = 1,
    padding: int | Sequence[int] = 0,
    output_padding: int | Sequence[int] = 0,
    dilation: int | Sequence[int] = 1,
    groups: int = 1,
) -> np.ndarray:
    """N-d transposed convolution without bias, exact for integers (see :func:`conv_accumulate`).

    ``weight`` is ``(C, out_channels / groups, *kernel)``. Computed as the convolution of the
    stride-dilated input (zeros between the samples), padded by ``dilation * (kernel - 1) - padding``
    (plus ``output_padding`` at the end), with the spatially flipped, group-transposed weight.

    >>> conv_transpose_accumulate(np.array([[[1, 2]]]), np.array([[[1, 10]]]), stride=2).tolist()
    [[[1, 10, 2, 20]]]
    """
    x, weight = np.asarray(x), np.asarray(weight)
    dims = weight.ndim - 2
    if dims < 1 or x.ndim != weight.ndim:
        raise ValueError(f"conv_transpose: input of shape {x.shape} does not fit a weight of shape {weight.shape}")
    channels, group_out = weight.shape[:2]
    kernel = weight.shape[2:]
    if groups < 1 or x.shape[1] != channels or channels % groups:
        raise ValueError(
            f"conv_transpose: {x.shape[1]} input channels and weights {weight.shape} do not fit groups={groups}"
        )
    strides, dilations = _per_dim(stride, dims, "stride"), _per_dim(dilation, dims, "dilation")
    pads, extras = _per_dim(padding, dims, "padding"), _per_dim(output_padding, dims, "output_padding")
    if any(e >= max(s, d) or e < 0 for e, s, d in zip(extras, strides, dilations, strict=True)):
        raise ValueError(f"output_padding {extras} must be below the stride or the dilation")
    spread = np.zeros((*x.shape[:2], *[(i - 1) * s + 1 for i, s in zip(x.shape[2:], strides, strict=True)]), x.dtype)
    spread[(slice(None), slice(None), *[slice(None, None, s) for s in strides])] = x
    pairs: list[tuple[int, int]] = []
    crop: list[slice] = []
    for k, d, p, e in zip(kernel, dilations, pads, extras, strict=True):
        begin, end = d * (k - 1) - p, d * (k - 1) - p + e
        pairs.append((max(begin, 0), max(end, 0)))
        crop.append(slice(max(-begin, 0), spread.shape[2 + len(crop)] - max(-end, 0)))
    spread = spread[(slice(None), slice(None), *crop)]
    flipped = np.flip(weight, axis=tuple(range(2, 2 + dims)))
    grouped = flipped.reshape(groups, channels // groups, group_out, *kernel).swapaxes(1, 2)
    return conv_accumulate(
        spread, grouped.reshape(groups * group_out, channels // groups, *kernel), 1, pairs, dilations, groups
    )
