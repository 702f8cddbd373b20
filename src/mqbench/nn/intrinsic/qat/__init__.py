"""QAT fused modules (``nniqat``): fused float modules with the weight quantized and BatchNorm folded.

``from_float(mod, weight_fake_quant_factory)`` converts a module of
:mod:`mqbench.nn.intrinsic`; ``to_float()`` returns the folded float module and the
BatchNorm variants' ``merge_bn()`` the equivalent QAT module without BatchNorm.
``freeze_bn_stats`` / ``update_bn_stats`` switch BatchNorm statistics (methods, and
functions for ``model.apply``).
"""

from mqbench.nn.intrinsic.qat.modules import (
    BnFoldingModule,
    ConvBn1d,
    ConvBn2d,
    ConvBn3d,
    ConvBnReLU1d,
    ConvBnReLU2d,
    ConvBnReLU3d,
    ConvReLU1d,
    ConvReLU2d,
    ConvReLU3d,
    ConvTransposeBn2d,
    ConvTransposeBnReLU2d,
    ConvTransposeReLU2d,
    LinearBn1d,
    LinearBnReLU1d,
    LinearReLU,
    ReLUMixin,
    freeze_bn_stats,
    update_bn_stats,
)

__all__ = [
    "BnFoldingModule",
    "ConvBn1d",
    "ConvBn2d",
    "ConvBn3d",
    "ConvBnReLU1d",
    "ConvBnReLU2d",
    "ConvBnReLU3d",
    "ConvReLU1d",
    "ConvReLU2d",
    "ConvReLU3d",
    "ConvTransposeBn2d",
    "ConvTransposeBnReLU2d",
    "ConvTransposeReLU2d",
    "LinearBn1d",
    "LinearBnReLU1d",
    "LinearReLU",
    "ReLUMixin",
    "freeze_bn_stats",
    "update_bn_stats",
]
