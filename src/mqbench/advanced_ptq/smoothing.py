"""Activation-outlier migration (SmoothQuant, Xiao et al., 2023) on a prepared model.

Transformer activations have a few channels tens of times larger than the rest; a per-tensor
8-bit grid sized for them rounds every other channel to a handful of levels. Channel ``j`` of the
input of a linear layer can be divided by ``s_j`` if column ``j`` of the layer's weight is
multiplied by it (``(x / s) (W s)^T = x W^T``): the outliers move into the weights, whose grid is
per output channel. ``s_j = a_j^alpha / w_j^(1 - alpha)`` with ``a_j`` the largest magnitude of
input channel ``j`` over the calibration data and ``w_j`` that of weight column ``j`` (the largest
over every layer reading the same input).

``smooth_quant(model, cali_data)`` does this for every activation quantizer whose readers are all
linear layers (attention projections, MLP layers): a :class:`ChannelScale` node (a per-channel
multiplication by ``1 / s``) is put before the quantizer, only on the linear branch: another
reader of the same float tensor (a residual connection) keeps it unscaled. The deployed graph has
that multiplication as a ``Mul`` by a constant before the quantizer, which runtimes fuse into the
quantization. With ``alpha=None`` (the default) ``alpha`` is chosen per quantizer from
:data:`ALPHAS`, or no migration at all, whichever gives the least squared error of the layers'
quantized outputs on a sample of calibration rows (weights and activations on the model's own
grids). Run it on a prepared model before calibration.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from mqbench.prepare_by_platform import prepare_by_platform
    >>> from mqbench.advanced_ptq import calibrate, smooth_quant
    >>> _ = torch.manual_seed(0)
    >>> model = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 4)).eval()
    >>> data = [torch.randn(8, 16) * torch.linspace(0.1, 30, 16) for _ in range(4)]  # outlier channels
    >>> qmodel = prepare_by_platform(model, "academic_nlp", {"extra_qconfig_dict": {
    ...     "w_qscheme": {"bit": 8, "symmetry": True, "per_channel": True},
    ...     "a_qscheme": {"bit": 8, "symmetry": True, "per_channel": False},
    ...     "w_observer": "MinMaxObserver", "a_observer": "MinMaxObserver",
    ...     "w_fakequantize": "FixedFakeQuantize", "a_fakequantize": "FixedFakeQuantize"}})
    >>> sorted(smooth_quant(qmodel, data, alpha=0.5))
    ['_1_post_act_fake_quantizer', 'input_1_post_act_fake_quantizer']
    >>> _ = calibrate(qmodel, data)
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn

from mqbench.advanced_ptq.pipeline import Segment, one_pass
from mqbench.fake_quantize.quantize_base import QuantizeBase
from mqbench.observer.base import ObserverBase
from mqbench.observer.minmax import EMAMinMaxObserver, MinMaxObserver
from mqbench.utils.lazy_weights import require_weights
from mqbench.utils.logger import logger
from mqbench.utils.tied import shared_weights

__all__ = [
    "ALPHAS",
    "ChannelScale",
    "after_foldable_norm",
    "foldable_norm",
    "fresh_copy",
    "replays_exactly",
    "restore_smoothing",
    "smooth_quant",
    "smoothing_groups",
]

_SUFFIX = "_smoothing"  # a ChannelScale module is named after the quantizer it feeds

ALPHAS = (0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95, 1.0)
"""The migration strengths ``smooth_quant(alpha=None)`` chooses from (besides no migration). ``1.0``
normalises every input channel to the same range: a per-channel activation scale, folded into the weights."""


class ChannelScale(nn.Module):
    """Multiplies the last dimension of its input by a constant vector (``1 / s`` of the migration)."""

    scale: Tensor

    def __init__(self, scale: Tensor) -> None:
        super().__init__()
        self.register_buffer("scale", scale.detach().clone())

    def forward(self, x: Tensor) -> Tensor:
        return x * self.scale

    def extra_repr(self) -> str:
        return f"channels={self.scale.numel()}"


def foldable_norm(module: nn.Module) -> bool:
    """Whether ``module`` computes ``normalised(x) * weight (+ bias)`` with a 1-d gain: LayerNorm, RMSNorm and the
    ``*RMSNorm`` classes of transformers' models (Gemma's ``1 + weight`` gain excepted). A per-channel scale of its
    output is then a norm with gain ``weight * s``.

    Example:
        >>> foldable_norm(nn.LayerNorm(4)), foldable_norm(nn.Linear(4, 4))
        (True, False)
    """
    name = type(module).__name__
    plain = isinstance(module, nn.LayerNorm | nn.RMSNorm) or (name.endswith("RMSNorm") and not name.startswith("Gemma"))
    weight = getattr(module, "weight", None)
    return plain and isinstance(weight, Tensor) and weight.ndim == 1


def after_foldable_norm(node: fx.Node, modules: dict[str, nn.Module]) -> bool:
    """Whether ``node``'s input is a norm's output that nothing else reads (a scale there folds into the norm)."""
    source = node.args[0] if node.args else None
    return (
        isinstance(source, fx.Node)
        and source.op == "call_module"
        and foldable_norm(modules.get(str(source.target), nn.Identity()))
        and set(source.users) == {node}
    )


def _linear_readers(node: fx.Node, modules: dict[str, nn.Module]) -> list[nn.Linear] | None:
    """The linear layers reading quantizer ``node``'s output as their input, when they are all its readers."""
    layers = []
    for user in node.users:
        module = modules.get(str(user.target)) if user.op == "call_module" else None
        if not isinstance(module, nn.Linear) or not user.args or user.args[0] is not node or user.kwargs:
            return None
        layers.append(module)
    return layers or None


