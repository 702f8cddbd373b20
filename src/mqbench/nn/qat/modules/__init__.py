"""QAT layers (MQBench's ``mqbench.nn.qat.modules``): float layers with a weight fake quantizer."""

from mqbench.nn.qat.modules.base import (
    QATModule,
    WeightFakeQuantFactory,
    build_weight_fake_quant,
    copy_layer_parameters,
    resolve_weight_fake_quant_factory,
)
from mqbench.nn.qat.modules.conv import Conv1d, Conv2d, Conv3d
from mqbench.nn.qat.modules.deconv import ConvTranspose1d, ConvTranspose2d, ConvTranspose3d
from mqbench.nn.qat.modules.embedding import Embedding
from mqbench.nn.qat.modules.linear import Linear

__all__ = [
    "Conv1d",
    "Conv2d",
    "Conv3d",
    "ConvTranspose1d",
    "ConvTranspose2d",
    "ConvTranspose3d",
    "Embedding",
    "Linear",
    "QATModule",
    "WeightFakeQuantFactory",
    "build_weight_fake_quant",
    "copy_layer_parameters",
    "resolve_weight_fake_quant_factory",
]
