"""Quantization grids as deployment reads them: one interface, one object per grid.

A quantizer class names its grid (``deploy_grid``: ``"linear"`` for every scale/zero-point
quantizer, power-of-two scales included, ``"log"`` for NNIE's logarithmic grid); a
:class:`~mqbench.qparams.TensorQParams` entry carries the name. Deployment reads a grid only
through :func:`grid_of`:

* ``qparams_of(quantizer)``: the entry's numbers from a calibrated quantizer (freezing);
* ``simulate(entry, x)``: the grid's fake quantization from the entry alone (frozen quantizers);
* ``steps(entry, values)``: each value's position on the grid in LSBs (verification measures
  differences with it);
* ``amax(entry)``: the clipping bound a parameter file records;
* ``to_onnx(builder, tensor, entry)``: the nodes that compute the grid in the Q/DQ model, and
  ``min_opset`` for them.

A new grid is one subclass of :class:`Grid` registered with :func:`register_grid`.

Example:
    >>> import numpy as np
    >>> from mqbench.grids import grid_of
    >>> from mqbench.qparams import TensorQParams
    >>> entry = TensorQParams(np.array([0.5], np.float32), np.array([0], np.int32), -128, 127)
    >>> grid_of(entry.grid).steps(entry, np.array([1.0, -2.5])).tolist()
    [2.0, -5.0]
    >>> log = TensorQParams(np.array([1.0], np.float32), np.array([0], np.int32), -127, 127, grid="log", data_max=8.0)
    >>> grid_of("log").steps(log, np.array([8.0, -8.0, 0.0])).tolist()  # level 127 is step 128 from zero
    [128.0, -128.0, 0.0]
"""

from __future__ import annotations

import functools
import math
from typing import Any, Protocol

import numpy as np
import onnx
import torch
from torch import Tensor

from mqbench import kernels
from mqbench.functional import FP8_FORMATS, fake_quantize, fp8_quantize
from mqbench.utils.registry import Registry


class TensorQParams(Protocol):
    """What a grid reads of a parameter-table entry (:class:`mqbench.qparams.TensorQParams` has it, read-only;
    named here as a protocol so that this module, which the table imports, imports nothing of it)."""

    @property
    def scale(self) -> np.ndarray: ...

    @property
    def zero_point(self) -> np.ndarray: ...

    @property
    def quant_min(self) -> int: ...

    @property
    def quant_max(self) -> int: ...

    @property
    def axis(self) -> int | None: ...

    @property
    def grid(self) -> str: ...

    @property
    def data_max(self) -> float | None: ...

    @property
    def group_size(self) -> int | None: ...

    @property
    def bits(self) -> int: ...

    def expanded(self, values: np.ndarray, shape: tuple[int, ...]) -> np.ndarray: ...

    def float_range(self) -> tuple[Any, Any]: ...


__all__ = [
    "GRIDS",
    "FP8Grid",
    "Grid",
    "LinearGrid",
    "LogGrid",
    "exponent_offset",
    "grid_of",
    "nnie_quantize",
    "register_grid",
]