def fresh_copy(quantizer: QuantizeBase) -> QuantizeBase:
    """A copy of ``quantizer`` that has observed nothing, observing and quantizing."""
    twin = copy.deepcopy(quantizer)
    observer = twin.activation_post_process
    if isinstance(getattr(observer, "num_batches", None), Tensor):
        observer.num_batches.zero_()
    twin.enable_observer()
    twin.enable_fake_quant()
    return twin


def _quantized(quantizer: QuantizeBase, x: Tensor) -> Tensor:
    twin = fresh_copy(quantizer)
    twin(x)  # observe
    twin.disable_observer()
    return twin(x)


class _Statistics:
    """Per-channel extremes of a quantizer's input over the calibration data, and a uniform sample of ``rows`` of
    its rows (each row a random key, the smallest kept: the memory is the sample's, however much data runs)."""

    def __init__(self, rows: int, generator: torch.Generator, each_batch: bool = False) -> None:
        self.rows, self.generator = rows, generator
        self.low: Tensor | None = None
        self.high: Tensor | None = None
        self.sample: Tensor | None = None
        self.keys: Tensor | None = None
        self.batches: list[tuple[Tensor, Tensor]] | None = [] if each_batch else None  # each batch's extremes

    def __call__(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        x = args[0].detach().float()
        flat = x.reshape(-1, x.shape[-1])
        low, high = flat.amin(0), flat.amax(0)
        if self.batches is not None:
            self.batches.append((low, high))
        self.low = low if self.low is None else torch.minimum(self.low, low)
        self.high = high if self.high is None else torch.maximum(self.high, high)
        keys = torch.rand(flat.shape[0], generator=self.generator)
        if self.sample is not None and self.keys is not None:
            flat, keys = torch.cat([self.sample, flat]), torch.cat([self.keys, keys])
        keep = torch.argsort(keys)[: self.rows]
        self.sample, self.keys = flat[keep].clone(), keys[keep]

    def rows_for_search(self, low: Tensor, high: Tensor) -> Tensor:
        """The sample with the extremes ``low`` / ``high`` as two more rows (the sample's range then the calibration
        data's, per channel too); the sample is dropped."""
        assert self.sample is not None
        rows, self.sample, self.keys = torch.cat([self.sample, low[None], high[None]]), None, None
        return rows


def _error(x: Tensor, layers: Sequence[nn.Linear], act: QuantizeBase, scale: Tensor | None) -> float:
    """Squared error of the layers' outputs with input and weights quantized after migrating by ``scale``."""
    xq = _quantized(act, x if scale is None else x / scale)
    total = 0.0
    for layer in layers:
        weight = layer.weight.detach()
        scaled = weight if scale is None else weight * scale
        quantizer = layer.weight_fake_quant
        wq = _quantized(quantizer, scaled) if isinstance(quantizer, QuantizeBase) else scaled
        total += float((F.linear(xq, wq) - F.linear(x, weight)).square().sum())
    return total


def _migration(a: Tensor, w: Tensor, alpha: float) -> Tensor:
    return (a.clamp(min=1e-5).pow(alpha) / w.clamp(min=1e-5).pow(1 - alpha)).clamp(min=1e-5)


@torch.no_grad()
def smooth_quant(
    model: fx.GraphModule,
    cali_data: Any,
    alpha: float | None = None,
    sample_rows: int = 2048,
    seed: int = 0,
    after_norm: bool = False,
    calibrating: bool = False,
) -> dict[str, float]:
    """Migrate activation outliers into the weights of linear layers (see the module docstring).

    ``after_norm``: smooth only the inputs that a norm computes for them alone (the query / key / value and the
    gate / up projections of a transformer block), and divide the norm's gain (and bias) by the scale instead of
    adding a :class:`ChannelScale` node: the model keeps its architecture, so a checkpoint of it (compressed-tensors,
    GGUF) computes exactly what the simulation computes (the other inputs' scales have no place there).

    Returns the chosen ``alpha`` per activation quantizer that was smoothed (a quantizer for which
    the search found no migration better than none is left alone and not listed). The model is
    changed in place: weights multiplied, :class:`ChannelScale` nodes added. Its quantizers are
    left as they were (observing, quantizing or neither); calibrate it afterwards.

    ``calibrating``: the pass is calibration's too (``calibrate`` does this): the quantizers keep the switches the
    caller set, so the activation observers see the data, and each smoothed quantizer, whose observer saw the input
    before its scale, observes again each batch's range of the scaled input, from the per-channel extremes the pass
    recorded (exact for the observers of :func:`replays_exactly`; ValueError for others). The model's other
    quantizers see the float model before the migration, which computes the same values to float32 rounding.
    """
    if not isinstance(model, fx.GraphModule):
        raise ValueError(f"smooth_quant takes the model prepare_by_platform returned, got {type(model).__name__}")
    if alpha is not None and not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1] (or None to search it per quantizer), got {alpha}")
    if calibrating and after_norm:
        raise ValueError("smooth_quant(calibrating=True) needs the scales as ChannelScale nodes (after_norm=False)")
    require_weights(model, "smooth_quant (it rescales every layer once the pass is done)")
    modules = dict(model.named_modules())
    groups = smoothing_groups(model, after_norm, warn=True)
    if not groups:
        logger.info("smooth_quant: no activation quantizer read only by linear layers")
        if calibrating:
            one_pass(model, cali_data)
        return {}
    if calibrating:
        unreplayable = [str(n.target) for n in groups if not replays_exactly(modules[str(n.target)])]
        if unreplayable:
            raise ValueError(
                f"smooth_quant(calibrating=True): the observers of {unreplayable} cannot take the smoothed range "
                "from per-channel extremes (per-tensor MinMaxObserver / EMAMinMaxObserver can); smooth first"
            )

    # a generator per quantizer: its sample does not depend on the order the data runs through the model
    statistics = {
        node: _Statistics(sample_rows, torch.Generator().manual_seed(seed * 1_000_003 + i), each_batch=calibrating)
        for i, node in enumerate(groups)
    }
    hooks = {modules[str(node.target)]: statistics[node] for node in groups}
    decided: dict[fx.Node, tuple[float, Tensor]] = {}

    def decide(segment: Segment | None) -> None:  # each block's migrations once its data has run; samples dropped
        for node, layers in groups.items():
            stats = statistics[node]
            if (segment is not None and node not in segment) or stats.high is None or stats.low is None:
                continue  # another block's, or never ran
            act = modules[str(node.target)]
            w = torch.stack([layer.weight.detach().abs().amax(0) for layer in layers]).amax(0)
            low, high = stats.low, stats.high
            a = torch.maximum(high.abs(), low.abs())
            stats.low = stats.high = None
            if alpha is not None:
                best, stats.sample, stats.keys = alpha, None, None
            else:
                x = stats.rows_for_search(low, high)
                errors = {candidate: _error(x, layers, act, _migration(a, w, candidate)) for candidate in ALPHAS}
                best = min(errors, key=lambda candidate: errors[candidate])
                if errors[best] >= _error(x, layers, act, None):
                    continue
            decided[node] = (best, _migration(a, w, best))

    # block by block on a transformer; the weights and the graph change after the pass
    if calibrating:  # the quantizers as the caller switched them: the activation observers see this pass too
        one_pass(model, cali_data, hooks, None, "calibration", decide)
    else:
        one_pass(model, cali_data, hooks, _nothing_quantized(model), "smooth_quant", decide)

    chosen: dict[str, float] = {}
    for node, layers in groups.items():
        if node not in decided:
            continue
        best, scale = decided[node]
        for layer in layers:
            layer.weight.mul_(scale.to(layer.weight.dtype))
        if after_norm:  # into the norm's gain (and bias): the model keeps its architecture, as a checkpoint holds it
            produced = node.args[0]
            assert isinstance(produced, fx.Node)  # a norm's output: after_foldable_norm chose this quantizer
            norm = modules[str(produced.target)]
            for leaf in ("weight", "bias"):
                value = getattr(norm, leaf, None)
                if isinstance(value, Tensor):
                    value.data.mul_((1.0 / scale).to(value.dtype))
        else:
            inverse = (1.0 / scale).to(scale.dtype)
            _insert_channel_scale(model, node, _free_name(model, f"{node.target}{_SUFFIX}"), inverse)
            batches = statistics[node].batches
            if batches is not None:  # what the quantizer would have observed of the scaled input, batch by batch
                _observe_scaled(modules[str(node.target)], batches, inverse)
        chosen[str(node.target)] = best
    model.recompile()
    logger.info("smooth_quant: %d of %d linear input(s) smoothed", len(chosen), len(groups))
    return chosen


