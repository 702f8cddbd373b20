"""MQBench's older import path of reconstruction PTQ (its ImageNet example imports it from here).

Example:
    >>> from mqbench.ptq_reconstruction import ptq_reconstruction
    >>> from mqbench.advanced_ptq import ptq_reconstruction as same
    >>> ptq_reconstruction is same
    True
"""

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
    "extract_block",
    "extract_layer",
    "extract_subgraph",
    "find_num_nodes",
    "lp_loss",
    "ptq_reconstruction",
    "save_inp_oup_data",
    "subgraph_reconstruction",
]
