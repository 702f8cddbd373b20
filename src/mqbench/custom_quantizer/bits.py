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

import difflib
from collections.abc import Mapping
from typing import Any

from torch import nn

from mqbench.functional import bits_of_range
from mqbench.utils.state import is_quantizer

__all__ = ["apply_quantizer_bits", "quant_range_for_bits", "set_quantizer_bits"]


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


def apply_quantizer_bits(model: nn.Module, spec: Any, mapping: Mapping[str, int]) -> None:
    """Set each named quantizer of a prepared model to its width; errors name the quantizer and the choices."""
    if not isinstance(mapping, Mapping):
        raise ValueError(f"quantizer_bits maps quantizer names to bit widths, got {type(mapping).__name__}")
    named = {name: module for name, module in model.named_modules() if is_quantizer(module)}
    allowed = tuple(getattr(spec, "mixed_precision_bits", ()))
    for name, bits in mapping.items():
        quantizer = named.get(name)
        if quantizer is None:
            close = difflib.get_close_matches(str(name), list(named), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else f"; the model has {len(named)} quantizers"
            raise ValueError(f"quantizer_bits names {name!r}, which is not a quantizer of the prepared model{hint}")
        current = bits_of_range(int(quantizer.quant_min), int(quantizer.quant_max))
        if bits == current:
            continue
        if bits not in allowed:
            widths = ", ".join(map(str, allowed)) if allowed else f"only its own ({current}-bit)"
            raise ValueError(
                f"backend {spec.name!r} deploys {name} at {widths} bits, not {bits}: its format has one width per "
                "quantizer kind. Mixed precision needs a backend that lists mixed_precision_bits (academic, "
                "academic_nlp)"
            )
        set_quantizer_bits(quantizer, bits)
