"""Cross-layer equalization and empirical bias correction (Nagel et al., 2019), on a prepared model.

``cross_layer_equalization(model)``: for each pair of layers where the first one's output reaches
the second one alone, through nothing but a ReLU and pooling layers (or nothing, or activation quantizers not yet
calibrated), output channel ``i`` of the first layer is divided by
``s_i = sqrt(r1_i / r2_i)`` and input channel ``i`` of the second multiplied by it (``r1_i`` the
largest magnitude of the first layer's channel ``i`` weights, ``r2_i`` that of the second
layer's input channel ``i``). ReLU and pooling commute with a positive scale, so the float model computes
the same; afterwards both ranges are ``sqrt(r1_i r2_i)``, which evens out per-tensor weight
grids. A pair's equalizer registered with ``mqbench.utils.registry.register_weight_equalization_function`` for
its two layer types replaces this rule for it. Run it on a prepared model before calibrating it (BatchNorm is
folded by then in post-training preparation); depthwise second layers are handled, other grouped ones skipped.

``bias_correction(model, cali_data)``: for each quantized conv or linear layer, in graph order,
the mean per output channel of ``layer(x; quantized weight) - layer(x; float weight)`` over the
calibration data (``x`` as the quantized model computes it, earlier corrections included) is
subtracted from the layer's bias (one pass of the layer with the weight's error, ``layer(x; quantized weight -
float weight)``, as the layer is linear in its weight; summed over positions, that is the weight's error applied
to the input's sums per channel and kernel tap, what each tap reads over every output position, zero padding
included: no pass of the layer). Run it after calibration, in quantization mode; it costs one forward pass per
batch.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from mqbench.prepare_by_platform import prepare_by_platform
    >>> from mqbench.advanced_ptq import cross_layer_equalization
    >>> _ = torch.manual_seed(0)
    >>> model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)).eval()
    >>> with torch.no_grad():
    ...     model[0].weight[0] *= 50  # one channel 50x the others: a per-tensor grid wastes its bits
    >>> qmodel = prepare_by_platform(model, "tensorrt")
    >>> from mqbench.utils.state import disable_all
    >>> disable_all(qmodel)  # compare the float computations
    >>> x = torch.randn(8, 4)
    >>> before = qmodel(x)
    >>> [pair for pair in cross_layer_equalization(qmodel)]
    [('_0', '_2')]
    >>> torch.allclose(qmodel(x), before, atol=1e-5)
    True
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, cast

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import Tensor, fx, nn

from mqbench.advanced_ptq.reconstruction import calibration_batches, call_with
from mqbench.custom_quantizer.ops import node_kind
from mqbench.fake_quantize.quantize_base import QuantizeBase
from mqbench.nn.intrinsic.qat.modules.bn_folding import BnFoldingModule
from mqbench.utils.lazy_weights import require_weights
from mqbench.utils.logger import logger
from mqbench.utils.registry import weight_equalization_function
from mqbench.utils.tied import shared_weights

__all__ = ["bias_correction", "cross_layer_equalization", "equalization_pairs", "equalize_pair"]

_LAYERS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)
# pooling layers a pair's channels pass through unchanged in order (each commutes with a positive scale per channel)
_POOLS: tuple[type[nn.Module], ...] = (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d)
_POOLS += (nn.AvgPool3d, nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d, nn.AdaptiveMaxPool1d)
_POOLS += (nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d)


def _layer(node: fx.Node, modules: dict[str, nn.Module]) -> nn.Module | None:
    """A conv or linear layer (a BatchNorm-folding QAT module is not: its weight is not what it applies)."""
    module = modules.get(str(node.target)) if node.op == "call_module" else None
    if isinstance(module, BnFoldingModule) or not isinstance(module, _LAYERS):
        return None
    return module if isinstance(getattr(module, "weight", None), Tensor) else None


def _weight(module: nn.Module) -> Tensor:
    return cast(Tensor, module.weight)


def _bias(module: nn.Module) -> Tensor | None:
    return cast("Tensor | None", module.bias)


def _ends_with_other_activation(module: nn.Module) -> bool:
    """A fused module ending in something other than ReLU (ReLU6, Hardswish) does not commute with scaling."""
    return any(isinstance(child, (nn.ReLU6, nn.Hardswish, nn.Hardtanh, nn.SiLU, nn.GELU)) for child in module.modules())


def _next_layer(node: fx.Node, modules: dict[str, nn.Module]) -> fx.Node | None:
    """The layer that alone reads ``node``'s output, through ReLUs, pooling layers and quantizers only."""
    current = node
    while True:
        users = list(current.users)
        if len(users) != 1:
            return None
        user = users[0]
        if _layer(user, modules) is not None:
            return user if user.args and user.args[0] is current else None
        module = modules.get(str(user.target)) if user.op == "call_module" else None
        if not (isinstance(module, (QuantizeBase, *_POOLS)) or node_kind(user, modules) == "relu"):
            return None
        current = user


