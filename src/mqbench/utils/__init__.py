"""Utilities: quantizer switches (:mod:`mqbench.utils.state`) and shared helpers.

As in MQBench, the helpers of :mod:`mqbench.utils.utils` are also names of this package (``from mqbench.utils import
deepcopy_graphmodule``), read from there on first use, so that importing a module of this package (which every
module does) imports nothing more.

Example:
    >>> import torch
    >>> from mqbench.utils import is_symmetric_quant
    >>> is_symmetric_quant(torch.per_tensor_symmetric)
    True
"""

from typing import Any

__all__ = [
    "USE_DDP",
    "USE_LINK",
    "deepcopy_graphmodule",
    "deepcopy_mixedmodule",
    "get_flattened_qconfig_dict",
    "getitem2node",
    "is_symmetric_quant",
    "is_tracing_state",
    "no_jit_trace",
    "pot_quantization",
    "replace_bn_to_syncbn",
    "sync_tensor",
    "topology_order",
]


def __getattr__(name: str) -> Any:
    if name in __all__:  # as mqbench.utils.registry reads MQBench's registries: by name, on first use
        import importlib

        return getattr(importlib.import_module("mqbench.utils.utils"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
