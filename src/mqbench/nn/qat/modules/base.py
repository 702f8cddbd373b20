"""What every QAT module shares: the weight fake quantizer, ``from_float`` and ``to_float``.

A QAT module is a subclass of its float layer (``isinstance(qat_conv, nn.Conv2d)`` holds)
that fake-quantizes its weight with ``weight_fake_quant`` on every forward. The
quantizer is built by calling a factory with no arguments, e.g.
``FixedFakeQuantize.with_args(observer=MinMaxObserver, ...)``.

``from_float(mod, weight_fake_quant_factory)`` takes the factory explicitly; for MQBench
compatibility it falls back to ``mod.qconfig.weight``. The new module holds copies of
the float module's parameters and buffers (it shares nothing with ``mod``).
"""

from __future__ import annotations

import contextvars
import copy
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar, cast

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from mqbench.nn.intrinsic.modules.fused import FusedModule
from mqbench.utils.fusion import layer_init_kwargs

__all__ = [
    "QATModule",
    "WeightFakeQuantFactory",
    "build_weight_fake_quant",
    "copy_layer_parameters",
    "resolve_weight_fake_quant_factory",
]

#: Builds a weight fake quantizer when called with no arguments.
WeightFakeQuantFactory = Callable[[], nn.Module]

QATModuleT = TypeVar("QATModuleT", bound="QATModule")


def resolve_weight_fake_quant_factory(
    mod: nn.Module, factory: WeightFakeQuantFactory | None, owner: str
) -> WeightFakeQuantFactory:
    """``factory`` if given, else ``mod.qconfig.weight``; ValueError naming the fix if neither exists."""
    if factory is None:
        qconfig = getattr(mod, "qconfig", None)
        factory = getattr(qconfig, "weight", None) if qconfig is not None else None
    if factory is None:
        raise ValueError(
            f"{owner}.from_float needs a weight fake-quantize factory: pass one, e.g. "
            f"{owner}.from_float(mod, weight_fake_quant_factory=FixedFakeQuantize.with_args(...)), "
            f"or set mod.qconfig to an object whose .weight is such a factory"
        )
    if not callable(factory):
        raise TypeError(f"{owner}: the weight fake-quantize factory must be callable, got {factory!r}")
    return factory


def build_weight_fake_quant(factory: WeightFakeQuantFactory, weight: Tensor) -> nn.Module:
    """Call ``factory()`` and place the quantizer on the weight's device (on the host for a weight on ``meta``,
    whose values come later: the quantizer's own state must hold values)."""
    if not callable(factory):
        raise TypeError(f"the weight fake-quantize factory must be callable, got {factory!r}")
    quantizer = factory()
    if not isinstance(quantizer, nn.Module):
        raise TypeError(f"the weight fake-quantize factory must build an nn.Module, got {type(quantizer).__name__}")
    return quantizer if weight.is_meta else quantizer.to(weight.device)


def copy_layer_parameters(target: nn.Module, source: nn.Module) -> None:
    """Copy ``weight`` and ``bias`` (values and ``requires_grad``) from ``source`` into ``target``."""
    for name in ("weight", "bias"):
        incoming = getattr(source, name, None)
        existing = getattr(target, name, None)
        if incoming is None and existing is None:
            continue
        if not isinstance(incoming, Tensor) or not isinstance(existing, Tensor) or incoming.shape != existing.shape:
            raise ValueError(
                f"cannot copy {name} of {type(source).__name__} into {type(target).__name__}: "
                f"{_describe(incoming)} vs {_describe(existing)}"
            )
        with torch.no_grad():
            existing.copy_(incoming)
        existing.requires_grad_(incoming.requires_grad)


def _describe(value: object) -> str:
    return f"shape {list(value.shape)}" if isinstance(value, Tensor) else repr(value)


# Set while from_float builds a module whose parameters it overwrites right after.
_SKIP_RESET: contextvars.ContextVar[bool] = contextvars.ContextVar("mqbench_qat_skip_reset", default=False)


