"""FrozenBatchNorm2d: a BatchNorm2d whose statistics never change (detection backbones fine-tuned with fixed BN).

It normalises with its running statistics in training as in evaluation and never updates them;
its affine weight and bias still train. Fused with a preceding convolution it becomes
``ConvFreezebn2d`` (``mqbench.nn.intrinsic``), whose QAT module folds the frozen statistics
into the quantized weight.

Example:
    >>> import torch
    >>> bn = FrozenBatchNorm2d(3).train()
    >>> _ = bn(torch.randn(4, 3, 5, 5) * 10)
    >>> bool((bn.running_var == 1).all())
    True
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["FrozenBatchNorm2d"]


class FrozenBatchNorm2d(nn.BatchNorm2d):
    """BatchNorm2d normalising with its running statistics always; they are never updated."""

    is_quantization_leaf = True  # traced as one call, like torch's own BatchNorm2d

    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)
