"""QAT layers (``nnqat``): Conv1d/2d/3d, Linear, ConvTranspose1d/2d/3d and Embedding with a weight fake quantizer."""

from mqbench.nn.qat import modules as _source
from mqbench.nn.qat.modules import *  # noqa: F403 (re-export; the names are _source.__all__)

__all__ = list(_source.__all__)
