"""MQBench's module namespaces.

* :mod:`mqbench.nn.intrinsic` (``nni``): fused float modules (Conv + BN + ReLU, ...);
* :mod:`mqbench.nn.qat` (``nnqat``): QAT layers with a weight fake quantizer;
* :mod:`mqbench.nn.intrinsic.qat` (``nniqat``): QAT fused modules with simulated BN folding;
* :mod:`mqbench.nn.quantized` (``nnq``): integer reference modules (int8 weights, int32 bias,
  integer accumulation, fixed-point requantization).
"""

from mqbench.nn import intrinsic, qat, quantized
from mqbench.nn.intrinsic import qat as intrinsic_qat

__all__ = ["intrinsic", "intrinsic_qat", "qat", "quantized"]
