"""Mixed precision: a bit width per layer under a model-size or BitOps budget, by an integer program.

1. The model is prepared for the backend at its own widths and calibrated.
2. Each weighted layer's weight quantizer, and each activation quantizer that feeds weighted
   layers, is tried alone at every candidate width (everything else in float): its
   *sensitivity* is the relative squared error it causes in the model's output,
   ``sum ||F(x) - F_q(x)||^2 / sum ||F(x)||^2`` over the calibration batches.
3. :func:`scipy.optimize.milp` picks one width per weight quantizer and one per activation
   quantizer (layers reading one activation quantizer share its width) minimising the summed
   sensitivity, subject to ``size_bytes`` (the quantized weights: ``sum params x bits / 8``)
   and/or ``bitops`` (``sum MACs x weight bits x input bits``, a float input counting 32 bits).
   On backends that keep the first and last layer at 8 bits, those stay at the backend's widths.

The result's ``config`` is a ``prepare_custom_config_dict`` (``quantizer_bits``) that
:func:`~mqbench.prepare_by_platform.prepare_by_platform` accepts, so the mixed model is calibrated,
deployed and verified like any other. Only backends whose spec lists ``mixed_precision_bits``
take widths other than their own.

:func:`mixprecision_profiling` is MQBench's per-layer sensitivity call (``naive``: the loss with
one layer's weights quantized; ``hawq``: the largest eigenvalue of the loss Hessian per layer;
``hawq_trace``: its trace, Hutchinson's estimator).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch
from scipy.optimize import Bounds, LinearConstraint, milp
from torch import Tensor, fx, nn
from tqdm.auto import tqdm

from mqbench.advanced_ptq import calibrate
from mqbench.advanced_ptq.reconstruction import call_with
from mqbench.backends import resolve_backend
from mqbench.custom_quantizer.bits import set_quantizer_bits
from mqbench.functional import bits_of_range
from mqbench.prepare_by_platform import prepare_by_platform
from mqbench.utils.logger import logger
from mqbench.utils.state import all_switched_off, disable_all, is_quantizer, quantizers

__all__ = [
    "MixedPrecisionResult",
    "WeightedLayer",
    "hessian_eigenvalues",
    "hessian_traces",
    "layer_sensitivity",
    "mixprecision_profiling",
    "search_mixed_precision",
    "solve_bit_allocation",
]

FLOAT_BITS = 32  # a layer input no quantizer reads counts at float32 in BitOps


@dataclass(frozen=True)
class WeightedLayer:
    """A weighted layer of the prepared model, with what the budget and the constraints need."""

    name: str
    weight: str  # its weight quantizer
    activation: str | None  # the quantizer whose output it reads (None: a float input)
    params: int
    macs: int
    fixed: bool  # kept at the backend's widths (first / last layer)
    weight_bits: int  # the backend's width
    activation_bits: int | None


@dataclass
class MixedPrecisionResult:
    """The chosen widths; ``config`` prepares the mixed model (see the module docstring)."""

    config: dict[str, Any]
    bits: dict[str, tuple[int, int | None]]  # layer -> (weight bits, input activation bits)
    quantizer_bits: dict[str, int]
    size_bytes: float
    bitops: float
    objective: float
    layers: list[WeightedLayer]
    sensitivity: dict[str, dict[int, float]]  # quantizer -> width -> sensitivity
    accuracy: float | None = None
    pareto: list[dict[str, Any]] = field(default_factory=list)


# -- the layers -----------------------------------------------------------------------------------
def _input_quantizer(node: fx.Node, modules: Mapping[str, nn.Module]) -> str | None:
    """The quantizer whose output ``node`` reads, through shape-only calls (flatten, reshape, view)."""
    current = node.args[0] if node.args else None
    for _ in range(4):
        if not isinstance(current, fx.Node):
            return None
        if current.op == "call_module" and is_quantizer(modules[str(current.target)]):
            return str(current.target)
        name = getattr(current.target, "__name__", str(current.target))
        if current.op in ("call_function", "call_method") and name in ("flatten", "reshape", "view", "contiguous"):
            current = current.args[0] if current.args else None
            continue
        return None
    return None


def find_weighted_layers(prepared: fx.GraphModule, sample: Any, first_last_fixed: bool) -> list[WeightedLayer]:
    """Every module with a weight quantizer, in graph order, with its parameters and MACs for one sample."""
    modules = dict(prepared.named_modules())
    nodes = [
        node
        for node in prepared.graph.nodes
        if node.op == "call_module" and _weight_quantizer(modules[str(node.target)]) is not None
    ]
    macs: dict[str, int] = {}
    handles = []
    for node in nodes:
        name = str(node.target)

        def hook(module: Any, args: Any, output: Any, name: str = name) -> None:
            out = output[0] if isinstance(output, (tuple, list)) else output
            weight = module.weight
            if isinstance(module, nn.modules.conv._ConvTransposeNd):
                positions = args[0][:1].numel() // max(int(args[0].shape[1]), 1)
            else:
                channels = int(weight.shape[0])
                positions = out[:1].numel() // max(channels, 1)
            macs[name] = int(positions * weight.numel())

        handles.append(modules[name].register_forward_hook(hook))
    try:
        with all_switched_off(prepared), torch.no_grad():
            call_with(prepared, _first_sample(sample))
    finally:
        for handle in handles:
            handle.remove()
    layers = []
    for index, node in enumerate(nodes):
        name = str(node.target)
        module = modules[name]
        activation = _input_quantizer(node, modules)
        weight_quantizer = module.weight_fake_quant
        act_bits = None
        if activation is not None:
            act = modules[activation]
            act_bits = bits_of_range(int(act.quant_min), int(act.quant_max))
        layers.append(
            WeightedLayer(
                name=name,
                weight=f"{name}.weight_fake_quant",
                activation=activation,
                params=int(module.weight.numel()),
                macs=macs.get(name, 0),
                fixed=first_last_fixed and index in (0, len(nodes) - 1),
                weight_bits=bits_of_range(int(weight_quantizer.quant_min), int(weight_quantizer.quant_max)),
                activation_bits=act_bits,
            )
        )
    return layers


def _weight_quantizer(module: nn.Module) -> Any:
    quantizer = getattr(module, "weight_fake_quant", None)
    return quantizer if isinstance(quantizer, nn.Module) and is_quantizer(quantizer) else None


def _first_sample(batch: Any) -> Any:
    if isinstance(batch, Tensor):
        return batch[:1]
    if isinstance(batch, (tuple, list)):
        return type(batch)(item[:1] if isinstance(item, Tensor) else item for item in batch)
    return batch


# -- the integer program --------------------------------------------------------------------------
def solve_bit_allocation(
    layers: Sequence[WeightedLayer],
    sensitivity: Mapping[str, Mapping[int, float]],
    weight_bits: Sequence[int],
    activation_bits: Sequence[int],
    size_bytes: float | None = None,
    bitops: float | None = None,
) -> dict[str, int] | None:
    """The widths (quantizer -> bits) minimising the summed sensitivity within the budget; None if none fits.

    One binary variable per (weight quantizer, width) and per (activation quantizer, width); with a
    BitOps budget, one per (layer, weight width, input width) for the products, tied to the two
    choices it combines (``z <= x``, ``z <= y``, one product per layer).
    """
    fixed_weight = {layer.weight: layer.weight_bits for layer in layers if layer.fixed}
    fixed_activation = {
        layer.activation: int(layer.activation_bits or 8) for layer in layers if layer.fixed and layer.activation
    }
    weights = list(dict.fromkeys(layer.weight for layer in layers))
    activations = list(dict.fromkeys(layer.activation for layer in layers if layer.activation is not None))
    choices: list[tuple[str, int]] = []  # (quantizer, bits) per variable, weights then activations
    for name in weights:
        choices += [(name, bits) for bits in ((fixed_weight[name],) if name in fixed_weight else weight_bits)]
    for name in activations:
        options = (fixed_activation[name],) if name in fixed_activation else activation_bits
        choices += [(name, bits) for bits in options]
    index = {choice: i for i, choice in enumerate(choices)}
    products: list[tuple[WeightedLayer, int, int | None]] = []
    if bitops is not None:
        for layer in layers:
            w_options = [b for (q, b) in choices if q == layer.weight]
            a_options: list[int | None] = (
                [b for (q, b) in choices if q == layer.activation] if layer.activation is not None else [None]
            )
            products += [(layer, w, a) for w in w_options for a in a_options]
    count = len(choices) + len(products)
    cost = np.zeros(count)
    for i, (name, bits) in enumerate(choices):
        cost[i] = float(sensitivity.get(name, {}).get(bits, 0.0))
    rows: list[np.ndarray] = []
    lower: list[float] = []
    upper: list[float] = []

    def constraint(row: np.ndarray, low: float, high: float) -> None:
        rows.append(row)
        lower.append(low)
        upper.append(high)

    for name in weights + activations:  # one width per quantizer
        row = np.zeros(count)
        for i, (quantizer, _) in enumerate(choices):
            row[i] = 1.0 if quantizer == name else 0.0
        constraint(row, 1.0, 1.0)
    if size_bytes is not None:
        row = np.zeros(count)
        params = {layer.weight: layer.params for layer in layers}
        for i, (name, bits) in enumerate(choices):
            if name in params:
                row[i] = params[name] * bits / 8.0
        constraint(row, -np.inf, float(size_bytes))
    if bitops is not None:
        budget_row = np.zeros(count)
        by_layer: dict[str, list[int]] = {}
        for k, (layer, w, a) in enumerate(products):
            column = len(choices) + k
            budget_row[column] = layer.macs * w * (a if a is not None else FLOAT_BITS)
            by_layer.setdefault(layer.name, []).append(column)
            row = np.zeros(count)  # z <= x (the weight width)
            row[column], row[index[(layer.weight, w)]] = 1.0, -1.0
            constraint(row, -np.inf, 0.0)
            if a is not None:  # z <= y (the input width)
                row = np.zeros(count)
                row[column], row[index[(str(layer.activation), a)]] = 1.0, -1.0
                constraint(row, -np.inf, 0.0)
        for columns in by_layer.values():  # exactly one product per layer
            row = np.zeros(count)
            row[columns] = 1.0
            constraint(row, 1.0, 1.0)
        constraint(budget_row, -np.inf, float(bitops))
    solution = milp(
        cost,
        constraints=LinearConstraint(np.array(rows), np.array(lower), np.array(upper)),
        integrality=np.ones(count),
        bounds=Bounds(0, 1),
    )
    if solution.x is None:
        return None
    chosen = np.round(solution.x[: len(choices)]).astype(bool)
    return {name: bits for (name, bits), picked in zip(choices, chosen, strict=True) if picked}


def _size_and_bitops(layers: Sequence[WeightedLayer], widths: Mapping[str, int]) -> tuple[float, float]:
    size = sum(layer.params * widths[layer.weight] / 8.0 for layer in layers)
    ops = sum(
        layer.macs * widths[layer.weight] * (widths[layer.activation] if layer.activation else FLOAT_BITS)
        for layer in layers
    )
    return float(size), float(ops)


# -- sensitivity ----------------------------------------------------------------------------------
def _outputs(model: nn.Module, batches: Sequence[Any]) -> list[Tensor]:
    results = []
    with torch.no_grad():
        for batch in batches:
            out = call_with(model, batch)
            results.append((out[0] if isinstance(out, (tuple, list)) else out).detach().double())
    return results


def _sensitivities(
    prepared: nn.Module, batches: Sequence[Any], widths: Mapping[str, Sequence[int]], progress: bool = False
) -> dict[str, dict[int, float]]:
    """Relative output error with one quantizer alone at each width (everything else float)."""
    named = dict(quantizers(prepared))
    disable_all(prepared)
    reference = _outputs(prepared, batches)
    energy = sum(float(r.pow(2).sum()) for r in reference) or 1.0
    table: dict[str, dict[int, float]] = {}
    for name, options in tqdm(widths.items(), desc="sensitivity", unit="quantizer", disable=not progress, leave=False):
        quantizer: Any = named[name]
        own = bits_of_range(int(quantizer.quant_min), int(quantizer.quant_max))
        table[name] = {}
        try:
            for bits in options:
                set_quantizer_bits(quantizer, bits)
                quantizer.enable_fake_quant(True)
                quantized = _outputs(prepared, batches)
                error = sum(float((q - r).pow(2).sum()) for q, r in zip(quantized, reference, strict=True))
                quantizer.enable_fake_quant(False)
                table[name][bits] = error / energy
        finally:
            set_quantizer_bits(quantizer, own)
            quantizer.enable_fake_quant(False)
    return table


def _calibrated(model: nn.Module, backend: str, config: Mapping[str, Any], batches: Sequence[Any]) -> fx.GraphModule:
    return calibrate(prepare_by_platform(copy.deepcopy(model).eval(), backend, dict(config)), batches)


_CANDIDATE_FORM = '{"weight": (8, 4, 2), "activation": (8, 4)}'


def _candidate_bits(candidates: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The weight and activation widths of ``candidates``; a clear error for any other form."""
    if candidates is None or (isinstance(candidates, Mapping) and not candidates):
        return (8, 4, 2), (8, 4)
    if not isinstance(candidates, Mapping):
        raise TypeError(
            f"candidates must be a mapping of the widths to try per weight and per activation quantizer, such as "
            f"{_CANDIDATE_FORM}; got {type(candidates).__name__} {candidates!r}. Widths are searched per quantizer, "
            "not as (weight, activation) pairs: list each kind's widths under its key"
        )
    unknown = [key for key in candidates if key not in ("weight", "activation")]
    if unknown:
        raise ValueError(
            f"candidates takes the keys 'weight' and 'activation', not {', '.join(map(repr, unknown))}; "
            f"e.g. {_CANDIDATE_FORM}"
        )
    chosen = []
    for kind in ("weight", "activation"):
        bits = candidates.get(kind, (8,))
        valid = (
            isinstance(bits, Sequence)
            and not isinstance(bits, str)
            and bool(bits)
            and all(isinstance(b, int | np.integer) and not isinstance(b, bool) and 2 <= b <= 8 for b in bits)
        )
        if not valid:
            raise ValueError(f"candidates[{kind!r}] must be a non-empty list of bit widths from 2 to 8, got {bits!r}")
        chosen.append(tuple(int(b) for b in bits))
    return chosen[0], chosen[1]