def _input_ranges(second: nn.Module, channels: int) -> Tensor | None:
    weight = _weight(second).detach()
    groups = getattr(second, "groups", 1)
    if groups == 1:
        return weight.transpose(0, 1).reshape(weight.shape[1], -1).abs().amax(1)
    if groups == channels and weight.shape[0] == channels and weight.shape[1] == 1:  # depthwise
        return weight.reshape(channels, -1).abs().amax(1)
    return None


def _scale_inputs(second: nn.Module, scale: Tensor) -> None:
    weight = _weight(second)
    # depthwise: input channel i is output channel i
    standard = getattr(second, "groups", 1) == 1
    shape = [1, -1] + [1] * (weight.dim() - 2) if standard else [-1] + [1] * (weight.dim() - 1)
    weight.mul_(scale.reshape(shape))


def equalization_pairs(model: fx.GraphModule) -> list[tuple[str, str, nn.Module, nn.Module]]:
    """Every pair of layers cross-layer equalization applies to: (node, following node, layer, following layer)."""
    modules = dict(model.named_modules())
    shared = shared_weights(model)
    pairs = []
    for node in model.graph.nodes:
        first = _layer(node, modules)
        if first is None or _ends_with_other_activation(first):
            continue
        follower = _next_layer(node, modules)
        second = _layer(follower, modules) if follower is not None else None
        if follower is None or second is None:
            continue
        tied = [str(n.target) for n in (node, follower) if str(n.target) in shared]
        if tied:  # scaling a weight another module holds too would change that module's function
            others = ", ".join(o for name in tied for o in shared[name])
            logger.warning(
                "cross-layer equalization: %s not equalized: %s share(s) the weight with %s (tied)",
                f"{node.name} -> {follower.name}",
                ", ".join(tied),
                others,
            )
            continue
        channels = _weight(first).shape[0]
        if _input_ranges(second, channels) is None or (getattr(first, "groups", 1) != 1 and first.groups != channels):
            continue
        pairs.append((node.name, follower.name, first, second))
    return pairs


@torch.no_grad()
def equalize_pair(first: nn.Module, second: nn.Module) -> Tensor:
    """Scale ``first``'s output channels by ``1 / s`` and ``second``'s inputs by ``s``, ``s = sqrt(r1 / r2)``; ``s``."""
    weight = _weight(first)
    channels = weight.shape[0]
    r1 = weight.detach().reshape(channels, -1).abs().amax(1)
    r2 = _input_ranges(second, channels)
    if r2 is None:
        raise ValueError(
            f"{type(second).__name__} does not read {channels} channels one by one: it cannot be equalized"
        )
    usable = (r1 > 0) & (r2 > 0)
    scale = torch.where(usable, torch.sqrt(r1 / torch.where(usable, r2, 1.0)), torch.ones_like(r1))
    weight.div_(scale.reshape([-1] + [1] * (weight.dim() - 1)))
    bias = _bias(first)
    if bias is not None:
        bias.div_(scale)
    _scale_inputs(second, scale)
    return scale


