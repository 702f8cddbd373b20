"""One QuantizeLinear / DequantizeLinear's constants (:class:`Grid`) and the moves between the 8-bit types.

Example:
    >>> import numpy as np
    >>> grid = Grid(np.array(0.5, np.float32), np.array(3, np.int8))
    >>> grid.quantize(np.array([1.0, -2.0])).tolist(), grid.shifted(np.dtype(np.uint8)).public()
    ([5, -1], (0.5, 131))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import helper

__all__ = ["EIGHT_BIT_TYPES", "Grid", "Input", "attributes", "shift"]

EIGHT_BIT_TYPES = (np.dtype(np.int8), np.dtype(np.uint8))


@dataclass(frozen=True, eq=False)
class Grid:
    """A QuantizeLinear/DequantizeLinear's constants: float32 scale and 8-bit zero point, scalar or along axis."""

    scale: np.ndarray
    zero_point: np.ndarray
    axis: int = 1

    @property
    def dtype(self) -> np.dtype:
        return self.zero_point.dtype

    @property
    def per_tensor(self) -> bool:
        return self.scale.size == 1

    @property
    def bounds(self) -> tuple[int, int]:
        info = np.iinfo(self.dtype)
        return int(info.min), int(info.max)

    def same(self, other: Grid) -> bool:
        return self.per_tensor and other.per_tensor and self.dtype == other.dtype and self.public() == other.public()

    def shifted(self, dtype: np.dtype) -> Grid:
        """The same grid on the other 8-bit type: integers and zero point move by 128."""
        return self if dtype == self.dtype else Grid(self.scale, shift(self.zero_point, dtype), self.axis)

    def _along(self, values: np.ndarray, ndim: int) -> np.ndarray:
        if self.per_tensor:
            return values.reshape(())
        shape = [1] * ndim
        shape[self.axis % ndim] = -1
        return values.reshape(shape)

    def quantize(self, values: np.ndarray) -> np.ndarray:
        """QuantizeLinear as onnxruntime computes it: float32 division, round half to even, saturation."""
        values = np.asarray(values, np.float32)
        scale = self._along(self.scale.astype(np.float32), values.ndim)
        zero = self._along(self.zero_point.astype(np.float32), values.ndim)
        return np.clip(np.rint(values / scale) + zero, *self.bounds).astype(self.dtype)

    def dequantize(self, values: np.ndarray) -> np.ndarray:
        ints = np.asarray(values).astype(np.int32)
        zero = self._along(self.zero_point.astype(np.int32), ints.ndim)
        return (ints - zero).astype(np.float32) * self._along(self.scale.astype(np.float32), ints.ndim)

    def public(self) -> tuple[Any, Any]:
        """``(scale, zero_point)``: a float and an int per tensor, float32 and int32 arrays per channel."""
        if self.per_tensor:
            return float(self.scale.reshape(-1)[0]), int(self.zero_point.reshape(-1)[0])
        return self.scale.astype(np.float32).copy(), self.zero_point.astype(np.int32)


Input = tuple[str, Grid]
"""An integer tensor and the grid it is on (the input and constants of a DequantizeLinear)."""


def shift(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Integers moved between int8 and uint8 (+128 towards uint8, -128 towards int8)."""
    return (np.asarray(values).astype(np.int32) + (128 if dtype == np.uint8 else -128)).astype(dtype)


def attributes(node: onnx.NodeProto, drop: tuple[str, ...] = ()) -> dict[str, Any]:
    """``node``'s attributes as Python values, but those named in ``drop``."""
    return {a.name: helper.get_attribute_value(a) for a in node.attribute if a.name not in drop}