def _budget(budget: Any) -> dict[str, float]:
    """``budget`` checked: a mapping of ``size_bytes`` and/or ``bitops`` to positive numbers (None: no budget)."""
    if budget is None:
        return {}
    if not isinstance(budget, Mapping):
        raise ValueError(
            f"budget is a mapping such as {{'size_bytes': {budget!r}}} or {{'bitops': N}}, not "
            f"{type(budget).__name__} {budget!r}"
        )
    unknown = set(budget) - {"size_bytes", "bitops"}
    if unknown:
        raise ValueError(f"budget takes 'size_bytes' and/or 'bitops', not {', '.join(sorted(map(str, unknown)))}")
    for key, value in budget.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"budget {key!r} must be a positive number, got {value!r}")
    return dict(budget)


def search_mixed_precision(
    model: nn.Module,
    backend: str,
    cali_data: Iterable[Any],
    eval_fn: Callable[[nn.Module], float] | None = None,
    candidates: Mapping[str, Sequence[int]] | None = None,
    budget: Mapping[str, float] | None = None,
    prepare_custom_config_dict: Mapping[str, Any] | None = None,
    pareto: Sequence[Mapping[str, float]] | None = None,
    progress: bool = False,
) -> MixedPrecisionResult:
    """Per-layer widths for ``model`` on ``backend`` within ``budget`` (see the module docstring).

    ``candidates``: ``{"weight": (8, 4, 2), "activation": (8, 4)}`` (the default). ``budget``:
    ``{"size_bytes": N}`` and/or ``{"bitops": N}``; without one, every quantizer takes its
    least sensitive width. ``eval_fn(prepared_model) -> float`` (e.g. accuracy), when given, is
    measured on the chosen configuration calibrated on ``cali_data``, and on each point of
    ``pareto`` (a list of budgets), whose rows land in ``result.pareto``. The cost is one forward pass
    of ``cali_data`` per (quantizer, candidate width), with a progress bar when ``progress``.
    """
    spec = resolve_backend(backend)
    weight_bits, activation_bits = _candidate_bits(candidates)
    refused = sorted(set(weight_bits + activation_bits) - set(spec.mixed_precision_bits) - {8})
    if refused:
        allowed = ", ".join(map(str, spec.mixed_precision_bits)) or "none besides its own"
        raise ValueError(
            f"backend {spec.name!r} does not deploy {', '.join(map(str, refused))}-bit quantizers (mixed-precision "
            f"widths: {allowed}); search on a backend that lists them, such as academic"
        )
    budget = _budget(budget)
    batches = list(cali_data)
    if not batches:
        raise ValueError("search_mixed_precision needs at least one calibration batch")
    base = dict(prepare_custom_config_dict or {})
    base.pop("quantizer_bits", None)
    prepared = _calibrated(model, backend, base, batches)
    layers = find_weighted_layers(prepared, batches[0], spec.placement.first_last_8bit)
    widths: dict[str, Sequence[int]] = {}
    for layer in layers:
        if not layer.fixed:
            widths[layer.weight] = weight_bits
            if layer.activation is not None:
                widths.setdefault(layer.activation, activation_bits)
    fixed_activations = {layer.activation for layer in layers if layer.fixed and layer.activation}
    for name in fixed_activations:
        widths.pop(name, None)
    logger.info(f"mixed precision: sensitivity of {len(widths)} quantizers at {weight_bits} / {activation_bits} bits")
    sensitivity = _sensitivities(prepared, batches, widths, progress)

    def choose(limits: Mapping[str, float]) -> tuple[dict[str, int], float] | None:
        chosen = solve_bit_allocation(
            layers, sensitivity, weight_bits, activation_bits, limits.get("size_bytes"), limits.get("bitops")
        )
        if chosen is None:
            return None
        return chosen, sum(sensitivity.get(name, {}).get(bits, 0.0) for name, bits in chosen.items())

    def build(chosen: Mapping[str, int], objective: float) -> MixedPrecisionResult:
        size, ops = _size_and_bitops(layers, chosen)
        changes = {name: bits for name, bits in chosen.items() if name in widths}
        config = {**base, "quantizer_bits": changes}
        bits = {
            layer.name: (chosen[layer.weight], chosen.get(layer.activation) if layer.activation else None)
            for layer in layers
        }
        accuracy = None
        if eval_fn is not None:
            accuracy = float(eval_fn(_calibrated(model, backend, config, batches)))
        return MixedPrecisionResult(config, bits, changes, size, ops, objective, list(layers), sensitivity, accuracy)

    found = choose(budget)
    if found is None:
        smallest = _size_and_bitops(layers, {**{n: min(o) for n, o in widths.items()}, **_fixed_widths(layers)})
        raise ValueError(
            f"no choice of widths fits the budget {budget}; the smallest reachable is {smallest[0]:.0f} bytes and "
            f"{smallest[1]:.3g} BitOps"
        )
    result = build(*found)
    for limits in pareto or ():
        point = choose(limits)
        if point is None:
            result.pareto.append({"budget": dict(limits), "feasible": False})
            continue
        row = build(*point)
        result.pareto.append(
            {
                "budget": dict(limits),
                "feasible": True,
                "size_bytes": row.size_bytes,
                "bitops": row.bitops,
                "objective": row.objective,
                "accuracy": row.accuracy,
                "quantizer_bits": row.quantizer_bits,
            }
        )
    return result


