"""MQBench's module path for the STPU deploy step (implemented in :mod:`mqbench.deploy.stepwise`)."""

from mqbench.deploy.stepwise import STPU_process, remove_fakequantize_and_collect_params_stpu

__all__ = ["STPU_process", "remove_fakequantize_and_collect_params_stpu"]
