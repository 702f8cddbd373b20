"""QAT layers (``nnqat``): Conv1d/2d/3d, Linear, ConvTranspose1d/2d/3d and Embedding with a weight fake quantizer."""

from mqbench.nn.qat.modules import (
    Conv1d,
    Conv2d,
    Conv3d,
    ConvTranspose1d,
    ConvTranspose2d,
    ConvTranspose3d,
    Embedding,
    Linear,
    QATModule,
    WeightFakeQuantFactory,
    build_weight_fake_quant,
    copy_layer_parameters,
    resolve_weight_fake_quant_factory,
)

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
