"""MQBench's module path for the NNIE deploy step (implemented in :mod:`mqbench.deploy.stepwise`)."""

from mqbench.deploy.stepwise import NNIE_process, remove_fakequantize_and_collect_params_nnie

__all__ = ["NNIE_process", "remove_fakequantize_and_collect_params_nnie"]
