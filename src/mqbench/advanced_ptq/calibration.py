"""Post-training calibration as MQBench runs it before reconstruction, with the backend's outlier recipe."""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from mqbench.advanced_ptq.reconstruction import calibration_batches, call_with
from mqbench.advanced_ptq.smoothing import smooth_quant
from mqbench.backends.registry import ParamsTable
from mqbench.custom_quantizer.plan import plan_of
from mqbench.utils.state import enable_calibration_woquantization, enable_quantization

__all__ = ["calibrate"]


def _backend_smooths(model: fx.GraphModule) -> bool:
    plan = plan_of(model)
    spec = ParamsTable.get(plan.backend) if plan is not None else None
    return bool(spec is not None and spec.smooth_linear_inputs)


@torch.no_grad()
def calibrate(model: fx.GraphModule, cali_data: Any, smooth: bool | None = None) -> fx.GraphModule:
    """MQBench's calibration before reconstruction; returns ``model`` in quantization mode.

    The activation quantizers observe every batch while nothing is quantized, then the weight
    quantizers observe the weights (one batch runs them), then every quantizer quantizes.
    ``smooth``: first migrate activation outliers of linear inputs into the weights
    (:func:`~mqbench.advanced_ptq.smooth_quant`, strength searched); None does what the backend
    the model was prepared for does by default (its ``smooth_linear_inputs``: the NLP backends).
    """
    batches = calibration_batches(cali_data)
    if smooth is None:
        smooth = _backend_smooths(model)
    if smooth:
        smooth_quant(model, batches)
    enable_calibration_woquantization(model, quantizer_type="act_fake_quant")
    for batch in batches:
        call_with(model, batch)
    enable_calibration_woquantization(model, quantizer_type="weight_fake_quant")
    call_with(model, batches[0])
    enable_quantization(model)
    return model
