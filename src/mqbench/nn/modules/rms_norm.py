"""RMS normalization written with elementary ops: :class:`RMSNorm`."""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["RMSNorm"]


class RMSNorm(nn.RMSNorm):
    """:class:`torch.nn.RMSNorm` computed as ``x * rsqrt(mean(x^2) + eps) * weight`` over the last dimensions.

    The same function, but traced into Pow / ReduceMean / Add / Sqrt / Div / Mul when exported, so that any ONNX
    opset holds it (the exporter has no ``aten::rms_norm`` before opset 23). ``eps`` None uses float32's.

    Example:
        >>> import torch
        >>> x = torch.randn(2, 3, 8)
        >>> torch.allclose(RMSNorm(8, eps=1e-6)(x), torch.nn.RMSNorm(8, eps=1e-6)(x), atol=1e-6)
        True
    """

    def forward(self, x: Tensor) -> Tensor:
        dims = tuple(range(-len(self.normalized_shape), 0))
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        y = x / torch.sqrt(x.pow(2).mean(dim=dims, keepdim=True) + eps)
        return y * self.weight if self.weight is not None else y
