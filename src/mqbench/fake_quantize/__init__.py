"""Fake quantizers: simulate a backend's integer arithmetic in floating point.

``FakeQuantizeDict`` maps class names to classes; ``register_fake_quantize``
adds a user class so configurations can name it.

Example:
    >>> from mqbench.fake_quantize import FakeQuantizeDict
    >>> FakeQuantizeDict["FixedFakeQuantize"].__name__
    'FixedFakeQuantize'
"""

from __future__ import annotations

from mqbench.fake_quantize.adaround import AdaRoundFakeQuantize
from mqbench.fake_quantize.dorefa import DoReFaFakeQuantize
from mqbench.fake_quantize.dsq import DSQFakeQuantize
from mqbench.fake_quantize.fixed import FixedFakeQuantize
from mqbench.fake_quantize.fp8 import FP8FakeQuantize
from mqbench.fake_quantize.lsq import LearnableFakeQuantize
from mqbench.fake_quantize.nnie import NNIEFakeQuantize
from mqbench.fake_quantize.pact import PACTFakeQuantize
from mqbench.fake_quantize.qdrop import QDropFakeQuantize
from mqbench.fake_quantize.quantize_base import QuantizeBase
from mqbench.fake_quantize.tqt import TqtFakeQuantize
from mqbench.utils.registry import Registry

__all__ = [
    "AdaRoundFakeQuantize",
    "DSQFakeQuantize",
    "DoReFaFakeQuantize",
    "FP8FakeQuantize",
    "FakeQuantizeDict",
    "FixedFakeQuantize",
    "LearnableFakeQuantize",
    "NNIEFakeQuantize",
    "PACTFakeQuantize",
    "QDropFakeQuantize",
    "QuantizeBase",
    "TqtFakeQuantize",
    "register_fake_quantize",
]

FakeQuantizeDict: Registry[type[QuantizeBase]] = Registry(
    "fake quantizer",
    {
        cls.__name__: cls
        for cls in (
            FixedFakeQuantize,
            LearnableFakeQuantize,
            PACTFakeQuantize,
            DoReFaFakeQuantize,
            DSQFakeQuantize,
            TqtFakeQuantize,
            NNIEFakeQuantize,
            AdaRoundFakeQuantize,
            QDropFakeQuantize,
            FP8FakeQuantize,
        )
    },
)


def register_fake_quantize(
    cls: type[QuantizeBase], name: str | None = None, replace: bool = False
) -> type[QuantizeBase]:
    """Make ``cls`` nameable in configurations (usable as a decorator)."""
    if not (isinstance(cls, type) and issubclass(cls, QuantizeBase)):
        raise ValueError(f"register_fake_quantize expects a QuantizeBase subclass, got {cls!r}")
    return FakeQuantizeDict.register(cls, name, replace)
