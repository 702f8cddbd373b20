"""Integer reference modules (``nnq``): what a converted model runs, exactly as int8 hardware computes it.

Float tensors in and out; inside, integers: the input quantized with its parameters, int8 /
uint8 weights (``weight_int``), an int32 bias on the accumulator grid (``bias_int``), exact
integer accumulation, fixed-point requantization to the output grid, ReLU as an integer
clamp. ``forward_integer`` exposes the integers. The kernels live in
:mod:`mqbench.nn.quantized.functional` and are shared with :mod:`mqbench.deploy.reference`.

* layers (:mod:`.linear`, :mod:`.conv`): ``Linear``, ``LinearReLU``, ``Conv1d/2d/3d``,
  ``ConvReLU1d/2d/3d``, ``ConvTranspose2d``, ``ConvTransposeReLU2d``, each with
  ``from_float(module, input_qparams, weight_qparams, output_qparams)`` and
  ``from_observed(qat_module, input_quantizer, output_quantizer)``;
* ops (:mod:`.elementwise`): ``Add``, ``Mul`` (both with ``relu=``) and ``Cat``.

Example:
    >>> import numpy as np
    >>> import torch
    >>> from mqbench.qparams import TensorQParams
    >>> from mqbench.nn import quantized as nnq
    >>> grid = TensorQParams(np.array([0.25]), np.array([2]), 0, 255)
    >>> mul = nnq.Mul(grid, grid, TensorQParams(np.array([0.125]), np.array([0]), -128, 127))
    >>> mul(torch.tensor([1.0, -0.5]), torch.tensor([0.75, 0.5])).tolist()
    [0.75, -0.25]
"""

from mqbench.nn.quantized import functional
from mqbench.nn.quantized.base import QuantizedModule, check_qparams, qparams_from_quantizer
from mqbench.nn.quantized.conv import (
    Conv1d,
    Conv2d,
    Conv3d,
    ConvReLU1d,
    ConvReLU2d,
    ConvReLU3d,
    ConvTranspose2d,
    ConvTransposeReLU2d,
)
from mqbench.nn.quantized.elementwise import Add, Cat, Mul
from mqbench.nn.quantized.linear import Linear, LinearReLU
from mqbench.nn.quantized.weighted import WeightedQuantizedModule, integer_container, integer_module_for

__all__ = [
    "Add",
    "Cat",
    "Conv1d",
    "Conv2d",
    "Conv3d",
    "ConvReLU1d",
    "ConvReLU2d",
    "ConvReLU3d",
    "ConvTranspose2d",
    "ConvTransposeReLU2d",
    "Linear",
    "LinearReLU",
    "Mul",
    "QuantizedModule",
    "WeightedQuantizedModule",
    "check_qparams",
    "functional",
    "integer_container",
    "integer_module_for",
    "qparams_from_quantizer",
]
