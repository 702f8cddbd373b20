"""Reconstruction PTQ (AdaRound, BRECQ, QDrop) on a prepared, calibrated model, unit by unit.

For each unit (:mod:`mqbench.advanced_ptq.units`), in graph order:

1. cache, for every calibration batch, the unit's inputs as the quantized model computes them
   (every earlier unit already reconstructed), the same inputs in the float model, and the
   float model's outputs of the unit (the target);
2. start learned rounding on the unit's :class:`~mqbench.fake_quantize.AdaRoundFakeQuantize`
   weight quantizers and learn the scales of its learnable activation quantizers; QDrop: each
   activation quantizer keeps an element float with probability ``1 - prob``, and the unit reads
   the quantized model's input element-wise with probability ``prob``, the float one otherwise;
3. ``max_count`` iterations of Adam on ``||unit(x) - target||^2`` (summed over features, mean
   over the batch) plus ``weight`` times the rounding regulariser, whose exponent ``b`` stays at
   ``b_range[0]`` for the first ``warm_up`` fraction (the regulariser is off then) and falls
   linearly to ``b_range[1]``;
4. make the rounding hard: the weight takes its rounded grid values, the quantizer rounds to
   nearest again (which now changes nothing), ``prob`` goes back to 1.

The result is an ordinary prepared model in quantization mode: it saves, loads, deploys and
verifies like any other.

Which method is which is a matter of configuration, as in MQBench: AdaRound is
``pattern: layer`` with ``prob: 1.0``; BRECQ ``pattern: block``; QDrop ``pattern: block`` with
``prob: 0.5`` and QDropFakeQuantize activations.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, fx, nn
from tqdm import tqdm

from mqbench.advanced_ptq.units import PATTERNS, Unit, find_units
from mqbench.custom_quantizer.passes import eliminate_dead_code
from mqbench.fake_quantize.adaround import ROUND_MODES, AdaRoundFakeQuantize
from mqbench.fake_quantize.lsq import LearnableFakeQuantize
from mqbench.fake_quantize.qdrop import QDropFakeQuantize, keep_mask
from mqbench.fake_quantize.quantize_base import QuantizeBase
from mqbench.utils.logger import logger
from mqbench.utils.state import disable_all, enable_quantization

__all__ = [
    "CONFIG_DEFAULTS",
    "LinearTempDecay",
    "ReconstructionConfig",
    "UnitCache",
    "UnitReconstruction",
    "calibration_batches",
    "call_with",
    "float_copy",
    "model_up_to",
    "ptq_reconstruction",
]

# MQBench's reconstruction keys and their defaults (application/imagenet_example/PTQ configs),
# plus mqbench's own: batch_size, memory_budget_mb, seed, progress.
CONFIG_DEFAULTS: Mapping[str, Any] = {
    "pattern": "block",
    "scale_lr": 4.0e-5,
    "warm_up": 0.2,
    "weight": 0.01,
    "max_count": 20000,
    "b_range": (20, 2),
    "keep_gpu": True,
    "round_mode": "learned_hard_sigmoid",
    "prob": 1.0,
    "exclude_node": (),
    "memory_budget_mb": 1024,
    "seed": 0,
    "progress": True,
}
_ALIASES = {"exclude_node_prefix": "exclude_node"}  # MQBench checks one name and reads the other


@dataclass(frozen=True)
class ReconstructionConfig:
    """The validated reconstruction settings (see :data:`CONFIG_DEFAULTS` for the keys)."""

    pattern: str
    scale_lr: float
    warm_up: float
    weight: float
    max_count: int
    b_range: tuple[float, float]
    keep_gpu: bool
    round_mode: str
    prob: float
    exclude_node: tuple[str, ...]
    memory_budget_mb: float
    seed: int
    progress: bool

    @classmethod
    def from_mapping(cls, config: Any) -> ReconstructionConfig:
        """From a dict or an attribute-style dict (MQBench's EasyDict); unknown keys are an error."""
        given = dict(config.items()) if hasattr(config, "items") else dict(vars(config))
        given = {_ALIASES.get(key, key): value for key, value in given.items()}
        unknown = sorted(set(given) - set(CONFIG_DEFAULTS))
        if unknown:
            raise ValueError(
                f"unknown reconstruction config key(s) {unknown}; valid keys: {', '.join(sorted(CONFIG_DEFAULTS))}"
            )
        values = {**CONFIG_DEFAULTS, **given}
        if values["pattern"] not in PATTERNS:
            raise ValueError(f"reconstruction pattern must be one of {PATTERNS}, got {values['pattern']!r}")
        if values["round_mode"] not in ROUND_MODES:
            raise ValueError(f"round_mode must be one of {ROUND_MODES}, got {values['round_mode']!r}")
        b_range = tuple(float(b) for b in values["b_range"])
        if len(b_range) != 2 or not b_range[0] >= b_range[1] > 0:
            raise ValueError(f"b_range is [start, end] with start >= end > 0, got {values['b_range']!r}")
        if not 0.0 <= float(values["warm_up"]) < 1.0:
            raise ValueError(f"warm_up is a fraction of max_count in [0, 1), got {values['warm_up']!r}")
        if not 0.0 < float(values["prob"]) <= 1.0:
            raise ValueError(f"prob (the probability of quantizing) must be in (0, 1], got {values['prob']!r}")
        if int(values["max_count"]) < 1:
            raise ValueError(f"max_count must be a positive number of iterations, got {values['max_count']!r}")
        exclude = values["exclude_node"] or ()
        return cls(
            pattern=str(values["pattern"]),
            scale_lr=float(values["scale_lr"]),
            warm_up=float(values["warm_up"]),
            weight=float(values["weight"]),
            max_count=int(values["max_count"]),
            b_range=(b_range[0], b_range[1]),
            keep_gpu=bool(values["keep_gpu"]),
            round_mode=str(values["round_mode"]),
            prob=float(values["prob"]),
            exclude_node=tuple(exclude if not isinstance(exclude, str) else (exclude,)),
            memory_budget_mb=float(values["memory_budget_mb"]),
            seed=int(values["seed"]),
            progress=bool(values["progress"]),
        )


class LinearTempDecay:
    """The regulariser's exponent: ``start_b`` until ``rel_start_decay * t_max``, then linear to ``end_b``."""

    def __init__(self, t_max: int, rel_start_decay: float = 0.2, start_b: float = 10.0, end_b: float = 2.0) -> None:
        self.t_max = t_max
        self.start_decay = rel_start_decay * t_max
        self.start_b = start_b
        self.end_b = end_b

    def __call__(self, t: int) -> float:
        if t < self.start_decay:
            return self.start_b
        rel_t = (t - self.start_decay) / (self.t_max - self.start_decay)
        return self.end_b + (self.start_b - self.end_b) * max(0.0, 1.0 - rel_t)


def _subgraph(
    model: fx.GraphModule, names: Sequence[str], inputs: Sequence[str], outputs: Sequence[str]
) -> fx.GraphModule:
    """The nodes ``names`` as a GraphModule on ``model``'s modules, reading ``inputs``, returning ``outputs``."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    by_name = {node.name: node for node in model.graph.nodes}
    for name in inputs:
        env[by_name[name]] = graph.placeholder(name)
    wanted = set(names)
    for node in model.graph.nodes:
        if node.name in wanted or (node.op == "get_attr" and any(u.name in wanted for u in node.users)):
            env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(tuple(env[by_name[name]] for name in outputs))
    return fx.GraphModule(model, graph)


def model_up_to(model: fx.GraphModule, wanted: Sequence[str]) -> fx.GraphModule:
    """``model`` up to the nodes ``wanted``, returning their values (the rest of the graph not run)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    remaining = set(wanted)
    by_name: dict[str, fx.Node] = {}
    for node in model.graph.nodes:
        if node.op == "output" or not remaining:
            break
        env[node] = graph.node_copy(node, lambda n: env[n])
        by_name[node.name] = env[node]
        remaining.discard(node.name)
    graph.output(tuple(by_name[name] for name in wanted))
    prefix = fx.GraphModule(model, graph)
    eliminate_dead_code(prefix)  # branches the wanted values do not need
    prefix.recompile()
    return prefix


def calibration_batches(cali_data: Any) -> list[Any]:
    if isinstance(cali_data, Tensor):
        return [cali_data]
    batches = list(cali_data)
    if not batches:
        raise ValueError("cali_data is empty: give a list of input batches (tensors, tuples or dicts)")
    return batches


def call_with(model: nn.Module, batch: Any) -> Any:
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def _detached(value: Any, device: torch.device) -> Any:
    return value.detach().to(device) if isinstance(value, Tensor) else value  # sizes stay numbers


def _on(values: tuple[Any, ...], device: torch.device) -> tuple[Any, ...]:
    return tuple(t.to(device, non_blocking=True) if isinstance(t, Tensor) else t for t in values)


def _nbytes(values: Iterable[Any]) -> int:
    return sum(t.numel() * t.element_size() for t in values if isinstance(t, Tensor))


@torch.no_grad()
def _collect(
    model: fx.GraphModule, wanted: Sequence[str], batches: Sequence[Any], device: torch.device
) -> list[tuple[Tensor, ...]]:
    prefix = model_up_to(model, wanted)
    return [tuple(_detached(t, device) for t in call_with(prefix, batch)) for batch in batches]


def _rec_loss(pred: Tensor, target: Tensor) -> Tensor:
    """``sum(|pred - target|^2)`` over each sample's features, mean over the batch."""
    diff = (pred - target).pow(2)
    return diff.reshape(diff.shape[0], -1).sum(1).mean() if diff.dim() > 1 else diff.sum()


def _unit_quantizers(
    unit_model: fx.GraphModule,
) -> tuple[list[tuple[nn.Module, AdaRoundFakeQuantize]], list[QuantizeBase]]:
    modules = dict(unit_model.named_modules())
    weights: list[tuple[nn.Module, AdaRoundFakeQuantize]] = []
    activations: list[QuantizeBase] = []
    for node in unit_model.graph.nodes:
        if node.op != "call_module":
            continue
        module = modules[str(node.target)]
        quantizer = getattr(module, "weight_fake_quant", None)
        if isinstance(quantizer, AdaRoundFakeQuantize) and isinstance(getattr(module, "weight", None), Tensor):
            weights.append((module, quantizer))
        elif isinstance(module, QuantizeBase) and module not in activations:
            activations.append(module)
    return weights, activations


def _weight_of(module: nn.Module) -> nn.Parameter:
    weight = module.weight
    if not isinstance(weight, nn.Parameter):
        raise TypeError(f"{type(module).__name__} has no weight parameter to reconstruct")
    return weight


def _progress(iterable: Iterable[int], enabled: bool, description: str) -> Iterator[int]:
    yield from tqdm(iterable, desc=description, disable=not enabled, leave=False, mininterval=1.0)


class UnitReconstruction:
    """One unit's reconstruction: set up from the cached values, ``step(t)`` per iteration, then ``finish()``.

    ``float_step(index)`` runs the unit's float forward and backward on the same batch without
    changing anything (gradients for its weights and its inputs, as backpropagation through a
    network computes them): the reference cost of an iteration (``benchmarks/ptq_speed.py``).
    """

    def __init__(
        self,
        model: fx.GraphModule,
        fp_model: fx.GraphModule,
        unit: Unit,
        cache: UnitCache,
        config: ReconstructionConfig,
        generator: random.Random,
    ) -> None:
        self.unit, self.cache, self.config, self.generator = unit, cache, config, generator
        self.model = model
        self.device = next((p.device for p in model.parameters()), torch.device("cpu"))
        quant_inputs, fp_inputs = cache.inputs(unit.inputs)
        self.quant_inputs = [_on(x, self.device) for x in quant_inputs]
        self.fp_inputs = [_on(x, self.device) for x in fp_inputs]
        self.fp_unit = _subgraph(fp_model, unit.nodes, unit.inputs, unit.outputs)
        with torch.no_grad():
            self.targets = [tuple(_detached(t, self.device) for t in self.fp_unit(*x)) for x in self.fp_inputs]
        self.unit_model = _subgraph(model, unit.nodes, unit.inputs, unit.outputs).train(False)
        self.weights, self.activations = _unit_quantizers(self.unit_model)
        self.start_error = _unit_error(self.unit_model, self.quant_inputs, self.targets)  # rounding to nearest
        for module, rounding in self.weights:
            rounding.init(_weight_of(module), config.round_mode)
        scales = [
            p for q in self.activations if isinstance(q, LearnableFakeQuantize) for p in (q.scale,) if p.requires_grad
        ]
        for activation in self.activations:
            if isinstance(activation, QDropFakeQuantize):
                activation.prob = config.prob
        self.frozen = {p: p.requires_grad for p in model.parameters()}
        for parameter in model.parameters():
            parameter.requires_grad_(False)
        alphas = [q.alpha for _, q in self.weights if q.alpha is not None]
        for parameter in [*alphas, *scales]:
            parameter.requires_grad_(True)
        self.optimizers: list[torch.optim.Optimizer] = []
        self.schedulers: list[torch.optim.lr_scheduler.LRScheduler] = []
        if alphas:
            self.optimizers.append(torch.optim.Adam(alphas))
        if scales and config.scale_lr > 0:
            scale_optimizer = torch.optim.Adam(scales, lr=config.scale_lr)
            self.optimizers.append(scale_optimizer)
            self.schedulers.append(
                torch.optim.lr_scheduler.CosineAnnealingLR(scale_optimizer, T_max=config.max_count, eta_min=0.0)
            )
        self.decay = LinearTempDecay(config.max_count, config.warm_up, *config.b_range)

    @property
    def learns(self) -> bool:
        return bool(self.optimizers)

    def _inputs(self, index: int) -> tuple[Any, ...]:
        inputs = self.quant_inputs[index]
        if self.config.prob >= 1.0:
            return inputs
        return tuple(
            torch.where(keep_mask(q, self.config.prob), q, f) if isinstance(q, Tensor) and q.is_floating_point() else q
            for q, f in zip(inputs, self.fp_inputs[index], strict=True)
        )

    def step(self, step: int) -> float:
        """One iteration on a random cached batch; returns the loss."""
        index = self.generator.randrange(len(self.quant_inputs))
        outputs = self.unit_model(*self._inputs(index))
        loss = torch.stack([_rec_loss(o, t) for o, t in zip(outputs, self.targets[index], strict=True)]).sum()
        if step >= self.config.warm_up * self.config.max_count and self.weights:
            b = self.decay(step)
            loss = loss + self.config.weight * torch.stack([q.rounding_loss(b) for _, q in self.weights]).sum()
        for optimizer in self.optimizers:
            optimizer.zero_grad()
        loss.backward()
        for optimizer in self.optimizers:
            optimizer.step()
        for scheduler in self.schedulers:
            scheduler.step()
        return float(loss.detach())

    def float_step(self, index: int = 0) -> None:
        """The unit's float forward and backward on batch ``index`` (weight and input gradients), a cost reference."""
        parameters = [p for p in self.fp_unit.parameters() if p.is_floating_point()]
        states = [p.requires_grad for p in parameters]
        for parameter in parameters:
            parameter.requires_grad_(True)
        inputs = [
            t.detach().requires_grad_(True) if isinstance(t, Tensor) and t.is_floating_point() else t
            for t in self.fp_inputs[index]
        ]
        outputs = self.fp_unit(*inputs)
        loss = torch.stack([_rec_loss(o, t) for o, t in zip(outputs, self.targets[index], strict=True)]).sum()
        loss.backward()
        for parameter, state in zip(parameters, states, strict=True):
            parameter.grad = None
            parameter.requires_grad_(state)

    def finish(self) -> dict[str, float]:
        """Hard rounding into the weights, ``prob`` back to 1; stores the unit's outputs for the next unit."""
        with torch.no_grad():
            for module, rounding in self.weights:
                weight = _weight_of(module)
                weight.copy_(rounding.get_hard_value(weight))
                rounding.finish()
        for activation in self.activations:
            if isinstance(activation, QDropFakeQuantize):
                activation.prob = 1.0
        for parameter, requires_grad in self.frozen.items():
            parameter.requires_grad_(requires_grad)
        end = _unit_error(self.unit_model, self.quant_inputs, self.targets)
        with torch.no_grad():
            outputs = [tuple(_detached(t, self.device) for t in self.unit_model(*x)) for x in self.quant_inputs]
        self.cache.store(self.unit.outputs, outputs, self.targets)
        return {"start": self.start_error, "end": end}


@torch.no_grad()
def _unit_error(
    unit_model: fx.GraphModule, inputs: list[tuple[Tensor, ...]], targets: list[tuple[Tensor, ...]]
) -> float:
    total = 0.0
    for x, target in zip(inputs, targets, strict=True):
        total += float(sum(_rec_loss(o, t) for o, t in zip(unit_model(*x), target, strict=True)))
    return total / len(inputs)


def ptq_reconstruction(model: fx.GraphModule, cali_data: Any, config: Any) -> fx.GraphModule:
    """Reconstruct ``model`` (prepared and calibrated) unit by unit on ``cali_data``; returns it in quantization mode.

    ``cali_data``: a list of input batches (a tensor, a tuple of positional inputs or a dict of
    keyword inputs each). ``config``: MQBench's reconstruction keys (see :data:`CONFIG_DEFAULTS`).
    The model is changed in place (weights hard-rounded onto their grids, activation scales
    learned) and returned. Cached unit inputs and outputs stay within ``memory_budget_mb``: beyond
    it, a random subset of the batches is used, and the log says so.
    """
    if not isinstance(model, fx.GraphModule):
        raise ValueError(f"ptq_reconstruction takes the model prepare_by_platform returned, got {type(model).__name__}")
    settings = ReconstructionConfig.from_mapping(config)
    batches = calibration_batches(cali_data)
    generator = random.Random(settings.seed)
    torch.manual_seed(settings.seed)
    units = find_units(model, settings.pattern, settings.exclude_node)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    cache_device = device if settings.keep_gpu else torch.device("cpu")
    fp_model = float_copy(model)
    enable_quantization(model)
    model.eval()
    batches = _within_budget(fp_model, units, batches, settings.memory_budget_mb * 2**20, generator)
    cache = UnitCache(model, fp_model, batches, cache_device)
    logger.info(
        "reconstruction: %d %s unit(s), %d batch(es), %d iterations each",
        len(units),
        settings.pattern,
        len(batches),
        settings.max_count,
    )
    for number, unit in enumerate(units, 1):
        work = UnitReconstruction(model, fp_model, unit, cache, settings, generator)
        if work.learns:
            for step in _progress(range(settings.max_count), settings.progress, f"reconstruct {unit.name}"):
                work.step(step)
        errors = work.finish()
        cache.keep({name for later in units[number:] for name in later.inputs})
        logger.info(
            "unit %d/%d %s (%s, %d layer(s)): output error %.4g -> %.4g",
            number,
            len(units),
            unit.name,
            unit.kind,
            len(unit.layers),
            errors["start"],
            errors["end"],
        )
    enable_quantization(model)
    return model


def float_copy(model: fx.GraphModule) -> fx.GraphModule:
    """The float model: the same graph and weights with every quantizer off (kept as the weights were)."""
    fp_model = copy.deepcopy(model)
    disable_all(fp_model)
    return fp_model.eval()


class UnitCache:
    """Per calibration batch, the values of named nodes in the quantized and in the float model.

    A unit's outputs are stored when it is done; the next unit reads them as its inputs, so each
    unit runs only itself on the calibration data. Values a unit reads that no earlier unit
    wrote (the first unit's input, an attention mask) come from running the model up to them.
    """

    def __init__(
        self, model: fx.GraphModule, fp_model: fx.GraphModule, batches: list[Any], device: torch.device
    ) -> None:
        self.model, self.fp_model, self.batches, self.device = model, fp_model, batches, device
        self.quant: dict[str, list[Tensor]] = {}
        self.fp: dict[str, list[Tensor]] = {}

    def inputs(self, names: Sequence[str]) -> tuple[list[tuple[Tensor, ...]], list[tuple[Tensor, ...]]]:
        missing = [name for name in names if name not in self.quant]
        if missing:
            for values, source in ((self.quant, self.model), (self.fp, self.fp_model)):
                collected = _collect(source, missing, self.batches, self.device)
                for i, name in enumerate(missing):
                    values[name] = [batch[i] for batch in collected]
        count = len(self.batches)
        quant = [tuple(self.quant[name][b] for name in names) for b in range(count)]
        fp = [tuple(self.fp[name][b] for name in names) for b in range(count)]
        return quant, fp

    def store(self, names: Sequence[str], quant: list[tuple[Tensor, ...]], fp: list[tuple[Tensor, ...]]) -> None:
        for i, name in enumerate(names):
            self.quant[name] = [_detached(batch[i], self.device) for batch in quant]
            self.fp[name] = [_detached(batch[i], self.device) for batch in fp]

    def keep(self, names: set[str]) -> None:
        for values in (self.quant, self.fp):
            for name in list(values):
                if name not in names:
                    del values[name]


def _within_budget(
    fp_model: fx.GraphModule, units: list[Unit], batches: list[Any], budget: float, generator: random.Random
) -> list[Any]:
    """The calibration batches whose cached unit values fit in ``budget`` bytes (all, or a random subset)."""
    if not units:
        return batches
    names = list(dict.fromkeys(name for unit in units for name in (*unit.inputs, *unit.outputs)))
    sizes = dict(
        zip(names, (_nbytes([t]) for t in _collect(fp_model, names, batches[:1], torch.device("cpu"))[0]), strict=True)
    )
    # per batch: a unit's inputs and outputs, each in the quantized and the float model
    per_batch = max(2 * sum(sizes[n] for n in (*unit.inputs, *unit.outputs)) for unit in units)
    fits = max(1, int(budget // max(per_batch, 1)))
    if fits >= len(batches):
        return batches
    logger.warning(
        "reconstruction: %d calibration batches need %.1f MiB of cached values, over memory_budget_mb=%.1f; "
        "using %d random batch(es)",
        len(batches),
        per_batch * len(batches) / 2**20,
        budget / 2**20,
        fits,
    )
    return generator.sample(batches, fits)
