"""``quantization_report``: every op of a prepared or converted model, quantized or float and why.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from mqbench.backend_config import (BackendConfig, BackendPatternConfig, DTypeConfig, QConfig,
    ...     QConfigMapping, default_weight_observer, prepare_fx, quantization_report)
    >>> from mqbench.observer import MinMaxObserver
    >>> int8 = DTypeConfig(input_dtype=torch.quint8, output_dtype=torch.quint8, weight_dtype=torch.qint8)
    >>> backend = BackendConfig("b").set_backend_pattern_config(BackendPatternConfig(nn.Linear).add_dtype_config(int8))
    >>> qconfig = QConfig(activation=MinMaxObserver.with_args(), weight=default_weight_observer)
    >>> prepared = prepare_fx(nn.Sequential(nn.Linear(4, 3), nn.Sigmoid()), QConfigMapping().set_global(qconfig),
    ...                       (torch.randn(1, 4),), backend_config=backend)
    >>> print(quantization_report(prepared))
    node  op      status     why
    _0    Linear  quantized  pattern Linear, OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT
    _1    Sigmoid float      no pattern of the backend matches Sigmoid
    1 of 2 ops quantized
"""

from __future__ import annotations

from torch import nn

from mqbench.backend_config.engine import decisions_of
from mqbench.utils.export_capture import CAPTURE_ATTRIBUTE

__all__ = ["quantization_report"]


def quantization_report(model: nn.Module) -> str:
    """One line per op of a model from :func:`prepare_fx`, :func:`convert_fx` or ``prepare_by_platform``.

    It prints the model's quantization plan. A float op says why: excluded by the user, no
    qconfig, no pattern of the backend for the op or chain that was seen (e.g.
    ``Conv2d-BatchNorm2d-ReLU``), the dtype constraints its qconfig breaks, by name
    (``scale_min_lower_bound``, ``quant_max_upper_bound``, ``dtype``, ...), or, on a built-in
    backend, that its placement rules put no quantizer there. A model captured with ``torch.export``
    (not torch.fx) ends with a line saying so.
    """
    decisions = decisions_of(model)
    if not decisions:
        raise ValueError(
            "the model carries no quantization plan: pass a model from prepare_by_platform, prepare_fx, "
            "prepare_qat_fx or convert_fx"
        )
    rows = [(d.node, d.op, "quantized" if d.quantized else "float", d.reason) for d in decisions.values()]
    widths = [max(len(row[i]) for row in [("node", "op", "status", "why"), *rows]) for i in range(3)]
    lines = [f"{'node':<{widths[0]}}  {'op':<{widths[1]}} {'status':<{widths[2]}}  why"]
    lines += [f"{n:<{widths[0]}}  {o:<{widths[1]}} {s:<{widths[2]}}  {r}" for n, o, s, r in rows]
    count = sum(d.quantized for d in decisions.values())
    lines.append(f"{count} of {len(decisions)} ops quantized")
    if getattr(model, CAPTURE_ATTRIBUTE, None) == "export":  # prepare_by_platform records how it captured
        lines.append("captured with torch.export")
    return "\n".join(lines)