class Grid:
    """How deployment reads one kind of grid (see the module docstring)."""

    name = ""
    min_opset = 0  # the opset its ONNX nodes need (0: whatever the model has)

    def qparams_of(self, quantizer: Any) -> dict[str, Any]:
        """``scale``, ``zero_point`` (tensors) and any grid parameter of a calibrated quantizer."""
        raise NotImplementedError

    def simulate(self, entry: TensorQParams, x: Tensor) -> Tensor:
        raise NotImplementedError

    def steps(self, entry: TensorQParams, values: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def amax(self, entry: TensorQParams) -> np.ndarray:
        raise NotImplementedError

    def to_onnx(self, builder: Any, tensor: str, entry: TensorQParams) -> str:
        """Append the nodes computing the grid on ``tensor`` through ``builder``; return the result's name."""
        raise NotImplementedError


def _along_axis(values: np.ndarray, entry: TensorQParams, ndim: int) -> np.ndarray:
    if entry.axis is None or not ndim:
        return values
    shape = [1] * ndim
    shape[entry.axis % ndim] = -1
    return values.reshape(shape)


class LinearGrid(Grid):
    """``(clamp(round(x / s) + z, qmin, qmax) - z) * s``: every scale/zero-point quantizer."""

    name = "linear"

    def qparams_of(self, quantizer: Any) -> dict[str, Any]:
        scale, zero_point = quantizer.export_qparams()
        return {"scale": scale, "zero_point": zero_point}

    def simulate(self, entry: TensorQParams, x: Tensor) -> Tensor:
        scale = torch.from_numpy(entry.scale).to(x.device)
        zero_point = torch.from_numpy(entry.zero_point).to(x.device)
        return fake_quantize(x, scale, zero_point, entry.quant_min, entry.quant_max, entry.axis)

    def steps(self, entry: TensorQParams, values: np.ndarray) -> np.ndarray:
        values = np.asarray(values, np.float64)
        if entry.group_size is not None:  # a weight in groups: each element's own group scale
            return values / entry.expanded(entry.scale.astype(np.float64), values.shape)
        return values / _along_axis(entry.scale.astype(np.float64), entry, values.ndim)

    def amax(self, entry: TensorQParams) -> np.ndarray:
        low, high = entry.float_range()
        return np.maximum(np.abs(np.asarray(low, np.float32)), np.abs(np.asarray(high, np.float32)))

    def to_onnx(self, builder: Any, tensor: str, entry: TensorQParams) -> str:
        # group-wise weights: integer blocks and a blocked DequantizeLinear (opset 21); QuantizeLinear holds 8 bits,
        # a wider grid is its arithmetic in float ops
        if entry.group_size is not None:
            return builder.blocked(tensor, entry)
        return builder.linear8(tensor, entry) if entry.bits <= 8 else builder.linear_wide(tensor, entry)


# -- NNIE's logarithmic grid -----------------------------------------------------------------------------
_LN2 = math.log(2.0)
_TINY = torch.finfo(torch.float32).tiny  # data_max is floored here, so log(data_max) is finite


def _log2_times_16(x: Tensor) -> Tensor:
    # log2 as log(x) / ln 2 in float64: PyTorch and onnxruntime give the same values this way.
    # ln 2 is a float64 tensor: torch.onnx.export(dynamo=True) stores Python float constants in
    # float32 precision, which moved the result by up to one level.
    return 16.0 * (torch.log(x) / torch.tensor(_LN2, dtype=torch.float64, device=x.device))


def exponent_offset(data_max: Tensor) -> Tensor:
    """``z = round(16 log2(data_max)) - 127`` in float64: the exponent offset of NNIE's log grid."""
    return torch.round(_log2_times_16(data_max.double().clamp(min=_TINY))) - 127.0


def _power_of_2_sixteenths(m: Tensor) -> Tensor:
    """``2 ** (m / 16)`` for integer-valued float64 ``m``, rounded to float32 (returned as float64)."""
    return torch.pow(2.0, m / 16.0).float().double()


_NORMAL = torch.finfo(torch.float32).tiny


@functools.lru_cache(maxsize=256)
def _log_grid_operands(data_max: float) -> tuple[int, Tensor, float, float] | None:
    """The fused kernel's operands for ``data_max``: ``z``, the 128 float32 levels and the two zero
    thresholds; None where a threshold is below the smallest normal float (the kernel's counting
    assumes normal floats). Cached: in QAT each quantizer calls with one ``data_max`` step after step.
    """
    z = exponent_offset(torch.tensor([data_max], dtype=torch.float64))
    levels = _power_of_2_sixteenths(z + torch.arange(128, dtype=torch.float64))
    zero_positive, zero_negative = _power_of_2_sixteenths(z - 16.0 + torch.tensor([0.0, 1.0], dtype=torch.float64))
    if float(zero_positive) < _NORMAL:
        return None
    return int(z), levels.float(), float(zero_positive), float(zero_negative)


def nnie_quantize_fused(x: Tensor, data_max: Tensor, factor: Tensor | None = None) -> Tensor:
    """:func:`nnie_quantize` with the same result in one pass over ``x`` (the fused CPU kernel).

    With ``factor`` (one per slice of ``x`` along axis 0), ``nnie_quantize(x * f, data_max) / f``
    per slice, the division being the multiplication by ``1 / f`` (BatchNorm folding in training).
    Falls back to :func:`nnie_quantize` where the kernel does not apply (not float32 on the CPU,
    kernels unavailable, or a zero threshold below the smallest normal float), and while tracing
    or exporting, which record :func:`nnie_quantize`'s ops.
    """
    tracing = torch.jit.is_tracing() or torch.onnx.is_in_onnx_export() or torch.compiler.is_compiling()
    tensors = (x,) if factor is None else (x, factor)
    operands = None
    if not tracing and kernels.usable(*tensors) and data_max.numel() == 1:
        operands = _log_grid_operands(float(data_max))
    if operands is None:
        if factor is None:
            return nnie_quantize(x, data_max)
        shape = [-1] + [1] * (x.dim() - 1)
        return nnie_quantize(x * factor.reshape(shape), data_max) * (1.0 / factor).reshape(shape)
    z, levels, zero_positive, zero_negative = operands
    return kernels.module().log_grid_forward(x, z, levels, zero_positive, zero_negative, factor)


def nnie_quantize(x: Tensor, data_max: Tensor) -> Tensor:
    """NNIE's log-domain fake quantization (ONNX-exportable ops only; computed in float64).

    With ``z = round(16 log2(data_max)) - 127`` and ``n = round(16 log2|x|)``, a positive ``x``
    becomes ``2 ** ((k + z) / 16)`` with ``k = clamp(n - z, 0, 127)`` and a negative one
    ``-2 ** ((k + z) / 16)`` with ``k = clamp(n - z, 1, 127)``. Magnitudes below the threshold
    ``2 ** ((z - 16) / 16)`` (positive) or ``2 ** ((z - 15) / 16)`` (negative) become 0.

    Levels and thresholds are powers ``2 ** (m / 16)`` with integer ``m``, computed in float64
    and rounded to float32; the comparison with the threshold is made in float64 against that
    float32 value. PyTorch's and onnxruntime's float64 ``pow`` and ``log`` differ in the last
    bit for some arguments, but these float32 roundings, and ``round`` of the float64 log of a
    float32 input, come out identical (tests/fake_quantize/test_onnx_export.py checks every
    level and the float32 neighbours of every rounding boundary), so the exported graph
    reproduces PyTorch bit for bit. The result has the dtype of ``x``.
    """
    xd = x.double()
    z = exponent_offset(data_max)
    magnitude = xd.abs()
    positive = xd > 0
    low = (~positive).to(xd.dtype)  # the smallest code: 0 for positive x, 1 for negative x
    k = torch.clamp(torch.maximum(torch.round(_log2_times_16(magnitude)) - z, low), max=127.0)
    level = _power_of_2_sixteenths(k + z)
    keep = magnitude >= _power_of_2_sixteenths(z - 16.0 + low)
    value = torch.where(keep, torch.where(positive, level, -level), torch.zeros_like(level))
    return value.to(x.dtype)


class LogGrid(Grid):
    """NNIE's 8-bit logarithmic grid, described by ``data_max`` alone (see :func:`nnie_quantize`)."""

    name = "log"
    min_opset = 12  # float64 Pow, GreaterOrEqual

    def qparams_of(self, quantizer: Any) -> dict[str, Any]:
        return {"scale": quantizer.scale, "zero_point": quantizer.zero_point, "data_max": quantizer.data_max}

    def simulate(self, entry: TensorQParams, x: Tensor) -> Tensor:
        return nnie_quantize_fused(x, torch.tensor([entry.data_max], dtype=torch.float32, device=x.device))

    def steps(self, entry: TensorQParams, values: np.ndarray) -> np.ndarray:
        """``sign(x) * (k + 1)`` for level ``k`` and 0 for zero: one LSB is one level (or the step to zero)."""
        z = float(exponent_offset(torch.tensor([entry.data_max], dtype=torch.float32)).item())
        magnitude = np.abs(np.asarray(values, np.float64))
        with np.errstate(divide="ignore"):
            k = np.where(magnitude > 0, np.round(16 * np.log2(np.maximum(magnitude, 1e-300))) - z + 1, 0)
        return np.sign(values) * k

    def amax(self, entry: TensorQParams) -> np.ndarray:
        return np.array([entry.data_max], np.float32)

    def to_onnx(self, builder: Any, tensor: str, entry: TensorQParams) -> str:
        """:func:`nnie_quantize` in the same float64 ONNX ops."""
        z = float(exponent_offset(torch.tensor([entry.data_max], dtype=torch.float32)).item())
        node = builder.node

        def f64(base: str, value: float) -> str:
            return str(builder.const(f"{tensor}_{base}", np.array(value, np.float64)))

        double = onnx.TensorProto.DOUBLE
        xd = node("Cast", [tensor], f"{tensor}_f64", to=double)
        magnitude = node("Abs", [xd], f"{tensor}_abs")
        positive = node("Greater", [xd, f64("zero", 0.0)], f"{tensor}_positive")
        low = node("Cast", [node("Not", [positive], f"{tensor}_negative")], f"{tensor}_low", to=double)
        log2 = node("Div", [node("Log", [magnitude], f"{tensor}_log"), f64("ln2", _LN2)], f"{tensor}_log2")
        n = node("Round", [node("Mul", [f64("sixteen", 16.0), log2], f"{tensor}_log2x16")], f"{tensor}_n")
        zc = f64("z", z)
        k = node("Max", [node("Sub", [n, zc], f"{tensor}_n_minus_z"), low], f"{tensor}_k_low")
        k = node("Min", [k, f64("k_max", 127.0)], f"{tensor}_k")

        def power(m: str, base: str) -> str:
            p = node("Pow", [f64("two", 2.0), node("Div", [m, f64("sixteen_d", 16.0)], f"{base}_m16")], base)
            p = node("Cast", [p], f"{base}_f32", to=onnx.TensorProto.FLOAT)
            return str(node("Cast", [p], f"{base}_f64", to=double))

        level = power(node("Add", [k, zc], f"{tensor}_k_plus_z"), f"{tensor}_level")
        shift = node("Add", [f64("z_minus_16", z - 16.0), low], f"{tensor}_threshold_exp")
        threshold = power(shift, f"{tensor}_threshold")
        keep = node("GreaterOrEqual", [magnitude, threshold], f"{tensor}_keep")
        signed = node("Where", [positive, level, node("Neg", [level], f"{tensor}_neg_level")], f"{tensor}_signed")
        value = node("Where", [keep, signed, f64("zero_level", 0.0)], f"{tensor}_value")
        return str(node("Cast", [value], f"{tensor}_dq", to=onnx.TensorProto.FLOAT))


# -- FP8 grids ---------------------------------------------------------------------------------------------------
class FP8Grid(Grid):
    """Saturating FP8 (E4M3FN or E5M2) with a float scale per tensor or per channel and no zero point: ONNX's
    QuantizeLinear / DequantizeLinear on a FLOAT8 type (opset 19); ``quant_min`` / ``quant_max`` are the
    format's largest value negated and itself."""

    min_opset = 19

    def __init__(self, fmt: str) -> None:
        self.fmt = fmt
        self.name = f"fp8_{fmt}"
        self.dtype = FP8_FORMATS[fmt]
        self.onnx_type = {"e4m3": onnx.TensorProto.FLOAT8E4M3FN, "e5m2": onnx.TensorProto.FLOAT8E5M2}[fmt]

    def qparams_of(self, quantizer: Any) -> dict[str, Any]:
        scale, zero_point = quantizer.export_qparams()
        return {"scale": scale, "zero_point": torch.zeros_like(zero_point)}

    def simulate(self, entry: TensorQParams, x: Tensor) -> Tensor:
        return fp8_quantize(x, torch.from_numpy(entry.scale).to(x.device), self.fmt, entry.axis)

    def steps(self, entry: TensorQParams, values: np.ndarray) -> np.ndarray:
        """Each value's FP8 code as a signed ordinal (the magnitude code, negated for negative values): one LSB is
        one FP8 value."""
        values = np.asarray(values, np.float64)
        scaled = values / _along_axis(entry.scale.astype(np.float64), entry, values.ndim)
        fp8 = torch.from_numpy(np.ascontiguousarray(scaled, np.float32)).to(self.dtype).view(torch.uint8)
        codes = fp8.numpy().astype(np.int64)
        magnitude = codes & 0x7F
        return np.where(codes & 0x80, -magnitude, magnitude).astype(np.float64)

    def amax(self, entry: TensorQParams) -> np.ndarray:
        return (float(torch.finfo(self.dtype).max) * entry.scale).astype(np.float32)

    def to_onnx(self, builder: Any, tensor: str, entry: TensorQParams) -> str:
        scale = entry.scale if entry.axis is not None else entry.scale.reshape(())
        shape = list(scale.shape)
        zero = onnx.helper.make_tensor(builder.name(f"{tensor}_zero_point"), self.onnx_type, shape, [0.0] * scale.size)
        builder.graph.initializer.append(zero)
        scale_name = builder.const(f"{tensor}_scale", scale.astype(np.float32))
        attrs = {} if entry.axis is None else {"axis": entry.axis}
        q = builder.node("QuantizeLinear", [tensor, scale_name, zero.name], f"{tensor}_quantized", saturate=1, **attrs)
        return str(builder.node("DequantizeLinear", [q, scale_name, zero.name], f"{tensor}_dq", **attrs))


class _GridRegistry(Registry[Grid]):
    missing_error = ValueError


GRIDS: Registry[Grid] = _GridRegistry(
    "quantization grid",
    {"linear": LinearGrid(), "log": LogGrid(), "fp8_e4m3": FP8Grid("e4m3"), "fp8_e5m2": FP8Grid("e5m2")},
)


def register_grid(grid: Grid, replace: bool = False) -> Grid:
    """Make ``grid`` known under ``grid.name`` (a quantizer class names it in ``deploy_grid``)."""
    if not isinstance(grid, Grid) or not grid.name:
        raise ValueError(f"register_grid expects a named Grid instance, got {grid!r}")
    return GRIDS.register(grid, grid.name, replace)


def grid_of(name: str) -> Grid:
    """The grid registered under ``name`` (ValueError listing the known ones otherwise)."""
    return GRIDS[name]