def _fixed_widths(layers: Sequence[WeightedLayer]) -> dict[str, int]:
    widths = {layer.weight: layer.weight_bits for layer in layers if layer.fixed}
    for layer in layers:
        if layer.fixed and layer.activation:
            widths[layer.activation] = int(layer.activation_bits or 8)
    return widths


# -- MQBench's profiling call ---------------------------------------------------------------------
def mixprecision_profiling(
    model: nn.Module, quantized_model: nn.Module | None, data: tuple[Any, Any], criterion: Callable, algo: str = "hawq"
) -> dict[str, float]:
    """MQBench's per-layer sensitivity: ``naive`` or ``hawq`` (see the module docstring).

    ``data`` is ``(inputs, targets)``. ``naive`` needs ``quantized_model`` (prepared, calibrated) and
    returns, per weighted layer, the loss with only its weights quantized; ``hawq`` returns, as
    MQBench's does, the largest eigenvalue of the loss Hessian over each layer's weight of the float
    ``model`` (power iteration); ``hawq_trace`` its trace (Hutchinson's estimator, 32 probes).
    """
    inputs, targets = data
    if algo == "naive":
        if quantized_model is None:
            raise ValueError("algo='naive' needs the prepared, calibrated quantized_model")
        scores: dict[str, float] = {}
        with all_switched_off(quantized_model), torch.no_grad():
            for name, module in quantized_model.named_modules():
                quantizer = _weight_quantizer(module)
                if quantizer is None:
                    continue
                quantizer.enable_fake_quant(True)
                scores[name] = float(criterion(quantized_model(inputs), targets))
                quantizer.enable_fake_quant(False)
                logger.info(f"layer {name}: loss {scores[name]:.6g} with its weights quantized")
        return scores
    if algo == "hawq":
        return hessian_eigenvalues(model, inputs, targets, criterion)
    if algo == "hawq_trace":
        return hessian_traces(model, inputs, targets, criterion)
    raise ValueError(f"unknown algo {algo!r}; use 'naive', 'hawq' or 'hawq_trace'")


