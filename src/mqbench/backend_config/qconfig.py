"""QConfig: how to observe a quantized op's activations and weight (PyTorch's ``QConfig``).

A :class:`QConfig` holds two factories: ``activation`` builds the observer (or fake
quantizer) of the op's input and output, ``weight`` the one of its weight. Pass
classes or ``Class.with_args(...)`` factories, never instances.

Example:
    >>> import torch
    >>> from mqbench.backend_config import QConfig, default_weight_observer
    >>> from mqbench.observer import MinMaxObserver
    >>> activation = MinMaxObserver.with_args(quant_min=0, quant_max=127)
    >>> qconfig = QConfig(activation=activation, weight=default_weight_observer)
    >>> qconfig.activation().quant_max, qconfig.weight().dtype
    (127, torch.qint8)
    >>> QConfig(activation=MinMaxObserver(), weight=None)
    Traceback (most recent call last):
    ...
    ValueError: QConfig: activation is a MinMaxObserver instance; pass a factory such as MinMaxObserver.with_args(...)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, TypeAlias

import torch
from torch import nn

from mqbench.observer import MinMaxObserver
from mqbench.utils.factory import Factory

__all__ = [
    "ObserverFactory",
    "QConfig",
    "default_observer",
    "default_qconfig",
    "default_weight_observer",
]

ObserverFactory: TypeAlias = Callable[..., nn.Module]


def _check_factory(name: str, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, nn.Module):
        cls = type(value).__name__
        raise ValueError(f"QConfig: {name} is a {cls} instance; pass a factory such as {cls}.with_args(...)")
    if isinstance(value, type) and not issubclass(value, nn.Module):
        raise ValueError(f"QConfig: {name} must build an observer or fake quantizer module, got the class {value!r}")
    if not callable(value):
        raise ValueError(
            f"QConfig: {name} must be an observer factory (a class or Class.with_args(...)), got {value!r}"
        )


class _QConfigFields(NamedTuple):
    activation: ObserverFactory | None
    weight: ObserverFactory | None


class QConfig(_QConfigFields):
    """``QConfig(activation, weight)``: observer factories for an op's activations and weight.

    Either may be None (that tensor is left in float). The factories are built
    once per observed tensor; see :func:`mqbench.backend_config.observer_info` for
    how their settings are read without running them.
    """

    __slots__ = ()

    def __new__(cls, activation: ObserverFactory | None, weight: ObserverFactory | None) -> QConfig:
        _check_factory("activation", activation)
        _check_factory("weight", weight)
        return super().__new__(cls, activation, weight)


default_observer: Factory = MinMaxObserver.with_args(quant_min=0, quant_max=127)
"""quint8 min/max observer with the reduced range [0, 127] (static activations, mostly for debugging)."""

default_weight_observer: Factory = MinMaxObserver.with_args(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric)
"""qint8 min/max observer, per-tensor symmetric, range [-128, 127]."""

default_qconfig: QConfig = QConfig(activation=default_observer, weight=default_weight_observer)
"""``default_observer`` for activations and ``default_weight_observer`` for weights."""
