"""QParamTable: the neutral intermediate between "ONNX with Q/DQ" and every artifact writer.

One entry per quantized ONNX tensor: scale, zero point, integer range, bits and axis
(``None`` per tensor). Activation entries may name the nodes that read the quantized
value (``consumers``); ``None`` means every reader.

Example:
    >>> import numpy as np
    >>> from mqbench.qparams import QParamTable, TensorQParams
    >>> entry = TensorQParams(np.array([0.5], np.float32), np.array([0], np.int32), -127, 127, kind="activation")
    >>> table = QParamTable({"conv_out": entry})
    >>> entry.bits, entry.float_range()
    (8, (-63.5, 63.5))
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from mqbench.functional import bits_of_range
from mqbench.grids import GRIDS

__all__ = ["GRIDS", "KINDS", "QParamTable", "TensorQParams", "float32_refusal"]

KINDS = ("activation", "weight")


def float32_refusal(subject: str, why: str) -> str:
    """The error for a quantization float32 cannot hold (:meth:`TensorQParams.float32_overflow`)."""
    return (
        f"{subject} cannot be deployed: {why}; written as float32 it overflows to inf, and the deployed model would "
        "compute inf or NaN. Its quantizer saw values near float32's limit or beyond (mask arithmetic, unbounded or "
        "non-finite values): exclude that layer from quantization (prepare_custom_config_dict "
        "{'extra_quantizer_dict': {'exclude_node_name': [...]}}), bound the values before it, or calibrate it on "
        "data of a realistic range"
    )


@dataclass(frozen=True, eq=False)
class TensorQParams:
    """The quantization of one tensor.

    ``scale`` (float32) and ``zero_point`` (int32) have shape ``[1]`` per tensor or
    ``[C]`` along ``axis``. ``grid="log"`` entries (NNIE) carry ``data_max``; their
    scale is informative (``data_max / 127``) and their zero point 0.
    """

    scale: np.ndarray
    zero_point: np.ndarray
    quant_min: int
    quant_max: int
    axis: int | None = None
    kind: str = "activation"
    consumers: tuple[str, ...] | None = None
    grid: str = "linear"
    data_max: float | None = None
    quantizer: str = ""  # the simulation's quantizer module, for reports
    extra: Mapping[str, Any] = field(default_factory=dict)
    # group-wise weights: one scale per group of this many input channels; ``axis`` is then 1 (the blocked axis, as
    # ONNX's DequantizeLinear block_size has it) and scale / zero_point hold the blocks of
    # ``mqbench.functional.group_shape(weight shape, group_size)`` flattened
    group_size: int | None = None

    def __post_init__(self) -> None:
        scale = np.atleast_1d(np.asarray(self.scale, dtype=np.float32))
        zero_point = np.atleast_1d(np.rint(np.asarray(self.zero_point)).astype(np.int32))
        if zero_point.size == 1 and scale.size > 1:
            zero_point = np.full(scale.shape, int(zero_point[0]), np.int32)
        if scale.ndim != 1 or scale.shape != zero_point.shape:
            raise ValueError(f"scale and zero_point must be 1-d and alike, got {scale.shape} and {zero_point.shape}")
        if not np.all(np.isfinite(scale)) or np.any(scale <= 0):
            raise ValueError(f"scales must be finite and positive, got {scale.tolist()[:8]}")
        if self.quant_min >= self.quant_max:
            raise ValueError(f"quant_min {self.quant_min} must be below quant_max {self.quant_max}")
        if self.axis is None and scale.size != 1:
            raise ValueError(f"per-tensor entries have one scale, got {scale.size}; give the channel axis")
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if self.grid not in GRIDS:
            raise ValueError(f"grid must be one of {tuple(GRIDS)} (mqbench.grids), got {self.grid!r}")
        if self.grid == "log" and self.data_max is None:
            raise ValueError("log-grid entries need data_max")
        if self.group_size is not None and (self.axis != 1 or self.kind != "weight" or self.grid != "linear"):
            raise ValueError(
                f"group-wise entries (group_size {self.group_size}) are linear-grid weights blocked along axis 1, "
                f"got axis {self.axis}, kind {self.kind!r}, grid {self.grid!r}"
            )
        object.__setattr__(self, "scale", scale)
        object.__setattr__(self, "zero_point", zero_point)
        if self.consumers is not None:
            object.__setattr__(self, "consumers", tuple(self.consumers))

    @property
    def bits(self) -> int:
        return bits_of_range(self.quant_min, self.quant_max)

    @property
    def per_channel(self) -> bool:
        return self.axis is not None

    def blocked(self, values: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        """A group-wise entry's ``values`` (its scale or zero point) as the blocks of a weight of ``shape``:
        ``[O, ceil(I / group_size), *k]``."""
        if self.group_size is None:
            raise ValueError("blocked() is for group-wise entries (group_size set)")
        blocks = [shape[0], -(-shape[1] // self.group_size), *shape[2:]]
        if int(np.prod(blocks)) != values.size:
            raise ValueError(
                f"{values.size} group-wise values do not fit a weight of shape {list(shape)} in groups of "
                f"{self.group_size} (blocks {blocks})"
            )
        return values.reshape(blocks)

    def expanded(self, values: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        """A group-wise entry's ``values`` repeated over each group: one per element of a weight of ``shape``."""
        assert self.group_size is not None
        full = np.repeat(self.blocked(np.asarray(values), shape), self.group_size, axis=1)
        return full[:, : shape[1]]

    @property
    def symmetric(self) -> bool:
        """Zero point 0 on a signed grid, or the unsigned grid of a non-negative tensor."""
        return bool(np.all(self.zero_point == 0))

    @property
    def signed(self) -> bool:
        return self.quant_min < 0

    @property
    def pot(self) -> bool:
        """Every scale is a power of two."""
        exponents = np.log2(self.scale.astype(np.float64))
        return bool(np.all(exponents == np.round(exponents)))

    def float_range(self) -> tuple[Any, Any]:
        """``((quant_min - zp) * scale, (quant_max - zp) * scale)``: floats per tensor, arrays per channel."""
        scale = self.scale.astype(np.float64)
        low = (self.quant_min - self.zero_point) * scale
        high = (self.quant_max - self.zero_point) * scale
        if self.axis is None:
            return float(np.float32(low[0])), float(np.float32(high[0]))
        return low.astype(np.float32), high.astype(np.float32)

    def with_changes(self, **changes: Any) -> TensorQParams:
        return replace(self, **changes)

    def float32_overflow(self) -> str | None:
        """Why this quantization cannot be written in float32 (every deployed file's type), or ``None``.

        A linear grid's ends ``(quant_min - zp) * scale`` and ``(quant_max - zp) * scale`` and its width are stored or
        computed in float32 by the clip-range, FakeQuantize and encodings formats and their runtimes; beyond
        float32's largest value they become inf, and the deployed model computes inf or NaN where the simulation
        did not. A log grid (NNIE) is its ``data_max``, which must be finite.
        """
        limit = float(np.finfo(np.float32).max)
        if self.grid == "log":  # the grid is data_max's (its scale is informative)
            if self.data_max is not None and not abs(self.data_max) <= limit:
                return f"data_max {self.data_max:.6g} lies beyond float32 (largest {limit:.6g})"
            return None
        scale = self.scale.astype(np.float64)
        low, high = (self.quant_min - self.zero_point) * scale, (self.quant_max - self.zero_point) * scale
        largest = np.maximum(np.maximum(np.abs(low), np.abs(high)), high - low)
        over = np.flatnonzero(largest > limit)
        if over.size == 0:
            return None
        c = int(over[np.argmax(largest[over])])
        where = f" (channel {c}, {over.size} of {scale.size} channels)" if self.axis is not None else ""
        return (
            f"scale {scale[c]:.6g} and zero point {int(self.zero_point[c])}{where} put the grid at "
            f"[{low[c]:.6g}, {high[c]:.6g}], whose ends or width lie beyond float32 (largest {limit:.6g})"
        )

    def same_quantization(self, other: TensorQParams) -> bool:
        return (
            self.quant_min == other.quant_min
            and self.quant_max == other.quant_max
            and self.axis == other.axis
            and self.grid == other.grid
            and np.array_equal(self.scale, other.scale)
            and np.array_equal(self.zero_point, other.zero_point)
            and self.group_size == other.group_size
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able form (lists for per-channel values)."""
        low, high = self.float_range()
        as_list = (lambda v: v.tolist()) if self.axis is not None else (lambda v: v)
        out: dict[str, Any] = {
            "kind": self.kind,
            "scale": self.scale.tolist() if self.axis is not None else float(self.scale[0]),
            "zero_point": self.zero_point.tolist() if self.axis is not None else int(self.zero_point[0]),
            "quant_min": self.quant_min,
            "quant_max": self.quant_max,
            "bits": self.bits,
            "axis": self.axis,
            "min": as_list(low),
            "max": as_list(high),
            "grid": self.grid,
        }
        if self.data_max is not None:
            out["data_max"] = self.data_max
        if self.consumers is not None:
            out["consumers"] = list(self.consumers)
        if self.quantizer:
            out["quantizer"] = self.quantizer
        if self.group_size is not None:
            out["group_size"] = self.group_size
        return out


class QParamTable(Mapping[str, TensorQParams]):
    """ONNX tensor name -> :class:`TensorQParams`, in graph order; read-only."""

    def __init__(self, entries: Mapping[str, TensorQParams] | None = None) -> None:
        self._entries = dict(entries or {})
        for name, entry in self._entries.items():
            why = entry.float32_overflow()
            if why is not None:
                by = f" (quantizer {entry.quantizer!r})" if entry.quantizer else ""
                raise ValueError(float32_refusal(f"tensor {name!r}{by}", why))

    def __getitem__(self, tensor: str) -> TensorQParams:
        try:
            return self._entries[tensor]
        except KeyError:
            raise KeyError(f"tensor {tensor!r} has no quantization parameters") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        kinds = [entry.kind for entry in self._entries.values()]
        return f"QParamTable({kinds.count('activation')} activations, {kinds.count('weight')} weights)"

    def activations(self) -> dict[str, TensorQParams]:
        return {name: e for name, e in self._entries.items() if e.kind == "activation"}

    def weights(self) -> dict[str, TensorQParams]:
        return {name: e for name, e in self._entries.items() if e.kind == "weight"}

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {name: entry.to_dict() for name, entry in self._entries.items()}


def pot_exponent(scale: float) -> int:
    """``n`` with ``scale == 2 ** -n`` (the fix position of power-of-two hardware); raises if not a power of two."""
    exponent = math.log2(scale)
    if exponent != round(exponent):
        raise ValueError(f"scale {scale!r} is not a power of two")
    return -round(exponent)
