"""MQBench's module path for the Tengine deploy step (implemented in :mod:`mqbench.deploy.stepwise`)."""

from mqbench.deploy.stepwise import Tengine_process, remove_fakequantize_and_collect_params_tengine

__all__ = ["Tengine_process", "remove_fakequantize_and_collect_params_tengine"]
