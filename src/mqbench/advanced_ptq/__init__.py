"""Reconstruction PTQ with MQBench's API: ``ptq_reconstruction(model, cali_data, config)``.

AdaRound (``pattern: layer``), BRECQ (``pattern: block``) and QDrop (``pattern: block``,
``prob < 1`` with QDropFakeQuantize activations) on a model from ``prepare_by_platform``,
calibrated first. See :mod:`mqbench.advanced_ptq.reconstruction` for the algorithm and
:mod:`mqbench.advanced_ptq.units` for how units are found.
"""

from mqbench.advanced_ptq.awq import AWQ_DEFAULTS, awq
from mqbench.advanced_ptq.calibration import calibrate
from mqbench.advanced_ptq.correction import (
    bias_correction,
    cross_layer_equalization,
    fast_bias_correction,
    recording_input_means,
)
from mqbench.advanced_ptq.gptq import GPTQ_DEFAULTS, gptq
from mqbench.advanced_ptq.mqbench_api import (
    USE_DDP,
    USE_LINK,
    CosineTempDecay,
    LossFunction,
    extract_block,
    extract_layer,
    extract_subgraph,
    find_cur_node,
    find_num_nodes,
    find_used_times,
    get_io_of_block,
    insert_fake_modules,
    layer_has_weights,
    lp_loss,
    node2modules,
    prepare_fp_and_quant_model_for_ptq,
    qnode2fpnode,
    save_inp_oup_data,
    subgraph_reconstruction,
    tensor_detach,
    to_device,
)
from mqbench.advanced_ptq.reconstruction import (
    CONFIG_DEFAULTS,
    LinearTempDecay,
    ReconstructionConfig,
    ptq_reconstruction,
)
from mqbench.advanced_ptq.rotation import ROTATION_DEFAULTS, hadamard_rotation
from mqbench.advanced_ptq.smoothing import ALPHAS, ChannelScale, restore_smoothing, smooth_quant
from mqbench.advanced_ptq.units import Unit, cut_points, find_units
from mqbench.utils.lazy_weights import attach_weights, materialize, offloaded_weights

__all__ = [
    "ALPHAS",
    "AWQ_DEFAULTS",
    "CONFIG_DEFAULTS",
    "GPTQ_DEFAULTS",
    "ROTATION_DEFAULTS",
    "USE_DDP",
    "USE_LINK",
    "ChannelScale",
    "CosineTempDecay",
    "LinearTempDecay",
    "LossFunction",
    "ReconstructionConfig",
    "Unit",
    "attach_weights",
    "awq",
    "bias_correction",
    "calibrate",
    "cross_layer_equalization",
    "cut_points",
    "extract_block",
    "extract_layer",
    "extract_subgraph",
    "fast_bias_correction",
    "find_cur_node",
    "find_num_nodes",
    "find_units",
    "find_used_times",
    "get_io_of_block",
    "gptq",
    "hadamard_rotation",
    "insert_fake_modules",
    "layer_has_weights",
    "lp_loss",
    "materialize",
    "node2modules",
    "offloaded_weights",
    "prepare_fp_and_quant_model_for_ptq",
    "ptq_reconstruction",
    "qnode2fpnode",
    "recording_input_means",
    "restore_smoothing",
    "save_inp_oup_data",
    "smooth_quant",
    "subgraph_reconstruction",
    "tensor_detach",
    "to_device",
]
