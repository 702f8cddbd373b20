"""QAT fused modules (MQBench's ``mqbench.nn.intrinsic.qat.modules``)."""

from mqbench.nn.intrinsic.qat.modules.bn_folding import (
    BnFoldingModule,
    ReLUMixin,
    freeze_bn_stats,
    update_bn_stats,
)
from mqbench.nn.intrinsic.qat.modules.conv_fused import (
    ConvBn1d,
    ConvBn2d,
    ConvBn3d,
    ConvBnReLU1d,
    ConvBnReLU2d,
    ConvBnReLU3d,
    ConvReLU1d,
    ConvReLU2d,
    ConvReLU3d,
)
from mqbench.nn.intrinsic.qat.modules.deconv_fused import (
    ConvTransposeBn2d,
    ConvTransposeBnReLU2d,
    ConvTransposeReLU2d,
)
from mqbench.nn.intrinsic.qat.modules.freezebn import (
    ConvFreezebn2d,
    ConvFreezebnReLU2d,
    ConvTransposeFreezebn2d,
    ConvTransposeFreezebnReLU2d,
)
from mqbench.nn.intrinsic.qat.modules.linear_fused import (
    LinearBn1d,
    LinearBnReLU1d,
    LinearReLU,
)

__all__ = [
    "BnFoldingModule",
    "ConvBn1d",
    "ConvBn2d",
    "ConvBn3d",
    "ConvBnReLU1d",
    "ConvBnReLU2d",
    "ConvBnReLU3d",
    "ConvFreezebn2d",
    "ConvFreezebnReLU2d",
    "ConvReLU1d",
    "ConvReLU2d",
    "ConvReLU3d",
    "ConvTransposeBn2d",
    "ConvTransposeBnReLU2d",
    "ConvTransposeFreezebn2d",
    "ConvTransposeFreezebnReLU2d",
    "ConvTransposeReLU2d",
    "LinearBn1d",
    "LinearBnReLU1d",
    "LinearReLU",
    "ReLUMixin",
    "freeze_bn_stats",
    "update_bn_stats",
]