def _conv_and_linear(model: nn.Module) -> dict[str, nn.Module]:
    layers: dict[str, nn.Module] = {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear, nn.ConvTranspose2d))
    }
    if not layers:
        raise ValueError("the model has no conv or linear weight")
    return layers


def hessian_eigenvalues(
    model: nn.Module, inputs: Any, targets: Any, criterion: Callable, iterations: int = 100, tolerance: float = 1e-6
) -> dict[str, float]:
    """The largest eigenvalue of the loss Hessian over each conv/linear weight (its diagonal block).

    Power iteration on Hessian-vector products, all layers at once, until every layer's Rayleigh
    quotient changes by less than ``tolerance`` (relative) or after ``iterations`` steps.
    """
    layers = _conv_and_linear(model)
    params: list[Tensor] = [cast(Tensor, module.weight) for module in layers.values()]
    was_training = model.training
    model.eval()
    generator = torch.Generator().manual_seed(0)
    try:
        grads = torch.autograd.grad(criterion(call_with(model, inputs), targets), params, create_graph=True)
        vectors = [torch.randn(p.shape, generator=generator).to(p) for p in params]
        vectors = [v / v.norm() for v in vectors]
        values = [0.0] * len(params)
        for _ in range(iterations):
            products = torch.autograd.grad(grads, params, grad_outputs=vectors, retain_graph=True)
            new = [float((v * hv).sum()) for v, hv in zip(vectors, products, strict=True)]
            converged = all(abs(a - b) <= tolerance * max(abs(a), 1e-30) for a, b in zip(new, values, strict=True))
            values = new
            vectors = [hv / hv.norm().clamp_min(1e-30) for hv in products]
            if converged:
                break
    finally:
        model.train(was_training)
    result = dict(zip(layers, values, strict=True))
    for name, value in result.items():
        logger.info(f"layer {name}: largest Hessian eigenvalue {value:.6g}")
    return result


