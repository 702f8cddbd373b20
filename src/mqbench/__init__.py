"""mqbench: hardware-aware model quantization for PyTorch.

Example:
    >>> import torch
    >>> from mqbench.fake_quantize import FixedFakeQuantize
    >>> from mqbench.observer import MinMaxObserver
    >>> fq = FixedFakeQuantize(MinMaxObserver, quant_min=0, quant_max=255)
    >>> fq(torch.rand(4, 4)).shape
    torch.Size([4, 4])
"""

from __future__ import annotations

from mqbench.scheme import QuantScheme

__all__ = ["QuantScheme", "__version__"]

__version__ = "0.1.0"
