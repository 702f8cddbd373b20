"""MQBench's module path for the ONNX QNN (QLinear) deploy step (implemented in :mod:`mqbench.deploy.stepwise`)."""

from mqbench.deploy.stepwise import ONNXQNNPass

__all__ = ["ONNXQNNPass"]
