"""MQBench's module path for the linear formats' deploy step (TensorRT, SNPE, PPL, Vitis; see :mod:`.stepwise`)."""

from mqbench.deploy.stepwise import LinearQuantizer_process, remove_fakequantize_and_collect_params

__all__ = ["LinearQuantizer_process", "remove_fakequantize_and_collect_params"]
