"""MQBench's module path of the transformer deploy step: the linear formats' step (see :mod:`.stepwise`)."""

from mqbench.deploy.stepwise import LinearQuantizer_process
from mqbench.deploy.stepwise import remove_fakequantize_and_collect_params as remove_fakequantize_and_collect_params_tf

__all__ = ["LinearQuantizer_process", "remove_fakequantize_and_collect_params_tf"]
