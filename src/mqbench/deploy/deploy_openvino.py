"""MQBench's module path for the OpenVINO deploy step (implemented in :mod:`mqbench.deploy.stepwise`)."""

from mqbench.deploy.stepwise import OPENVINO_process, replace_fakequantize_and_collect_params_openvino

__all__ = ["OPENVINO_process", "replace_fakequantize_and_collect_params_openvino"]