def smoothing_groups(
    model: fx.GraphModule, after_norm: bool = False, warn: bool = False
) -> dict[fx.Node, list[nn.Linear]]:
    """The activation quantizers :func:`smooth_quant` would smooth, each with the linear layers reading it: every one
    read only by linear layers (``after_norm``: whose input a norm computes for it alone), not smoothed already, whose
    layers hold their weights alone (``warn``: a tied one is logged)."""
    modules = dict(model.named_modules())
    names = {id(module): name for name, module in modules.items()}
    shared = shared_weights(model)
    groups: dict[fx.Node, list[nn.Linear]] = {}
    for node in model.graph.nodes:
        quantizer = modules.get(str(node.target)) if node.op == "call_module" else None
        if not isinstance(quantizer, QuantizeBase) or not node.args or not isinstance(node.args[0], fx.Node):
            continue
        source = node.args[0]
        if source.op == "call_module" and isinstance(modules.get(str(source.target)), ChannelScale):
            continue  # smoothed already
        if after_norm and not after_foldable_norm(node, modules):
            continue
        layers = _linear_readers(node, modules)
        tied = [names[id(layer)] for layer in layers or () if names[id(layer)] in shared]
        if tied and warn:  # scaling its columns would scale the other holders' weight too (an embedding table's rows)
            logger.warning(
                "smooth_quant: %s not smoothed: %s share(s) the weight with %s (tied)",
                node.target,
                ", ".join(tied),
                ", ".join(other for name in tied for other in shared[name]),
            )
        elif layers is not None and not tied:
            groups[node] = layers
    return groups


