"""MQBench's older module of layer-wise AdaRound: the helpers of :mod:`mqbench.advanced_ptq`.

``adaround(model, cali_data, config)`` is reconstruction one layer at a time
(``ptq_reconstruction`` with ``pattern: layer``).
"""

from __future__ import annotations

from typing import Any

from torch import fx

from mqbench.advanced_ptq import (
    USE_DDP,
    USE_LINK,
    CosineTempDecay,
    LinearTempDecay,
    LossFunction,
    extract_block,
    extract_layer,
    extract_subgraph,
    find_num_nodes,
    lp_loss,
    ptq_reconstruction,
    save_inp_oup_data,
    subgraph_reconstruction,
)

__all__ = [
    "USE_DDP",
    "USE_LINK",
    "CosineTempDecay",
    "LinearTempDecay",
    "LossFunction",
    "adaround",
    "extract_block",
    "extract_layer",
    "extract_subgraph",
    "find_num_nodes",
    "lp_loss",
    "save_inp_oup_data",
    "subgraph_reconstruction",
]


def adaround(model: fx.GraphModule, cali_data: Any, config: Any) -> fx.GraphModule:
    """AdaRound, layer by layer: ``ptq_reconstruction`` with ``pattern: layer``."""
    given = dict(config.items()) if hasattr(config, "items") else dict(vars(config))
    return ptq_reconstruction(model, cali_data, {**given, "pattern": "layer"})
