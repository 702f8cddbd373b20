"""Reconstruction PTQ with MQBench's API: ``ptq_reconstruction(model, cali_data, config)``.

AdaRound (``pattern: layer``), BRECQ (``pattern: block``) and QDrop (``pattern: block``,
``prob < 1`` with QDropFakeQuantize activations) on a model from ``prepare_by_platform``,
calibrated first. See :mod:`mqbench.advanced_ptq.reconstruction` for the algorithm and
:mod:`mqbench.advanced_ptq.units` for how units are found.
"""

from mqbench.advanced_ptq.calibration import calibrate
from mqbench.advanced_ptq.correction import bias_correction, cross_layer_equalization
from mqbench.advanced_ptq.reconstruction import (
    CONFIG_DEFAULTS,
    LinearTempDecay,
    ReconstructionConfig,
    ptq_reconstruction,
)
from mqbench.advanced_ptq.smoothing import ALPHAS, ChannelScale, restore_smoothing, smooth_quant
from mqbench.advanced_ptq.units import Unit, cut_points, find_units

__all__ = [
    "ALPHAS",
    "CONFIG_DEFAULTS",
    "ChannelScale",
    "LinearTempDecay",
    "ReconstructionConfig",
    "Unit",
    "bias_correction",
    "calibrate",
    "cross_layer_equalization",
    "cut_points",
    "find_units",
    "ptq_reconstruction",
    "restore_smoothing",
    "smooth_quant",
]