def replays_exactly(quantizer: nn.Module) -> bool:
    """Whether ``quantizer``'s observer is a per-tensor running min/max (``MinMaxObserver``) or its moving average
    (``EMAMinMaxObserver``): the range of a channel-scaled input (``x * c``, ``c > 0``) then follows from each
    batch's per-channel extremes of ``x``, exactly (``max(x * c) = max(x) * c`` in float arithmetic too: rounding
    a product by a positive constant keeps the order)."""
    observer = getattr(quantizer, "activation_post_process", None)
    if not isinstance(quantizer, QuantizeBase) or type(observer) not in (MinMaxObserver, EMAMinMaxObserver):
        return False
    return not cast(ObserverBase, observer).is_per_channel


def _observe_scaled(quantizer: nn.Module, batches: Sequence[tuple[Tensor, Tensor]], scale: Tensor) -> None:
    """The quantizer observes again, from nothing, each batch's range of its input times ``scale``: a two-row tensor
    per batch, the per-channel minima and maxima scaled, whose extremes are the scaled batch's."""
    count = getattr(quantizer.activation_post_process, "num_batches", None)
    if isinstance(count, Tensor):
        count.zero_()
    for low, high in batches:
        quantizer(torch.stack([low * scale, high * scale]))


def _insert_channel_scale(model: fx.GraphModule, quantizer: fx.Node, name: str, scale: Tensor) -> None:
    """A ChannelScale module ``name`` multiplying by ``scale``, on the quantizer's input edge only."""
    model.add_module(name, ChannelScale(scale))
    with model.graph.inserting_before(quantizer):
        scaled = model.graph.call_module(name, (quantizer.args[0],))
    quantizer.args = (scaled, *quantizer.args[1:])


