"""MQBench's older module of the deploy step that removes the quantization nodes (``mqbench.convert_onnx``).

The step is :func:`mqbench.deploy.stepwise.remove_fakequantize_and_collect_params`; MQBench's ONNX
editing helpers of this module (``prepare_data``, ``parse_attrs``, ``OnnxPreprocess``, ...) edited
its own custom quantization nodes, which this package never writes (see ``tests/compat`` for the
names not provided).
"""

from mqbench.deploy.stepwise import (
    LinearQuantizer_process,
    NNIE_process,
    remove_fakequantize_and_collect_params,
    remove_fakequantize_and_collect_params_nnie,
)

__all__ = [
    "LinearQuantizer_process",
    "NNIE_process",
    "remove_fakequantize_and_collect_params",
    "remove_fakequantize_and_collect_params_nnie",
]
