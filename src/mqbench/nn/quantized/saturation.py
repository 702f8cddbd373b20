"""A model of int8 CPU kernels without VNNI: u8 x s8 products summed in pairs, saturating at int16.

x86 CPUs without VNNI (AVX2; AVX-512 without its VNNI extension) have no instruction that
multiplies 8-bit integers into 32-bit sums. onnxruntime's and OpenVINO's int8 kernels use
``vpmaddubsw`` instead: it multiplies unsigned 8-bit activations by signed 8-bit weights and adds
each two *adjacent* products into a signed 16-bit lane, saturating at ``[-32768, 32767]``; the
16-bit sums are then widened and accumulated exactly. Two products of ``255 * 127`` already reach
64770, so a layer whose weights use the full 8-bit range can compute a different accumulator from
the one the simulation (and any VNNI CPU) computes. Weights on a 7-bit grid (``|w| <= 64``) cannot
saturate: ``2 * 255 * 64 = 32640``.

Which products are adjacent is the kernel's data layout, described by a :class:`PairSaturation`:

* ``layout="flat"``: the reduction of a convolution runs over (kernel rows, kernel columns,
  channels) flattened, channel innermost, and products are paired along it, across kernel taps
  when the channel count is odd (onnxruntime's MLAS, NHWC im2col; matrix products pair along K);
* ``layout="tap"``: channels are paired within each kernel tap, an odd channel count padded with a
  zero (oneDNN's blocked weights, as OpenVINO's CPU plugin runs them).

Signed 8-bit activations are shifted by 128 into unsigned values first, the shift's contribution
subtracted afterwards (``signed_shift=128``), so the shifted values saturate: oneDNN does so, and
onnxruntime converts the int8 activations of a Q/DQ graph to uint8 before fusing its int8 kernels
(:data:`ORT_MLAS_AVX2`). Int8 activations that stay int8 (a QLinear graph's, and a Q/DQ graph's
whose int8 tensors are graph outputs, which onnxruntime cannot retype) run on signed x signed
kernels that do not saturate (:data:`ORT_QLINEAR_AVX2`).
Depthwise convolutions run on kernels that widen each product and never saturate.

Products of two activations (attention's ``Q K^T`` and ``P V``): the right operand takes the
weights' place. OpenVINO runs them on the same kernels (``activation_products=True``: they saturate
where the right operand is signed); onnxruntime's kernels for a right operand computed at run time
do not saturate. Measured on an AVX2 host against onnxruntime 1.32 and OpenVINO 2026.4: this model
reproduces their int8 accumulators exactly where they run a layer on int8 kernels (onnxruntime runs
some matrix products in float after its own fusions, e.g. a bias Add and GELU after a MatMul, so a
layer predicted to saturate may still be served exactly).

:func:`pair_saturation_correction` returns what saturation adds to the exact accumulator, so
``exact + correction`` is what such a CPU computes.

Example:
    >>> import numpy as np
    >>> cols = np.array([[[200, 250]]])        # one row, one tap, two channels (raw u8)
    >>> weights = np.array([[[127], [127]]])   # (taps, channels, outputs)
    >>> int(pair_saturation_correction(cols, weights, "flat")[0, 0])   # 200*127 + 250*127 = 57150 -> 32767
    -24383
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from mqbench.nn.quantized.functional import Padding, sliding_windows

__all__ = [
    "INT16_RANGE",
    "LAYOUTS",
    "ONEDNN_AVX2",
    "ORT_MLAS_AVX2",
    "ORT_QLINEAR_AVX2",
    "PairSaturation",
    "conv_saturation_correction",
    "pair_saturation_correction",
]

INT16_RANGE = (-32768, 32767)
LAYOUTS = ("flat", "tap")
_ROW_CHUNK = 1 << 22  # elements of one (rows x risky pairs) block


@dataclass(frozen=True)
class PairSaturation:
    """How one runtime's int8 kernels pair u8 x s8 products on a CPU without VNNI."""

    runtime: str
    layout: str  # see the module notes
    signed_shift: int | None  # signed activations shifted by this into u8 before the products; None: not saturating
    activation_products: bool = False  # products of two activations saturate too

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")

    def raw_activation(self, q: np.ndarray, signed: bool) -> np.ndarray | None:
        """The kernel's unsigned operand for 8-bit activations ``q``; None where its kernel does not saturate."""
        if not signed:
            return q
        if self.signed_shift is None:
            return None
        return q + self.signed_shift


ORT_MLAS_AVX2 = PairSaturation("onnxruntime", "flat", 128)  # serving a Q/DQ graph
ORT_QLINEAR_AVX2 = PairSaturation("onnxruntime", "flat", None)  # int8 activations kept (a QLinear graph)
ONEDNN_AVX2 = PairSaturation("OpenVINO", "tap", 128, activation_products=True)