def restore_smoothing(model: fx.GraphModule, state_dict: Mapping[str, Any]) -> list[str]:
    """Put back the :class:`ChannelScale` nodes a saved smoothed model had, so that it loads its state dict.

    A model that :func:`smooth_quant` changed has, in its state dict, the migrated weights and one
    ``<quantizer>_smoothing.scale`` entry per smoothed input; a freshly prepared model has neither.
    This adds each missing scale node before its quantizer (with the saved values); then
    ``model.load_state_dict(state_dict)`` loads the weights and qparams as usual. Returns the names
    of the nodes added. A state dict without smoothing entries changes nothing.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from mqbench.prepare_by_platform import prepare_by_platform
        >>> from mqbench.advanced_ptq import calibrate, restore_smoothing
        >>> model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2)).eval()
        >>> data = [torch.randn(4, 8) * torch.linspace(0.1, 20, 8) for _ in range(2)]
        >>> saved = calibrate(prepare_by_platform(model, "tensorrt_nlp"), data).state_dict()
        >>> fresh = prepare_by_platform(model, "tensorrt_nlp")
        >>> restore_smoothing(fresh, saved)
        ['_1_post_act_fake_quantizer_smoothing', 'input_1_post_act_fake_quantizer_smoothing']
        >>> fresh.load_state_dict(saved)
        <All keys matched successfully>
    """
    if not isinstance(model, fx.GraphModule):
        raise ValueError(f"restore_smoothing takes the model prepare_by_platform returned, got {type(model).__name__}")
    nodes = {str(n.target): n for n in model.graph.nodes if n.op == "call_module"}
    modules = dict(model.named_modules())
    added = []
    for key, value in state_dict.items():
        name, _, leaf = key.rpartition(".")
        if leaf != "scale" or _SUFFIX not in name or "." in name or name in modules:
            continue
        target = name[: name.rindex(_SUFFIX)]
        quantizer = nodes.get(target)
        if quantizer is None or not isinstance(modules.get(target), QuantizeBase):
            raise ValueError(
                f"state dict entry {key!r} smooths the input of activation quantizer {target!r}, which this model "
                "does not have: prepare the model with the same backend and configuration as the one saved"
            )
        _insert_channel_scale(model, quantizer, name, torch.as_tensor(value).detach().clone())
        added.append(name)
    if added:
        model.recompile()
    return sorted(added)


@contextmanager
def _nothing_quantized(model: nn.Module) -> Iterator[None]:
    """Every quantizer neither observing nor quantizing; restored afterwards."""
    switches = {name: (q.observer_enabled.clone(), q.fake_quant_enabled.clone()) for name, q in _quantizers(model)}
    for _, q in _quantizers(model):
        q.disable_observer()
        q.disable_fake_quant()
    try:
        yield
    finally:
        for name, q in _quantizers(model):
            observer, fake_quant = switches[name]
            q.observer_enabled.copy_(observer)
            q.fake_quant_enabled.copy_(fake_quant)


def _quantizers(model: nn.Module) -> list[tuple[str, QuantizeBase]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, QuantizeBase)]


def _free_name(model: nn.Module, name: str) -> str:
    candidate, index = name, 1
    while hasattr(model, candidate):
        candidate, index = f"{name}_{index}", index + 1
    return candidate
