"""QAT fused modules (``nniqat``): fused float modules with the weight quantized and BatchNorm folded.

``from_float(mod, weight_fake_quant_factory)`` converts a module of
:mod:`mqbench.nn.intrinsic`; ``to_float()`` returns the folded float module and the
BatchNorm variants' ``merge_bn()`` the equivalent QAT module without BatchNorm.
``freeze_bn_stats`` / ``update_bn_stats`` switch BatchNorm statistics (methods, and
functions for ``model.apply``).
"""

from mqbench.nn.intrinsic.qat import modules as _source
from mqbench.nn.intrinsic.qat.modules import *  # noqa: F403 (re-export; the names are _source.__all__)

__all__ = list(_source.__all__)