@torch.no_grad()
def cross_layer_equalization(model: fx.GraphModule, iterations: int = 1) -> list[tuple[str, str]]:
    """Equalize the weight ranges of every eligible pair of layers (see the module docstring); returns the pairs."""
    require_weights(model, "cross_layer_equalization (it rescales pairs of layers by their weights)")
    pairs = equalization_pairs(model)
    modules = dict(model.named_modules())
    nodes = {node.name: node for node in model.graph.nodes}
    for _ in range(iterations):
        for a, b, first, second in pairs:
            registered = weight_equalization_function(type(first), type(second))  # a user's own, for these types
            if registered is not None:
                registered(modules, [nodes[a], nodes[b]])
            else:
                equalize_pair(first, second)
    logger.info("cross-layer equalization: %d pair(s)", len(pairs))
    return [(a, b) for a, b, _, _ in pairs]


def _pre_activation(module: nn.Module, x: Tensor, weight: Tensor) -> Tensor:
    if isinstance(module, nn.Linear):
        return F.linear(x, weight)
    return cast(Tensor, module._conv_forward(x, weight, None))  # type: ignore[operator]


def _tap_sums(module: nn.Module, x: Tensor) -> tuple[Tensor, int] | None:
    """For a convolution on the batch ``x``: for each input channel and kernel tap, the input values that tap reads
    summed over every output position (a padded position reads zero), ``[C_in, *kernel]`` in float64, and the
    number of output values per channel. The layer's outputs summed over positions are its weight applied to
    these (:func:`_on_tap_sums`), so a bias correction needs no pass of the layer. None where the padding is not
    zeros on both sides (another mode, ``"same"``) or ``x`` has no batch axis."""
    conv = cast(nn.modules.conv._ConvNd, module)
    spatial = len(conv.kernel_size)
    given = conv.padding  # "valid": none; "same": as much as the kernel needs, more on one side if even
    padding: tuple[int, ...] | None = given if not isinstance(given, str) else None
    if given == "valid":
        padding = (0,) * spatial
    if conv.padding_mode != "zeros" or x.dim() != spatial + 2 or padding is None:
        return None
    sizes = [
        (x.shape[2 + d] + 2 * padding[d] - conv.dilation[d] * (conv.kernel_size[d] - 1) - 1) // conv.stride[d] + 1
        for d in range(spatial)
    ]
    # the batch summed in x's precision (a float64 reduction is an order of magnitude slower), the rest in float64
    summed = F.pad(x.sum(dim=0).double(), [p for p in reversed(padding) for _ in range(2)])
    positions = tuple(range(1, spatial + 1))
    taps = []
    for tap in itertools.product(*(range(k) for k in conv.kernel_size)):
        starts = [conv.dilation[d] * tap[d] for d in range(spatial)]
        window = tuple(
            slice(starts[d], starts[d] + conv.stride[d] * (sizes[d] - 1) + 1, conv.stride[d]) for d in range(spatial)
        )
        taps.append(summed[(slice(None), *window)].sum(dim=positions))
    return torch.stack(taps, dim=1).view(x.shape[1], *conv.kernel_size), x.shape[0] * math.prod(sizes)


