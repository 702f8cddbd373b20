"""Deployment: merge BN, strip fake quantization into a QParamTable, write and verify artifacts."""

from mqbench.qparams import QParamTable, TensorQParams

__all__ = ["QParamTable", "TensorQParams"]
