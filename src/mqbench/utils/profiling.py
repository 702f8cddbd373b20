"""MQBench's ``mqbench.utils.profiling``: the per-layer profile, implemented in :mod:`mqbench.advanced_ptq.profiling`
(it runs the model) and read from there on first use, so that the utilities, which every module imports, import
nothing above them.

Example:
    >>> from mqbench.utils.profiling import profiling
    >>> profiling.__module__
    'mqbench.advanced_ptq.profiling'
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names, for readers and type checkers; at run time each is read on first use
    from mqbench.advanced_ptq.profiling import (
        QUANT_FUNCTION_TYPE,
        QUANT_MODULE_TYPE,
        LayerError,
        ProfileTable,
        ProfileUnit,
        cosine,
        find_units,
        node2modules,
        profile_layers,
        profile_summary,
        profiling,
        to_device,
        update_model_with_dummy_module,
    )

__all__ = [
    "QUANT_FUNCTION_TYPE",
    "QUANT_MODULE_TYPE",
    "LayerError",
    "ProfileTable",
    "ProfileUnit",
    "cosine",
    "find_units",
    "node2modules",
    "profile_layers",
    "profile_summary",
    "profiling",
    "to_device",
    "update_model_with_dummy_module",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        import importlib

        return getattr(importlib.import_module("mqbench.advanced_ptq.profiling"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