def _on_tap_sums(module: nn.Module, weight: Tensor, sums: Tensor) -> Tensor:
    """``weight`` of a convolution applied to one value per input channel and kernel tap (``[C_in, *kernel]``): one
    value per output channel."""
    groups = int(getattr(module, "groups", 1))
    per_group = weight.reshape(groups, weight.shape[0] // groups, -1)  # [g, out / g, (in / g) * taps]
    return torch.einsum("gok,gk->go", per_group, sums.to(weight.dtype).reshape(groups, -1)).reshape(-1)


def _on_channel_vector(module: nn.Module, weight: Tensor, vector: Tensor) -> Tensor:
    """``weight`` of ``module`` applied to one value per input channel, ``vector``, each kernel tap reading its
    channel's value: one value per output channel."""
    if isinstance(module, nn.Linear):
        return weight @ vector.to(weight.dtype)
    taps = weight.shape[2:]
    return _on_tap_sums(module, weight, vector.reshape(-1, *[1] * len(taps)).expand(-1, *taps))


def _joined(batches: list[Any]) -> list[Any]:
    """The batches as one (tensors joined along the batch axis) where their structures and shapes allow it."""
    flat = [pytree.tree_flatten(batch) for batch in batches]
    spec = flat[0][1]
    leaves = [values for values, _ in flat]
    joinable = all(s == spec for _, s in flat) and all(
        all(isinstance(v, Tensor) and v.dim() > 0 for v in values) for values in leaves
    )
    if len(batches) == 1 or not joinable:
        return batches
    if any(v.shape[1:] != leaves[0][i].shape[1:] for values in leaves for i, v in enumerate(values)):
        return batches
    return [pytree.tree_unflatten([torch.cat(column) for column in zip(*leaves, strict=True)], spec)]


def _channel_sums(module: nn.Module, error: Tensor) -> tuple[Tensor, int]:
    """The sum of ``error`` per output channel of ``module`` and the number of values summed per channel."""
    channel = error.dim() - 1 if isinstance(module, nn.Linear) else 1
    dims = [d for d in range(error.dim()) if d != channel]
    return error.sum(dim=dims), error.numel() // error.shape[channel]


def _correctable(model: fx.GraphModule, layers: Sequence[str] | None) -> dict[str, tuple[str, nn.Module, QuantizeBase]]:
    """Each quantized conv or linear layer whose bias is its own (by module name): its node's name, the module, its
    weight quantizer; ``layers``: only those nodes."""
    modules = dict(model.named_modules())
    chosen: dict[str, tuple[str, nn.Module, QuantizeBase]] = {}
    biases: dict[int, list[str]] = {}  # a bias tensor held by several modules: correcting it would move them all
    for name, module in model.named_modules(remove_duplicate=False):
        if isinstance(getattr(module, "bias", None), Tensor):
            biases.setdefault(id(module.bias), []).append(name)
    for node in model.graph.nodes:
        module = _layer(node, modules)
        quantizer = getattr(module, "weight_fake_quant", None)
        if not isinstance(quantizer, QuantizeBase) or module is None:
            continue
        if layers is not None and node.name not in layers:
            continue
        holders = biases.get(id(getattr(module, "bias", None)), [])
        if len(set(holders)) > 1:
            others = ", ".join(sorted(set(holders) - {str(node.target)}))
            logger.warning("bias_correction: %s shares its bias with %s (tied); not corrected", node.target, others)
            continue
        chosen.setdefault(str(node.target), (node.name, module, quantizer))
    return chosen


@contextmanager
def recording_input_means(model: fx.GraphModule, layers: Sequence[str] | None = None) -> Iterator[dict[str, list[Any]]]:
    """While open, each correctable layer's input summed per input channel over the passes run (``target ->
    [sum, count]``): what :func:`fast_bias_correction` reads, recorded during the calibration pass."""
    sums: dict[str, list[Any]] = {}
    handles = []

    def recorder(target: str, module: nn.Module) -> Any:
        def hook(_: nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0].detach()
            channel = x.dim() - 1 if isinstance(module, nn.Linear) else 1
            dims = [d for d in range(x.dim()) if d != channel]
            entry = sums.setdefault(target, [torch.zeros(x.shape[channel], dtype=torch.float64, device=x.device), 0])
            entry[0] += x.sum(dim=dims)  # in x's precision: a float64 reduction is an order of magnitude slower
            entry[1] += x.numel() // x.shape[channel]

        return hook

    try:
        for target, (_, module, _) in _correctable(model, layers).items():
            handles.append(module.register_forward_pre_hook(recorder(target, module)))
        yield sums
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def fast_bias_correction(
    model: fx.GraphModule, input_sums: dict[str, list[Any]], layers: Sequence[str] | None = None
) -> dict[str, float]:
    """Correct each layer's bias for the error its quantized weight makes on the mean of its input (recorded by
    :func:`recording_input_means`, in float): ``(q(W) - W)`` applied to the per-channel input mean, each kernel
    tap reading the channel's mean (exact for 1x1 convolutions and linear layers; a padded border's zeros are not
    modelled). No pass of the quantized model; returns the largest per-channel correction of each layer."""
    corrected = {}
    chosen = _correctable(model, layers)
    unseen = sorted(name for target, (name, _, _) in chosen.items() if target not in input_sums)
    if unseen:
        logger.warning(
            "fast bias correction: %d layer(s) saw no input while recording (%s): not corrected",
            len(unseen),
            ", ".join(unseen[:5]),
        )
    for target, (name, module, quantizer) in chosen.items():
        if target not in input_sums:
            continue
        total, count = input_sums[target]
        weight = _weight(module)
        error = _on_channel_vector(module, quantizer(weight) - weight, total / max(count, 1))
        bias = _bias(module)
        if bias is None:
            module.bias = nn.Parameter(torch.zeros_like(error))
            bias = _bias(module)
        cast(Tensor, bias).sub_(error)
        corrected[name] = float(error.abs().max())
    logger.info("fast bias correction: %d layer(s)", len(corrected))
    return corrected


@torch.no_grad()
def bias_correction(model: fx.GraphModule, cali_data: Any, layers: Sequence[str] | None = None) -> dict[str, float]:
    """Correct the bias of each quantized layer for the mean error its quantized weight makes (see the module
    docstring); returns the largest per-channel correction of each layer.

    One forward pass of the quantized model: just before a layer runs, the error its quantized
    weight makes on the input it receives is measured and its bias corrected, so later layers see
    the earlier corrections (the layer-by-layer algorithm; a layer's error summed over positions is its weight's
    error applied to its input's sums, per channel and, for a convolution, per kernel tap: no pass of the layer).
    Batches of tensors that differ only in batch size are joined into one pass; other
    batches run one after another, each layer's correction then the running mean so far (later
    layers' inputs carry the corrections of the batches before).
    """
    batches = _joined(calibration_batches(cali_data))
    chosen = _correctable(model, layers)
    state: dict[str, list[Any]] = {}  # target -> [original bias, error sum, count]
    handles = []

    def corrector(target: str, module: nn.Module, quantizer: QuantizeBase) -> Any:
        def hook(_: nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0]
            weight = _weight(module)
            # the layer is linear in its weight: its error is the layer with the weight's error, and that summed
            # over positions is the weight's error applied to the input's sums (per tap); a pass where not modelled
            error_weight = quantizer(weight) - weight
            if isinstance(module, nn.Linear):
                rows = x.reshape(-1, x.shape[-1])
                summed = _on_channel_vector(module, error_weight, rows.sum(dim=0))
                count = len(rows)
            elif (taps := _tap_sums(module, x)) is not None:
                summed, count = _on_tap_sums(module, error_weight, taps[0]), taps[1]
            else:
                summed, count = _channel_sums(module, _pre_activation(module, x, error_weight))
            if target not in state:
                bias = _bias(module)
                if bias is None:
                    module.bias = nn.Parameter(torch.zeros_like(summed))
                original = cast(Tensor, _bias(module)).detach().clone()
                state[target] = [original, torch.zeros_like(summed), 0]
            entry = state[target]
            entry[1] += summed
            entry[2] += count
            cast(Tensor, _bias(module)).copy_(entry[0] - entry[1] / entry[2])

        return hook

    try:
        for target, (_, module, quantizer) in chosen.items():
            handles.append(module.register_forward_pre_hook(corrector(target, module, quantizer)))
        for batch in batches:
            call_with(model, batch)
    finally:
        for handle in handles:
            handle.remove()
    corrected = {}
    for target, (name, _, _) in chosen.items():
        if target in state:
            _, total, count = state[target]
            corrected[name] = float((total / count).abs().max())
    logger.info("bias correction: %d layer(s)", len(corrected))
    return corrected
