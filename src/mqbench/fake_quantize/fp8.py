"""FP8FakeQuantize: saturating FP8 (E4M3 or E5M2) with a scale per tensor or per channel.

The observer's symmetric range gives the scale ``amax / M`` (``M`` the format's largest value: 448 for E4M3,
57344 for E5M2), which its scheme carries as ``quant_min = -M``, ``quant_max = M``. Values are divided by the
scale, clamped to ``[-M, M]``, rounded to the nearest FP8 value (ties to even) and multiplied back
(:func:`mqbench.functional.fp8_quantize`); deployed as ONNX QuantizeLinear / DequantizeLinear on FLOAT8E4M3FN or
FLOAT8E5M2 (:class:`mqbench.grids.FP8Grid`).

Example:
    >>> import torch
    >>> from mqbench.fake_quantize import FP8FakeQuantize
    >>> fq = FP8FakeQuantize(quant_min=-448, quant_max=448, qscheme=torch.per_tensor_symmetric)
    >>> fq(torch.tensor([0.27, -1.3, 4.48])).tolist(), float(fq.scale)  # 27 -> 28, -130 -> -128: 3 mantissa bits
    ([0.2800000011920929, -1.2799999713897705, 4.480000019073486], 0.009999999776482582)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from mqbench.fake_quantize.fixed import ObserverQParamsQuantizer
from mqbench.functional import FP8_FORMATS, fp8_quantize
from mqbench.observer import MinMaxObserver

__all__ = ["FP8FakeQuantize"]


class FP8FakeQuantize(ObserverQParamsQuantizer):
    """Saturating FP8 fake quantization (see the module docstring); ``fp8`` is ``"e4m3"`` or ``"e5m2"``."""

    deploy_grid = "fp8_e4m3"

    def __init__(self, observer: Any = MinMaxObserver, fp8: str = "e4m3", **observer_kwargs: Any) -> None:
        if fp8 not in FP8_FORMATS:
            raise ValueError(f"fp8 must be one of {sorted(FP8_FORMATS)}, got {fp8!r}")
        largest = int(torch.finfo(FP8_FORMATS[fp8]).max)
        observer_kwargs.setdefault("quant_min", -largest)
        observer_kwargs.setdefault("quant_max", largest)
        if (observer_kwargs["quant_min"], observer_kwargs["quant_max"]) != (-largest, largest):
            raise ValueError(
                f"FP8 {fp8} has the range [-{largest}, {largest}] (its scheme's quant_min / quant_max), got "
                f"[{observer_kwargs['quant_min']}, {observer_kwargs['quant_max']}]"
            )
        super().__init__(observer, **observer_kwargs)
        if not self.symmetric:
            raise ValueError("FP8 has no zero point: use a symmetric qscheme")
        self.fp8 = fp8
        self.deploy_grid = f"fp8_{fp8}"

    def quantize(self, x: Tensor) -> Tensor:
        return fp8_quantize(x, self.scale, self.fp8, self.axis)

    def extra_repr(self) -> str:
        return f"fp8={self.fp8}, " + super().extra_repr()
