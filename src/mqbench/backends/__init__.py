"""Hardware backends as data: ``BackendSpec``, the registry and the read-only ``ParamsTable``."""

from mqbench.backends.registry import BackendRegistry, BackendType, ParamsTable, register_backend, resolve_backend
from mqbench.backends.spec import OP_KINDS, BackendSpec, Placement, PTQRecipe, QuantizerSpec

__all__ = [
    "OP_KINDS",
    "BackendRegistry",
    "BackendSpec",
    "BackendType",
    "PTQRecipe",
    "ParamsTable",
    "Placement",
    "QuantizerSpec",
    "register_backend",
    "resolve_backend",
]
