"""Switch a model's fake quantizers between calibration, quantization and float.

Every function walks any module tree (a prepared GraphModule or a hand-built
model), names each quantizer after its qualified module name (so errors can
point at it), and returns nothing. ``enable_quantization`` calibrates weight
quantizers that never saw data on their own weights; one whose activation
quantizers never saw data makes its next forward raise :class:`UncalibratedError`
naming them (unless they were calibrated, or a calibrated state dict loaded, by then).

Example:
    >>> import torch
    >>> from mqbench.fake_quantize import FixedFakeQuantize
    >>> from mqbench.utils.state import enable_calibration, enable_quantization
    >>> model = torch.nn.Sequential(FixedFakeQuantize(quant_min=0, quant_max=255))
    >>> enable_calibration(model); _ = model(torch.rand(8))
    >>> enable_quantization(model)
    >>> int(model[0].observer_enabled[0]), int(model[0].fake_quant_enabled[0])
    (0, 1)
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol, cast

import torch
from torch import Tensor, nn

from mqbench.utils.role import ROLE_ATTRIBUTE, QuantizerRole

__all__ = [
    "Quantizer",
    "UncalibratedError",
    "all_switched_off",
    "calibrate_weights",
    "disable_all",
    "enable_all",
    "enable_calibration",
    "enable_calibration_quantization",
    "enable_calibration_woquantization",
    "enable_quantization",
    "integer_quantizers",
    "is_quantizer",
    "observe_weights",
    "quantizers",
    "reset_observers",
    "sync_qparams",
    "uncalibrated_quantizers",
]

_SHOWN = 10  # quantizer names an error lists before "and N more"


class UncalibratedError(RuntimeError):
    """Quantizers whose observers never saw a tensor, asked to quantize (a forward, or a deployment)."""


class Quantizer(Protocol):
    """What these switches need of a fake quantizer (``mqbench.fake_quantize.QuantizeBase`` has it all).

    Written here as a protocol so that this module depends on no quantizer class.
    """

    name: str
    fake_quant_enabled: Tensor
    observer_enabled: Tensor
    activation_post_process: nn.Module

    def enable_observer(self, enabled: bool = True) -> None: ...

    def enable_fake_quant(self, enabled: bool = True) -> None: ...


_NEEDED = ("fake_quant_enabled", "observer_enabled", "activation_post_process", "enable_observer", "enable_fake_quant")


def is_quantizer(module: nn.Module) -> bool:
    """Whether ``module`` is a fake quantizer: it has the switches and state of :class:`Quantizer`."""
    return all(hasattr(module, attribute) for attribute in _NEEDED) and isinstance(module.fake_quant_enabled, Tensor)


def quantizers(model: nn.Module) -> Iterator[tuple[str, Quantizer]]:
    """Every fake quantizer in ``model`` with its qualified name (which it is also given)."""
    for name, module in model.named_modules():
        if is_quantizer(module):
            quantizer = cast(Quantizer, module)
            quantizer.name = name
            yield name, quantizer


def reset_observers(model: nn.Module) -> None:
    """Every quantizer's observer forgets what it has seen: the next tensor it observes starts its statistics (a
    model calibrated again, after its weights or inputs changed, gets ranges of the new values only)."""
    for _, quantizer in quantizers(model):
        count = getattr(quantizer.activation_post_process, "num_batches", None)
        if isinstance(count, Tensor):
            count.zero_()


def sync_qparams(model: nn.Module) -> None:
    """Every quantizer's qparams computed from what its observer has seen, where the observer deferred them (a
    histogram observer calibrating without quantizing; see ``QuantizeBase``): what reads the scales
    themselves, not through a forward or the switches, calls this first."""
    for _, quantizer in quantizers(model):
        sync = getattr(quantizer, "sync_qparams", None)
        if callable(sync):
            sync()


def uncalibrated_quantizers(model: nn.Module) -> list[str]:
    """Quantizers that quantize (fake quant on) with observers off that never saw a tensor."""
    return [
        name
        for name, quantizer in quantizers(model)
        if bool(quantizer.fake_quant_enabled[0])
        and not bool(quantizer.observer_enabled[0])
        and not getattr(quantizer.activation_post_process, "calibrated", True)
    ]


def integer_quantizers(model: nn.Module, args: Sequence[Any], kwargs: dict[str, Any] | None = None) -> list[str]:
    """The quantizers that read only integer tensors (position ids, indices) when ``model`` runs on ``args``.

    A fake quantizer passes an integer tensor through unchanged and its observer never sees it: such a
    quantizer has nothing to calibrate and nothing to deploy. Found by one float forward (every
    quantizer off; the model's own forward hooks are not run).
    """
    floating: dict[str, set[bool]] = {}
    handles = []
    with all_switched_off(model) as found:
        for name, quantizer in found.items():

            def record(module: nn.Module, inputs: tuple[Any, ...], name: str = name) -> None:
                if inputs and isinstance(inputs[0], Tensor):
                    floating.setdefault(name, set()).add(inputs[0].is_floating_point())

            handles.append(cast(nn.Module, quantizer).register_forward_pre_hook(record))
        try:
            with torch.no_grad():
                model.forward(*args, **(kwargs or {}))
        finally:
            for handle in handles:
                handle.remove()
    return [name for name, kinds in floating.items() if kinds == {False}]


def calibrate_weights(model: nn.Module, skip: Collection[Tensor] = ()) -> list[str]:
    """Calibrate every enabled weight quantizer that has observed nothing on its own weight (weights need no data),
    but those of the weights in ``skip`` (weights not loaded yet); the names calibrated."""
    done = []
    skipped = {id(tensor) for tensor in skip}
    for name, module in model.named_modules():
        quantizer = getattr(module, "weight_fake_quant", None)
        weight = getattr(module, "weight", None)
        if quantizer is None or not is_quantizer(quantizer) or not isinstance(weight, Tensor):
            continue
        if id(weight) in skipped or weight.is_meta:
            continue
        if not bool(quantizer.fake_quant_enabled[0]) or getattr(quantizer.activation_post_process, "calibrated", True):
            continue
        observer = bool(quantizer.observer_enabled[0])
        quantizer.enable_observer()
        with torch.no_grad():
            quantizer(weight.detach())
        quantizer.enable_observer(observer)
        done.append(f"{name}.weight_fake_quant")
    return done


def observe_weights(model: nn.Module) -> bool:
    """Every quantizer whose observer is on observes the weight it quantizes, read from its layer with no data
    (``weight_to_quantize``: the QAT layers; the folded weight of one that folds BatchNorm). True when done;
    False, having observed nothing, where one cannot be (it is not a layer's ``weight_fake_quant``, its layer
    does not say what it quantizes, or the weight is not loaded yet): then a forward pass calibrates them."""
    layers: dict[int, Any] = {}
    for module in model.modules():
        quantizer = getattr(module, "weight_fake_quant", None)
        if isinstance(quantizer, nn.Module) and callable(getattr(module, "weight_to_quantize", None)):
            layers[id(quantizer)] = module
    pending = []
    for _, quantizer in quantizers(model):
        if not bool(quantizer.observer_enabled[0]):
            continue
        layer = layers.get(id(quantizer))
        weight = getattr(layer, "weight", None)
        if layer is None or not isinstance(weight, Tensor) or weight.is_meta:
            return False
        pending.append((quantizer, layer))
    with torch.no_grad():
        for quantizer, layer in pending:
            cast(nn.Module, quantizer)(layer.weight_to_quantize())
    return True


def _check_calibrated(model: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
    """Forward pre-hook of :func:`enable_quantization`: fail before the first layer, naming every culprit."""
    missing = uncalibrated_quantizers(model)
    if missing:  # quantizers of integer tensors have nothing to calibrate
        integer = set(integer_quantizers(model, args, kwargs))
        missing = [name for name in missing if name not in integer]
    if missing:
        shown = ", ".join(missing[:_SHOWN]) + (f" and {len(missing) - _SHOWN} more" if len(missing) > _SHOWN else "")
        raise UncalibratedError(
            f"{len(missing)} quantizer(s) quantize but were never calibrated: {shown}. Calibrate first: "
            "mqbench.utils.state.enable_calibration(model), run forward passes on calibration data, then "
            "enable_quantization(model) (or load a calibrated state dict)."
        )
    for key, hook in list(model._forward_pre_hooks.items()):  # checked once: the model is calibrated
        if hook is _check_calibrated:
            del model._forward_pre_hooks[key]
            model._forward_pre_hooks_with_kwargs.pop(key, None)


# MQBench's selectors of one kind of quantizer (its ``quantizer_type`` strings), read as the role prepare wrote
_ROLE_SELECTORS = {
    "weight_fake_quant": "weight",
    "act_fake_quant": "activation",
    "post_act_fake_quantizer": "activation",
}


def _selected(name: str, quantizer: object, quantizer_type: str | None) -> bool:
    """Whether ``quantizer_type`` selects this quantizer: a kind by the role prepare wrote on it, any other string
    (or a quantizer prepare did not create) by its name."""
    if quantizer_type is None:
        return True
    kind = _ROLE_SELECTORS.get(quantizer_type)
    role = getattr(quantizer, ROLE_ATTRIBUTE, None)
    if kind is not None and isinstance(role, QuantizerRole):
        return role.kind == kind
    return quantizer_type in name


def _set(model: nn.Module, observer: bool, fake_quant: bool, quantizer_type: str | None = None) -> None:
    for name, quantizer in quantizers(model):
        selected = _selected(name, quantizer, quantizer_type)
        quantizer.enable_observer(observer and selected)
        quantizer.enable_fake_quant(fake_quant and selected)


def enable_calibration(model: nn.Module) -> None:
    """Observers on, fake quantization off: the model computes in float and records ranges."""
    _set(model, observer=True, fake_quant=False)


def enable_quantization(model: nn.Module) -> None:
    """Observers off, fake quantization on: the model simulates the quantized hardware.

    Weight quantizers that never saw data calibrate on their own weights now (a weight-only model rounds to
    nearest with no calibration data); activation quantizers that never saw data have no
    parameters to quantize with: the next forward raises :class:`UncalibratedError` naming them.
    """
    _set(model, observer=False, fake_quant=True)
    calibrate_weights(model)
    installed = any(hook is _check_calibrated for hook in model._forward_pre_hooks.values())
    if not installed and uncalibrated_quantizers(model):
        model.register_forward_pre_hook(_check_calibrated, with_kwargs=True)


def disable_all(model: nn.Module) -> None:
    """Observers and fake quantization off: the float model."""
    _set(model, observer=False, fake_quant=False)


def enable_all(model: nn.Module) -> None:
    """Observers and fake quantization on (calibrate while quantizing)."""
    _set(model, observer=True, fake_quant=True)


def enable_calibration_woquantization(model: nn.Module, quantizer_type: str = "fake_quant") -> None:
    """Calibrate only the quantizers ``quantizer_type`` selects, without quantizing.

    ``"weight_fake_quant"`` selects the weight quantizers and ``"act_fake_quant"`` the activation quantizers (by
    the role prepare wrote on each; a quantizer without one by its name); any other string the quantizers whose
    name contains it. The others are
    switched off entirely.
    """
    _set(model, observer=True, fake_quant=False, quantizer_type=quantizer_type)


def enable_calibration_quantization(model: nn.Module, quantizer_type: str = "fake_quant") -> None:
    """Calibrate and quantize the quantizers ``quantizer_type`` selects (as for
    :func:`enable_calibration_woquantization`); the others are off."""
    _set(model, observer=True, fake_quant=True, quantizer_type=quantizer_type)


@contextmanager
def all_switched_off(model: nn.Module) -> Iterator[dict[str, Quantizer]]:
    """Every quantizer of ``model`` by name, observers and fake quantization off (the float model); each
    quantizer's switches are put back as they were on exit, whatever the block switched."""
    found = dict(quantizers(model))
    saved = {name: (bool(q.observer_enabled[0]), bool(q.fake_quant_enabled[0])) for name, q in found.items()}
    try:
        for quantizer in found.values():
            quantizer.enable_observer(False)
            quantizer.enable_fake_quant(False)
        yield found
    finally:
        for name, (observer, fake_quant) in saved.items():
            found[name].enable_observer(observer)
            found[name].enable_fake_quant(fake_quant)
