"""MQBench's mixed-precision functions under its module path, on this package's implementation.

``mixprecision_profiling`` and the Hessian measures are :mod:`mqbench.mix_precision`'s own;
``mixprecision_bit_selection`` / ``ILP_bit_selection`` choose one width per layer by an integer
program (:func:`scipy.optimize.milp`), as MQBench's ILP does. For the whole search on a model
(sensitivities, widths of weights and activations, a size or BitOps budget, a deployable
configuration) use :func:`mqbench.mix_precision.search_mixed_precision`.

Example:
    >>> from mqbench.mix_precision.mix_precision import mixprecision_bit_selection
    >>> cost = {"a": {4: 1.0, 8: 0.1}, "b": {4: 0.2, 8: 0.1}}
    >>> mixprecision_bit_selection([4, 8], cost, {"a": 1_000_000, "b": 1_000_000}, model_size_constraints=1.5)
    {'a': 8, 'b': 4}
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import numpy as np
import torch
from scipy.optimize import Bounds, LinearConstraint, milp
from torch import Tensor, nn

from mqbench.mix_precision import hessian_eigenvalues, hessian_traces, mixprecision_profiling

__all__ = [
    "ILP_bit_selection",
    "hawq",
    "mixprecision_bit_selection",
    "mixprecision_profiling",
    "model_size_analysis",
    "mp_model_size",
    "prec_degradation_by_layer",
]

_MB = 1024 * 1024


def _weighted_layers(model: nn.Module) -> dict[str, nn.Module]:
    return {name: m for name, m in model.named_modules() if isinstance(getattr(m, "weight", None), torch.Tensor)}


def model_size_analysis(model: nn.Module) -> dict[str, int]:
    """The number of weights of each conv / linear layer (what a width choice multiplies)."""
    kinds = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d, nn.Linear)
    return {name: int(m.weight.numel()) for name, m in model.named_modules() if isinstance(m, kinds)}


def mp_model_size(model: nn.Module) -> float:
    """The size of the model's weights in MB: each layer at its weight quantizer's width, 32 bits without one."""
    bits = 0
    for module in _weighted_layers(model).values():
        quantizer = getattr(module, "weight_fake_quant", None)
        width = quantizer.bitwidth if quantizer is not None and bool(quantizer.fake_quant_enabled[0]) else 32
        bits += int(cast(Tensor, module.weight).numel()) * width
    return bits / 8 / _MB


def prec_degradation_by_layer(
    model: nn.Module, quantized_model: nn.Module, data: tuple[Any, Any], criterion: Callable[..., torch.Tensor]
) -> dict[str, float]:
    """Per layer, the loss with only that layer's weights quantized minus the float model's loss."""
    inputs, targets = data
    with torch.no_grad():
        base = float(criterion(model(inputs), targets))
    scores = mixprecision_profiling(model, quantized_model, data, criterion, algo="naive")
    return {name: value - base for name, value in scores.items()}


def hawq(model: nn.Module, data: tuple[Any, Any], criterion: Callable[..., torch.Tensor], type: str = "trace") -> dict:
    """The loss Hessian's trace (``type="trace"``) or largest eigenvalue (``"eigenvalues"``) per layer."""
    inputs, targets = data
    if type == "trace":
        return hessian_traces(model, inputs, targets, criterion)
    if type == "eigenvalues":
        return hessian_eigenvalues(model, inputs, targets, criterion)
    raise ValueError(f"hawq type must be 'trace' or 'eigenvalues', got {type!r}")


def mixprecision_bit_selection(
    bitwidth_list: Sequence[int],
    sensetive_dict: Mapping[str, Mapping[int, float]],
    layer_parameters_dict: Mapping[str, int],
    model_size_constraints: float | None = None,
    latency_constraints: float | None = None,
) -> dict[str, int]:
    """One width per layer minimising the summed cost, within ``model_size_constraints`` MB of weights.

    ``sensetive_dict[layer][bits]`` is the cost of that layer at that width (e.g. its loss
    increase, or a Hessian trace times the weight perturbation); ``layer_parameters_dict[layer]``
    its number of weights (:func:`model_size_analysis`). Raises ValueError when no choice fits.
    """
    if latency_constraints is not None:
        raise ValueError(
            "latency_constraints has no model here; give a BitOps budget to "
            "mqbench.mix_precision.search_mixed_precision(..., budget={'bitops': ...}) instead"
        )
    layers = list(sensetive_dict)
    missing = [layer for layer in layers if layer not in layer_parameters_dict]
    if missing:
        raise ValueError(f"layer_parameters_dict has no parameter count for {missing}")
    choices = [(layer, int(b)) for layer in layers for b in bitwidth_list]
    for layer, b in choices:
        if b not in sensetive_dict[layer]:
            raise ValueError(
                f"sensetive_dict[{layer!r}] has no cost for {b} bits; it has {sorted(sensetive_dict[layer])}"
            )
    cost = np.array([float(sensetive_dict[layer][b]) for layer, b in choices])
    one_each = np.array([[1.0 if layer == row else 0.0 for layer, _ in choices] for row in layers])
    constraints = [LinearConstraint(one_each, 1, 1)]
    if model_size_constraints is not None:
        size = np.array([layer_parameters_dict[layer] * b / 8 / _MB for layer, b in choices])
        constraints.append(LinearConstraint(size[None, :], -np.inf, float(model_size_constraints)))
    result = milp(cost, integrality=np.ones(len(choices)), bounds=Bounds(0, 1), constraints=constraints)
    if result.x is None:
        raise ValueError(f"no choice of widths {list(bitwidth_list)} fits {model_size_constraints} MB")
    return {layer: b for (layer, b), x in zip(choices, result.x, strict=True) if x > 0.5}


ILP_bit_selection = mixprecision_bit_selection  # MQBench's name for the same integer program