def pair_saturation_correction(columns: np.ndarray, weights: np.ndarray, layout: str) -> np.ndarray:
    """What 16-bit pair saturation adds to ``columns @ weights``: ``(rows, outputs)``, int64.

    ``columns`` is ``(rows, taps, channels)`` of raw unsigned activations, ``weights``
    ``(taps, channels, outputs)`` of raw signed weights (the products are of these raw values, before
    any zero point is subtracted). Only weight pairs that can saturate at all
    (``max|a| * (|w0| + |w1|) > 32767``) are evaluated, so 7-bit weights cost nothing.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    columns, weights = np.asarray(columns, np.int64), np.asarray(weights, np.int64)
    rows, taps, channels = columns.shape
    outputs = weights.shape[-1]
    if layout == "tap" and channels % 2:
        columns = np.concatenate([columns, np.zeros((rows, taps, 1), np.int64)], axis=2)
        weights = np.concatenate([weights, np.zeros((taps, 1, outputs), np.int64)], axis=1)
    columns, weights = columns.reshape(rows, -1), weights.reshape(-1, outputs)
    if columns.shape[1] % 2:  # "flat" with an odd reduction: the kernel pads with a zero
        columns = np.concatenate([columns, np.zeros((rows, 1), np.int64)], axis=1)
        weights = np.concatenate([weights, np.zeros((1, outputs), np.int64)], axis=0)
    correction = np.zeros((rows, outputs), np.int64)
    if rows == 0 or columns.size == 0:
        return correction
    top = int(np.abs(columns).max())
    pair_weight = np.abs(weights[0::2]) + np.abs(weights[1::2])  # (pairs, outputs)
    output_index, pair_index = np.nonzero((top * pair_weight > INT16_RANGE[1]).T)  # grouped by output
    if pair_index.size == 0:
        return correction
    outputs_hit, starts = np.unique(output_index, return_index=True)
    w0, w1 = weights[2 * pair_index, output_index], weights[2 * pair_index + 1, output_index]
    step = max(1, _ROW_CHUNK // pair_index.size)
    for start in range(0, rows, step):
        block = columns[start : start + step]
        sums = block[:, 2 * pair_index] * w0 + block[:, 2 * pair_index + 1] * w1
        lost = np.clip(sums, *INT16_RANGE) - sums
        correction[start : start + step, outputs_hit] = np.add.reduceat(lost, starts, axis=1)
    return correction


def conv_saturation_correction(
    x: np.ndarray,
    weight: np.ndarray,
    stride: int | Sequence[int] = 1,
    padding: Padding = 0,
    dilation: int | Sequence[int] = 1,
    groups: int = 1,
    fill: int = 0,
    layout: str = "flat",
) -> np.ndarray:
    """Pair saturation's correction of an N-d convolution's accumulator, ``(N, out_channels, *out)``.

    ``x`` holds the raw unsigned activations ``(N, C, *spatial)`` (padding with ``fill``, the raw
    zero point), ``weight`` the raw signed weights ``(out_channels, C / groups, *kernel)``.
    Depthwise convolutions (one input and one output channel per group) do not saturate: zeros.
    """
    x, weight = np.asarray(x, np.int64), np.asarray(weight, np.int64)
    n = x.shape[0]
    out_channels, group_channels = weight.shape[:2]
    kernel = weight.shape[2:]
    dims = len(kernel)
    win = sliding_windows(x, kernel, stride, padding, dilation, fill)
    out_shape = win.shape[2 : 2 + dims]
    result = np.zeros((n, out_channels, *out_shape), np.int64)
    if group_channels == 1 and out_channels == groups > 1:
        return result
    positions, taps = int(np.prod(out_shape)), int(np.prod(kernel))
    per_group = out_channels // groups
    # (N, groups, Cg, *out, *kernel) -> (groups, N * positions, taps, Cg)
    cols = win.reshape(n, groups, group_channels, positions, taps).transpose(1, 0, 3, 4, 2)
    cols = cols.reshape(groups, n * positions, taps, group_channels)
    w = weight.reshape(groups, per_group, group_channels, taps).transpose(0, 3, 2, 1)  # (groups, taps, Cg, out/g)
    for g in range(groups):
        correction = pair_saturation_correction(cols[g], w[g], layout)  # (N * positions, out/g)
        block = correction.reshape(n, positions, per_group).transpose(0, 2, 1).reshape(n, per_group, *out_shape)
        result[:, g * per_group : (g + 1) * per_group] = block
    return result
