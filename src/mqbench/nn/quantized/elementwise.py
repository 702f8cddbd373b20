"""Integer reference elementwise and concatenation ops: Add (+ ReLU), Mul (+ ReLU), Cat.

Each takes float tensors, quantizes every input with its own (per-tensor) parameters and
returns the float result on the output grid:

* :class:`Add`: both operands to a common fixed point
  (:func:`~mqbench.nn.quantized.functional.add_rescale`, ``ADD_FRACTION_BITS`` fraction
  bits), added, requantized (8-bit operands; up to 10 bits fit the int32 accumulator);
* :class:`Mul`: the integer product ``(a - a_zp) * (b - b_zp)`` on the scale
  ``a_scale * b_scale``, requantized;
* :class:`Cat`: every input rescaled to the output grid (unchanged where its scale equals
  the output's), then concatenated.

NumPy broadcasting applies to Add and Mul, as in PyTorch.

Example:
    >>> import numpy as np
    >>> import torch
    >>> from mqbench.qparams import TensorQParams
    >>> from mqbench.nn.quantized import Add
    >>> grid = TensorQParams(np.array([0.1]), np.array([0]), -128, 127)
    >>> add = Add(grid, grid, TensorQParams(np.array([0.2]), np.array([0]), -128, 127), relu=True)
    >>> add
    Add(relu=True, scale=0.20000000298023224, zero_point=0)
    >>> a, b = torch.tensor([1.0, -3.0, 0.5]), torch.tensor([0.3, 1.0, 0.2])
    >>> add.forward_integer(*add.quantize_inputs(a, b)).tolist(), add(a, b).tolist()
    ([7, 0, 4], [1.399999976158142, 0.0, 0.800000011920929])
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor, nn

from mqbench.nn.quantized import functional as QF
from mqbench.nn.quantized.base import QuantizedModule, check_qparams, qparams_from_quantizer, to_numpy
from mqbench.qparams import TensorQParams

__all__ = ["Add", "Cat", "Mul"]


class _Binary(QuantizedModule):
    """Two per-tensor inputs (grids ``a_`` and ``b_``), one output grid."""

    a_scale: Tensor
    b_scale: Tensor

    def __init__(
        self,
        input_qparams_a: TensorQParams,
        input_qparams_b: TensorQParams,
        output_qparams: TensorQParams,
        relu: bool = False,
        rounding: str = "half_up",
    ) -> None:
        super().__init__(output_qparams, relu, None, rounding)
        self._register_grid("a_", check_qparams(input_qparams_a, "first input"))
        self._register_grid("b_", check_qparams(input_qparams_b, "second input"))

    @classmethod
    def from_observed(
        cls,
        quantizer_a: nn.Module,
        quantizer_b: nn.Module,
        output_quantizer: nn.Module,
        relu: bool = False,
        rounding: str = "half_up",
    ) -> _Binary:
        """The op with the parameters of the mqbench fake quantizers of its inputs and output."""
        return cls(
            qparams_from_quantizer(quantizer_a),
            qparams_from_quantizer(quantizer_b),
            qparams_from_quantizer(output_quantizer),
            relu,
            rounding,
        )

    def quantize_inputs(self, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
        """Both float inputs on their grids (int64)."""
        return self._quantize("a_", a), self._quantize("b_", b)

    def _combine(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def forward_integer(self, a: Tensor, b: Tensor) -> Tensor:
        """Input integers to output integers (int64)."""
        return torch.from_numpy(self._combine(self._integers("a_", a), self._integers("b_", b))).to(a.device)

    def forward(self, a: Tensor, b: Tensor) -> Tensor:
        qa, qb = self.quantize_inputs(a, b)
        return self._float_output(self._combine(to_numpy(qa), to_numpy(qb)), a)

    def extra_repr(self) -> str:
        return f"relu={self.relu}, {self._output_repr()}"


class Add(_Binary):
    """Integer reference ``a + b`` (``relu=True``: then a ReLU, a clamp at the output zero point)."""

    def _combine(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        scale_a, zero_a = self._grid("a_")[:2]
        scale_b, zero_b = self._grid("b_")[:2]
        total, total_scale = QF.add_rescale(a - zero_a, scale_a, b - zero_b, scale_b, self.rounding)
        ratio = total_scale / float(self._grid("")[0])
        return self._requantize(total, *QF.requantize_multiplier(ratio))


class Mul(_Binary):
    """Integer reference ``a * b`` (``relu=True``: then a ReLU)."""

    def _combine(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        scale_a, zero_a = self._grid("a_")[:2]
        scale_b, zero_b = self._grid("b_")[:2]
        ratio = float(scale_a) * float(scale_b) / float(self._grid("")[0])
        return self._requantize((a - zero_a) * (b - zero_b), *QF.requantize_multiplier(ratio))


class Cat(QuantizedModule):
    """Integer reference ``torch.cat(tensors, dim)``: each input rescaled to the output grid.

    ``forward(tensors)`` takes a sequence of float tensors, ``forward_integer(tensors)`` one
    of integer tensors on the inputs' grids (buffers ``input<i>_scale`` / ``_zero_point``).
    """

    def __init__(
        self,
        input_qparams: Sequence[TensorQParams],
        output_qparams: TensorQParams,
        dim: int = 0,
        rounding: str = "half_up",
    ) -> None:
        super().__init__(output_qparams, False, None, rounding)
        grids = list(input_qparams)
        if not grids:
            raise ValueError("Cat needs the parameters of at least one input")
        for i, qparams in enumerate(grids):
            self._register_grid(f"input{i}_", check_qparams(qparams, f"input {i}"))
        self.num_inputs = len(grids)
        self.dim = int(dim)

    @classmethod
    def from_observed(
        cls, input_quantizers: Sequence[nn.Module], output_quantizer: nn.Module, dim: int = 0, rounding: str = "half_up"
    ) -> Cat:
        """The op with the parameters of the mqbench fake quantizers of its inputs and output."""
        return cls(
            [qparams_from_quantizer(q) for q in input_quantizers],
            qparams_from_quantizer(output_quantizer),
            dim,
            rounding,
        )

    def _check_count(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        items = list(tensors)
        if len(items) != self.num_inputs:
            raise ValueError(f"Cat was built for {self.num_inputs} inputs, got {len(items)}")
        return items

    def quantize_inputs(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        """Every float input on its grid (int64)."""
        return [self._quantize(f"input{i}_", x) for i, x in enumerate(self._check_count(tensors))]

    def _combine(self, inputs: list[np.ndarray]) -> np.ndarray:
        out_scale, out_zero, low, high = self._grid("")
        parts = []
        for i, q in enumerate(inputs):
            scale, zero = self._grid(f"input{i}_")[:2]
            ratio = np.float64(scale) / np.float64(out_scale)
            parts.append(np.clip(QF.rescale(q - zero, ratio, self.rounding) + out_zero, low, high))
        return np.concatenate(parts, axis=self.dim)

    def forward_integer(self, tensors: Sequence[Tensor]) -> Tensor:
        """Input integers to output integers (int64)."""
        items = self._check_count(tensors)
        result = self._combine([self._integers(f"input{i}_", q) for i, q in enumerate(items)])
        return torch.from_numpy(result).to(items[0].device)

    def forward(self, tensors: Sequence[Tensor]) -> Tensor:
        items = self._check_count(tensors)
        result = self._combine([to_numpy(q) for q in self.quantize_inputs(items)])
        return self._float_output(result, items[0])

    def extra_repr(self) -> str:
        return f"num_inputs={self.num_inputs}, dim={self.dim}, {self._output_repr()}"
