"""Observers: record tensor statistics and compute scale / zero point.

``ObserverDict`` maps class names to classes so configurations can name an
observer by string; ``register_observer`` adds a user class.

Example:
    >>> import torch
    >>> from mqbench.observer import ObserverDict, register_observer, ObserverBase
    >>> ObserverDict["MinMaxObserver"].__name__
    'MinMaxObserver'
    >>> class MyObserver(ObserverBase): ...
    >>> register_observer(MyObserver) is MyObserver
    True
"""

from __future__ import annotations

from mqbench.observer.base import NonFiniteInputError, ObserverBase
from mqbench.observer.histogram import HistogramObserver, KLDObserver, PercentileObserver
from mqbench.observer.minmax import (
    EMAMinMaxObserver,
    MeanMinMaxObserver,
    MinMaxFloorObserver,
    MinMaxObserver,
    PoTModeObserver,
)
from mqbench.observer.mse import EMAMSEObserver, MSEObserver
from mqbench.observer.signed_histogram import AffineHistogramObserver
from mqbench.observer.statistics import ClipStdObserver, EMAQuantileObserver, LSQObserver, LSQPlusObserver
from mqbench.utils.registry import Registry

__all__ = [
    "AffineHistogramObserver",
    "ClipStdObserver",
    "EMAMSEObserver",
    "EMAMinMaxObserver",
    "EMAQuantileObserver",
    "HistogramObserver",
    "KLDObserver",
    "LSQObserver",
    "LSQPlusObserver",
    "MSEObserver",
    "MeanMinMaxObserver",
    "MinMaxFloorObserver",
    "MinMaxObserver",
    "NonFiniteInputError",
    "ObserverBase",
    "ObserverDict",
    "PercentileObserver",
    "PoTModeObserver",
    "register_observer",
]

ObserverDict: Registry[type[ObserverBase]] = Registry(
    "observer",
    {
        cls.__name__: cls
        for cls in (
            MinMaxObserver,
            EMAMinMaxObserver,
            MeanMinMaxObserver,
            MinMaxFloorObserver,
            PoTModeObserver,
            EMAQuantileObserver,
            ClipStdObserver,
            LSQObserver,
            LSQPlusObserver,
            MSEObserver,
            EMAMSEObserver,
            HistogramObserver,
            KLDObserver,
            PercentileObserver,
            AffineHistogramObserver,
        )
    },
)


def register_observer(cls: type[ObserverBase], name: str | None = None, replace: bool = False) -> type[ObserverBase]:
    """Make ``cls`` nameable in configurations (usable as a decorator)."""
    if not (isinstance(cls, type) and issubclass(cls, ObserverBase)):
        raise ValueError(f"register_observer expects an ObserverBase subclass, got {cls!r}")
    return ObserverDict.register(cls, name, replace)
