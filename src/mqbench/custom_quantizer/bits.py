"""Per-quantizer bit widths on a prepared model (``prepare_custom_config_dict["quantizer_bits"]``).

A width change keeps the kind of integer range the quantizer had: unsigned ``[0, 2^b - 1]``,
signed ``[-2^(b-1), 2^(b-1) - 1]`` or narrow signed ``[-(2^(b-1) - 1), 2^(b-1) - 1]``. Only
backends whose spec lists ``mixed_precision_bits`` deploy other widths than their own; a width
equal to the quantizer's is always accepted.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from mqbench.prepare_by_platform import prepare_by_platform
    >>> extra_qconfig_dict = {
    ...     "w_observer": "MinMaxObserver", "a_observer": "MinMaxObserver",
    ...     "w_fakequantize": "FixedFakeQuantize", "a_fakequantize": "FixedFakeQuantize",
    ...     "w_qscheme": {"bit": 8, "symmetry": True, "per_channel": True},
    ...     "a_qscheme": {"bit": 8, "symmetry": False, "per_channel": False},
    ... }
    >>> config = {"extra_qconfig_dict": extra_qconfig_dict, "quantizer_bits": {"1.weight_fake_quant": 4}}
    >>> model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 2)).eval()
    >>> qmodel = prepare_by_platform(model, "academic", config)
    >>> named = dict(qmodel.named_modules())
    >>> [(named[n].quant_min, named[n].quant_max) for n in ("0.weight_fake_quant", "1.weight_fake_quant")]
    [(-128, 127), (-8, 7)]
"""

from __future__ import annotations

from typing import Any

__all__ = ["quant_range_for_bits", "set_quantizer_bits"]


def quant_range_for_bits(quant_min: int, quant_max: int, bits: int) -> tuple[int, int]:
    """The ``bits``-wide range of the same kind (unsigned, signed or narrow signed) as ``[quant_min, quant_max]``."""
    if not isinstance(bits, int) or isinstance(bits, bool) or not 2 <= bits <= 16:
        raise ValueError(f"a bit width is an integer from 2 to 16, got {bits!r}")
    if quant_min >= 0:
        return 0, 2**bits - 1
    if quant_min == -quant_max:
        return -(2 ** (bits - 1) - 1), 2 ** (bits - 1) - 1
    return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1


def set_quantizer_bits(quantizer: Any, bits: int) -> None:
    """Give ``quantizer`` (and its observer) a ``bits``-wide range of its kind; its statistics are kept.

    A calibrated quantizer recomputes its parameters from the observer's statistics.
    """
    if getattr(quantizer, "deploy_grid", "linear") != "linear":
        raise ValueError(
            f"{type(quantizer).__name__} quantizes on a fixed {quantizer.deploy_grid} grid; its width cannot change"
        )
    observer = quantizer.activation_post_process
    low, high = quant_range_for_bits(int(quantizer.quant_min), int(quantizer.quant_max), bits)
    quantizer.quant_min, quantizer.quant_max = low, high
    observer.quant_min, observer.quant_max = low, high
    if getattr(observer, "calibrated", False):
        quantizer.update_qparams()