def hessian_traces(
    model: nn.Module, inputs: Any, targets: Any, criterion: Callable, probes: int = 32
) -> dict[str, float]:
    """Hutchinson's estimate of the trace of the loss Hessian over each conv/linear weight.

    ``E[v^T H v]`` over Rademacher vectors ``v``, one Hessian-vector product per probe for all layers
    at once (the cross-layer terms vanish in expectation).
    """
    layers = _conv_and_linear(model)
    was_training = model.training
    model.eval()
    try:
        traces = _layer_traces(model, layers, inputs, targets, criterion, probes)
    finally:
        model.train(was_training)
    for name, trace in traces.items():
        logger.info(f"layer {name}: Hessian trace {trace:.6g}")
    if not all(math.isfinite(t) for t in traces.values()):
        raise FloatingPointError("the Hessian trace is not finite; check the loss")
    return traces


# -- per-layer sensitivity scores -----------------------------------------------------------------
SENSITIVITY_METHODS = ("loss", "hessian", "fisher", "taylor")


def layer_sensitivity(
    prepared: nn.Module,
    data: Iterable[tuple[Any, Any]],
    loss_fn: Callable[[Any, Any], Tensor],
    method: str = "loss",
    bits: int | None = None,
    probes: int = 16,
    progress: bool = False,
) -> dict[str, float]:
    """How much each weighted layer's weight quantization costs, per layer of a prepared, calibrated model.

    ``data`` yields ``(inputs, targets)``; ``loss_fn(output, targets)`` is the task loss. With
    ``d = Q(w) - w`` the layer's weight quantization error (at ``bits`` when given, else the
    quantizer's own width) and ``g`` the float model's loss gradient:

    * ``loss``: the loss with only that layer's weights quantized minus the float loss (measured);
    * ``hessian``: ``trace(H) / n * ||d||^2`` (HAWQ; Hutchinson's trace, ``probes`` probes);
    * ``fisher``: ``sum(g^2 d^2)`` per batch, averaged (the empirical diagonal Fisher);
    * ``taylor``: ``|sum(g d)|`` averaged over batches (the first-order change of the loss).

    Computed on the model as prepared (its own weights; a training-mode BatchNorm fold is not
    applied). The quantizer switches and widths are left as they were.
    """
    if method not in SENSITIVITY_METHODS:
        raise ValueError(f"unknown sensitivity method {method!r}; use one of {', '.join(SENSITIVITY_METHODS)}")
    batches = list(data)
    if not batches:
        raise ValueError("layer_sensitivity needs at least one (inputs, targets) batch")
    modules = dict(prepared.named_modules())
    layers = {name: m for name, m in modules.items() if _weight_quantizer(m) is not None}
    own = {
        name: bits_of_range(int(m.weight_fake_quant.quant_min), int(m.weight_fake_quant.quant_max))
        for name, m in layers.items()
    }
    was_training = prepared.training
    prepared.eval()
    scores: dict[str, float] = {}
    try:
        with all_switched_off(prepared):
            errors: dict[str, Tensor] = {}
            for name, module in layers.items():
                quantizer: Any = module.weight_fake_quant
                if bits is not None:
                    set_quantizer_bits(quantizer, bits)
                quantizer.enable_fake_quant(True)
                with torch.no_grad():
                    errors[name] = (quantizer(module.weight) - module.weight).detach()
                quantizer.enable_fake_quant(False)
            iterator: Iterable[Any] = tqdm(layers, desc=f"sensitivity ({method})", leave=False) if progress else layers
            if method == "loss":
                with torch.no_grad():
                    base = [float(loss_fn(call_with(prepared, x), y)) for x, y in batches]
                    for name in iterator:
                        quantizer = layers[name].weight_fake_quant
                        quantizer.enable_fake_quant(True)
                        losses = [float(loss_fn(call_with(prepared, x), y)) for x, y in batches]
                        quantizer.enable_fake_quant(False)
                        scores[name] = sum(q - b for q, b in zip(losses, base, strict=True)) / len(batches)
            elif method == "hessian":
                totals = dict.fromkeys(layers, 0.0)
                for x, y in batches:
                    traces = _layer_traces(prepared, layers, x, y, loss_fn, probes)
                    for name in layers:
                        totals[name] += traces[name]
                for name in iterator:
                    weight = layers[name].weight
                    trace = totals[name] / len(batches)
                    scores[name] = trace / weight.numel() * float(errors[name].pow(2).sum())
            else:
                sums = dict.fromkeys(layers, 0.0)
                for x, y in batches:
                    params = [layers[name].weight for name in layers]
                    grads = torch.autograd.grad(loss_fn(call_with(prepared, x), y), params)
                    for name, grad in zip(layers, grads, strict=True):
                        if method == "fisher":
                            sums[name] += float((grad.pow(2) * errors[name].pow(2)).sum())
                        else:
                            sums[name] += abs(float((grad * errors[name]).sum()))
                scores = {name: sums[name] / len(batches) for name in iterator}
    finally:
        for name, module in layers.items():
            set_quantizer_bits(module.weight_fake_quant, own[name])
        prepared.train(was_training)
    return scores


def _layer_traces(
    model: nn.Module, layers: Mapping[str, nn.Module], inputs: Any, targets: Any, loss_fn: Callable, probes: int
) -> dict[str, float]:
    params: list[Tensor] = [cast(Tensor, module.weight) for module in layers.values()]
    generator = torch.Generator().manual_seed(0)
    loss = loss_fn(call_with(model, inputs), targets)
    grads = torch.autograd.grad(loss, params, create_graph=True)
    totals = dict.fromkeys(layers, 0.0)
    for _ in range(probes):
        vectors = [(torch.randint(0, 2, p.shape, generator=generator) * 2 - 1).to(p) for p in params]
        products = torch.autograd.grad(grads, params, grad_outputs=vectors, retain_graph=True)
        for name, v, hv in zip(layers, vectors, products, strict=True):
            totals[name] += float((v * hv).sum())
    return {name: total / probes for name, total in totals.items()}
