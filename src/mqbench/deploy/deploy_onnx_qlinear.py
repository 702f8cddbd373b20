"""MQBench's module path for the onnxruntime QLinear deploy step (implemented in :mod:`mqbench.deploy.stepwise`)."""

from mqbench.deploy.stepwise import ONNXQLinearPass

__all__ = ["ONNXQLinearPass"]
