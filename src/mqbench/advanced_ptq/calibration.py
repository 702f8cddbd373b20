"""Post-training calibration as MQBench runs it before reconstruction, with the backend's recipe.

A backend's :class:`~mqbench.backends.PTQRecipe` (its spec's ``ptq_recipe``) says what calibration
does by default: the activation observer (a clipping one where the user kept the backend's
default), cross-layer equalization first, bias correction after; the spec's
``smooth_linear_inputs`` adds SmoothQuant's outlier migration for transformers.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from mqbench.prepare_by_platform import prepare_by_platform
    >>> from mqbench.advanced_ptq import calibrate
    >>> from mqbench.advanced_ptq.calibration import recipe_of
    >>> _ = torch.manual_seed(0)
    >>> qmodel = prepare_by_platform(nn.Sequential(nn.Linear(4, 4), nn.ReLU()).eval(), "tensorrt")
    >>> recipe_of(qmodel).describe()
    'activations calibrated with PercentileObserver'
    >>> _ = calibrate(qmodel, [torch.randn(16, 4)])  # activation scales from the 99.99th percentile of |x|

The recipe's observer serves the calibration pass; afterwards each quantizer holds its backend's
observer again (with the scales calibrated), so the state dict loads into a freshly prepared model.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any, cast

import torch
from torch import fx, nn

from mqbench.advanced_ptq.correction import (
    bias_correction,
    cross_layer_equalization,
    fast_bias_correction,
    recording_input_means,
)
from mqbench.advanced_ptq.pipeline import one_pass
from mqbench.advanced_ptq.reconstruction import calibration_batches, call_with
from mqbench.advanced_ptq.smoothing import replays_exactly, smooth_quant, smoothing_groups
from mqbench.backends.registry import ParamsTable
from mqbench.backends.spec import BackendSpec, PTQRecipe
from mqbench.custom_quantizer.ops import normalizes_layers
from mqbench.custom_quantizer.plan import plan_of
from mqbench.observer import ObserverDict
from mqbench.observer.base import ObserverBase
from mqbench.utils.host import int8_pairs_saturate
from mqbench.utils.logger import logger
from mqbench.utils.role import role_of
from mqbench.utils.state import (
    enable_calibration_woquantization,
    enable_quantization,
    observe_weights,
    quantizers,
    reset_observers,
)

__all__ = [
    "calibrate",
    "narrow_weights_after_signed_inputs",
    "put_back_observers",
    "recipe_of",
    "use_activation_observer",
]


def _spec(model: fx.GraphModule) -> BackendSpec | None:
    plan = plan_of(model)
    if plan is None:
        return None
    return plan.spec if plan.spec is not None else ParamsTable.get(plan.backend)


_AFFINE = (torch.per_tensor_affine, torch.per_channel_affine)

# ops between an input quantizer and the layer reading it that keep its values (and so its sign)
_KEEPS_VALUES = frozenset({"flatten", "reshape", "view", "dropout", "contiguous"})


def _reads_signed_input(node: fx.Node, modules: dict[str, nn.Module]) -> bool:
    source = node.args[0] if node.args else None
    for _ in range(4):
        if not isinstance(source, fx.Node):
            return False
        module = modules.get(str(source.target)) if source.op == "call_module" else None
        if module is not None and hasattr(module, "activation_post_process"):
            quantizer = cast(Any, module)  # signed, or asymmetric: a runtime's u8 values fill the grid around its
            return int(quantizer.quant_min) < 0 or quantizer.qscheme in _AFFINE  # zero point, up to 255
        name = getattr(source.target, "__name__", str(source.target))
        if type(module).__name__.lower() not in _KEEPS_VALUES and name not in _KEEPS_VALUES:
            return False
        source = source.args[0] if source.args else None
    return False


def narrow_weights_after_signed_inputs(model: fx.GraphModule) -> list[str]:
    """Put the 8-bit signed weights of every layer whose input quantizer is signed or asymmetric on the 7-bit grid
    [-64, 63] (an unsigned symmetric input, after a ReLU, keeps 8-bit weights).

    Returns the layers changed. Their weight quantizers observe again at the next calibration (their
    ranges are computed for the new grid). See ``PTQRecipe.guard_pair_saturation``.
    """
    modules = dict(model.named_modules())
    narrowed = []
    for node in model.graph.nodes:
        module = modules.get(str(node.target)) if node.op == "call_module" else None
        quantizer = getattr(module, "weight_fake_quant", None)
        if quantizer is None or not hasattr(quantizer, "activation_post_process"):
            continue
        low, high = int(quantizer.quant_min), int(quantizer.quant_max)
        if low >= 0 or high - low + 1 not in (255, 256) or not _reads_signed_input(node, modules):
            continue
        for owner in (quantizer, quantizer.activation_post_process):
            owner.quant_min, owner.quant_max = -64, 63
        narrowed.append(str(node.target))
    return narrowed


def recipe_of(model: fx.GraphModule) -> PTQRecipe:
    """The recipe calibration applies to ``model`` by default: its backend's ``ptq_recipe``, or its
    ``transformer_recipe`` for a model with LayerNorm or RMSNorm (see :func:`calibrate`); plain calibration for a
    model of unknown origin."""
    spec = _spec(model)
    if spec is None:
        return PTQRecipe()
    return spec.transformer_recipe if normalizes_layers(model) else spec.ptq_recipe


def use_activation_observer(
    model: nn.Module, observer: str | type, only_replacing: type | None = None
) -> dict[str, ObserverBase]:
    """Give every activation quantizer a fresh ``observer`` on the same grid; returns the observers replaced, by
    quantizer name (:func:`put_back_observers` restores them).

    ``only_replacing``: change only quantizers whose observer is exactly this class (the backend's
    default), keeping one the user chose. Run it before calibrating: recorded statistics are dropped.
    """
    cls = ObserverDict.resolve(observer)
    replaced = {}
    for name, quantizer in quantizers(model):
        old = getattr(quantizer, "activation_post_process", None)
        if role_of(name, cast(nn.Module, quantizer)).kind != "activation" or not isinstance(old, ObserverBase):
            continue
        if type(old) is cls or (only_replacing is not None and type(old) is not only_replacing):
            continue
        new = cls(
            dtype=old.dtype,
            qscheme=old.qscheme,
            quant_min=old.quant_min,
            quant_max=old.quant_max,
            ch_axis=old.ch_axis,
            pot_scale=old.pot_scale,
            eps=old.eps,
        )
        new.name = old.name
        quantizer.activation_post_process = new.to(old.min_val.device)
        replaced[name] = old
    return replaced


def put_back_observers(model: nn.Module, replaced: dict[str, ObserverBase]) -> None:
    """Put the observers :func:`use_activation_observer` replaced back, with the range the replacements recorded.

    The quantizers keep the scales calibrated with the replacements; the model's state dict then has
    the layout of a freshly prepared one, so it loads into one (``mqbench verify --state-dict``).
    """
    for name, quantizer in quantizers(model):
        old = replaced.get(name)
        if old is None:
            continue
        sync_qparams = getattr(quantizer, "sync_qparams", None)
        if sync_qparams is not None:  # the qparams of the replacement, computed before it goes
            sync_qparams()
        used = cast(ObserverBase, quantizer.activation_post_process)
        old.min_val, old.max_val = used.min_val.clone(), used.max_val.clone()
        old.num_batches = used.num_batches.clone()
        quantizer.activation_post_process = old


@torch.no_grad()
def calibrate(
    model: fx.GraphModule, cali_data: Any, smooth: bool | str | None = None, recipe: PTQRecipe | None = None
) -> fx.GraphModule:
    """MQBench's calibration before reconstruction, with the backend's recipe; returns ``model`` in quantization mode.

    The activation quantizers observe every batch while nothing is quantized, then the weight
    quantizers observe the weights (read from their layers; one batch runs them where a layer cannot say
    which tensor it quantizes), then every quantizer quantizes. What the
    observers saw before is forgotten: calibrating again replaces the ranges.
    ``recipe``: what to do around that (None: the recipe of the backend the model was prepared
    for, its spec's ``ptq_recipe``; ``PTQRecipe()``: plain calibration): the activation observer,
    cross-layer equalization before, bias correction after. By default a model with LayerNorm or RMSNorm gets
    the backend's ``transformer_recipe``, plain calibration unless the backend says otherwise (its
    ``smooth_linear_inputs`` still applies): a transformer's few outlier channels carry its meaning,
    and clipping them costs more than the finer grid gains (all-MiniLM-L6-v2 on TensorRT: mean
    embedding cosine 0.848 with the running min/max, 0.835 with the percentile; on PPL W8A16 0.989
    plain, 0.983 with equalization and bias correction).
    ``smooth``: first migrate activation outliers of linear inputs into the weights
    (:func:`~mqbench.advanced_ptq.smooth_quant`, strength the recipe's ``smooth_alpha``, else searched; in the
    calibration pass itself where the smoothed inputs' observers are running min/max ones); None
    does what the backend the model was prepared for does by default (its ``smooth_linear_inputs``: the NLP
    backends, or the recipe's ``smooth``); ``"after_norm"``
    smooths only the inputs a norm computes for linear layers alone, whose scales a Hugging Face checkpoint holds
    (folded into the norms' gains: the compressed-tensors folder, GGUF).
    """
    batches = calibration_batches(cali_data)
    spec = _spec(model)
    if recipe is None:
        recipe = recipe_of(model)
    if smooth is None:
        smooth = bool(spec is not None and spec.smooth_linear_inputs) or recipe.smooth
    replaced: dict[str, ObserverBase] = {}
    if recipe.activation_observer is not None:
        default = spec.activation.observer if spec is not None and spec.activation is not None else None
        replacing = ObserverDict.resolve(default) if default is not None else None
        replaced = use_activation_observer(model, recipe.activation_observer, only_replacing=replacing)
        logger.info("calibration: %d activation quantizer(s) use %s", len(replaced), recipe.activation_observer)
    if recipe.equalize:
        cross_layer_equalization(model)
    if smooth not in (True, False, "after_norm"):
        raise ValueError(f"smooth must be True, False, 'after_norm' or None, got {smooth!r}")
    fast = recipe.bias_correction and recipe.fast_bias_correction
    # one pass smooths and calibrates where the smoothed inputs' ranges follow from their per-channel extremes (and
    # no layer's float input is recorded, which the migration would change)
    merged = smooth is True and not fast and isinstance(model, fx.GraphModule)
    if merged:
        modules = dict(model.named_modules())
        merged = all(replays_exactly(modules[str(node.target)]) for node in smoothing_groups(model))
    if smooth and not merged:
        smooth_quant(model, batches, alpha=recipe.smooth_alpha, after_norm=smooth == "after_norm")
    reset_observers(model)  # a model calibrated before (then rotated, smoothed, ...) gets the ranges of now
    enable_calibration_woquantization(model, quantizer_type="act_fake_quant")
    recording: AbstractContextManager[dict[str, list[Any]]] = recording_input_means(model) if fast else nullcontext({})
    with recording as input_sums:
        if merged:
            smooth_quant(model, batches, alpha=recipe.smooth_alpha, calibrating=True)
        else:
            one_pass(model, batches)  # block by block on a transformer
    put_back_observers(model, replaced)
    if recipe.guard_pair_saturation and int8_pairs_saturate():
        narrowed = narrow_weights_after_signed_inputs(model)
        logger.info("calibration: 7-bit weights in %d layer(s) reading a signed input (no VNNI)", len(narrowed))
    enable_calibration_woquantization(model, quantizer_type="weight_fake_quant")
    if not observe_weights(model):  # a weight quantizer no layer reads out: it sees its tensor in a forward
        call_with(model, batches[0])
    enable_quantization(model)
    if fast:
        fast_bias_correction(model, input_sums)
    elif recipe.bias_correction:
        bias_correction(model, batches)
    return model
