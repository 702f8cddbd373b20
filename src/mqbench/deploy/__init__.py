"""Deployment: merge BN, strip fake quantization into a QParamTable, write and verify artifacts.

MQBench's names of this package (``remove_fakequantize_and_collect_params`` and its per-format
variants, ``ONNXQLinearPass``, ``ONNXQNNPass``) come from :mod:`mqbench.deploy.stepwise`.
"""

from mqbench.deploy.stepwise import (
    ONNXQLinearPass,
    ONNXQNNPass,
    remove_fakequantize_and_collect_params,
    remove_fakequantize_and_collect_params_nnie,
    remove_fakequantize_and_collect_params_stpu,
    remove_fakequantize_and_collect_params_tengine,
    replace_fakequantize_and_collect_params_openvino,
)
from mqbench.qparams import QParamTable, TensorQParams

__all__ = [
    "ONNXQLinearPass",
    "ONNXQNNPass",
    "QParamTable",
    "TensorQParams",
    "remove_fakequantize_and_collect_params",
    "remove_fakequantize_and_collect_params_nnie",
    "remove_fakequantize_and_collect_params_stpu",
    "remove_fakequantize_and_collect_params_tengine",
    "replace_fakequantize_and_collect_params_openvino",
]