class QATModule(nn.Module):
    """Mixin of every QAT module (listed first among the bases, before the float layer).

    Class attributes: ``_FLOAT_MODULE`` is the float module ``from_float`` accepts (a
    plain layer or a :class:`~mqbench.nn.intrinsic.FusedModule`); ``_FLOAT_LAYER`` the
    float layer type this module subclasses (``nn.Conv2d``, ...); ``_FLOAT_RELU_MODULE``
    is the fused float type ``to_float`` wraps the layer and its activation in (None
    for modules without an activation).
    """

    _FLOAT_MODULE: ClassVar[type[nn.Module]]
    _FLOAT_LAYER: ClassVar[type[nn.Module]]
    _FLOAT_RELU_MODULE: ClassVar[type[FusedModule] | None] = None
    is_quantization_leaf: ClassVar[bool] = True  # traced as one call
    ends_with_relu: ClassVar[bool] = False

    weight_fake_quant: nn.Module
    relu: nn.Module

    @classmethod
    def _layer_kwargs(cls, layer: nn.Module) -> dict[str, Any]:
        """Constructor arguments of the float layer ``layer`` (or of a QAT module like this one)."""
        return layer_init_kwargs(layer)

    @classmethod
    def from_float(
        cls: type[QATModuleT], mod: nn.Module, weight_fake_quant_factory: WeightFakeQuantFactory | None = None
    ) -> QATModuleT:
        """The QAT module equivalent to the float module ``mod``, with its weight quantized.

        ``mod`` is an instance of ``cls._FLOAT_MODULE``; the weights, bias, BatchNorm state and
        activation are copied over. The quantizer comes from ``weight_fake_quant_factory`` or,
        when that is None, from ``mod.qconfig.weight`` (ValueError if neither is given).
        """
        expected = cls._FLOAT_MODULE
        if not isinstance(mod, expected) or isinstance(mod, QATModule):
            raise TypeError(f"{cls.__name__}.from_float expects a float {expected.__name__}, got {type(mod).__name__}")
        factory = resolve_weight_fake_quant_factory(mod, weight_fake_quant_factory, cls.__name__)
        parts = list(mod) if isinstance(mod, FusedModule) else [mod]
        layer = parts[0]
        token = _SKIP_RESET.set(True)  # the weights are copied in next: skip the random init
        try:
            qat = cls(**cls._layer_kwargs(layer), weight_fake_quant_factory=factory)
        finally:
            _SKIP_RESET.reset(token)
        copy_layer_parameters(qat, layer)
        for part in parts[1:]:
            setattr(qat, "bn" if isinstance(part, _BatchNorm) else "relu", copy.deepcopy(part))
        qconfig = getattr(mod, "qconfig", None)
        if qconfig is not None:
            qat.qconfig = qconfig
        qat.train(mod.training)
        return qat

    def weight_to_quantize(self) -> Tensor:
        """The tensor ``weight_fake_quant`` quantizes on each forward, read without an input (its observer can see
        it with no data; :func:`mqbench.utils.state.observe_weights`): the weight. A subclass whose forward
        quantizes another tensor says which."""
        return cast(Tensor, self.weight)

    def reset_parameters(self) -> None:
        """The float layer's initialisation, skipped while :meth:`from_float` builds the module."""
        if not _SKIP_RESET.get():
            super().reset_parameters()  # type: ignore[misc]

    def _float_layer(self) -> nn.Module:
        """A plain float layer with this module's (unquantized) weights."""
        layer = self._FLOAT_LAYER(**self._layer_kwargs(self))
        copy_layer_parameters(layer, self)
        return layer

    def to_float(self) -> nn.Module:
        """The float module this QAT module simulates, without weight quantization.

        A plain layer, or the fused float module of the layer and a copy of its activation
        (BatchNorm variants return the layer with the BatchNorm folded in).
        """
        layer = self._float_layer()
        if self._FLOAT_RELU_MODULE is not None:
            layer = self._FLOAT_RELU_MODULE(layer, copy.deepcopy(self.relu))
        return layer.train(self.training)
