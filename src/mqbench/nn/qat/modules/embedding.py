"""QAT embedding: the float Embedding with its table fake-quantized (per row with ``ch_axis=0``)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch.nn.functional as F
from torch import Tensor, nn

from mqbench.nn.qat.modules.base import QATModule, WeightFakeQuantFactory, build_weight_fake_quant

__all__ = ["Embedding"]


class Embedding(QATModule, nn.Embedding):
    """QAT Embedding: looks rows up in ``weight_fake_quant(weight)``; arguments as nn.Embedding.

    The factory decides the granularity: a per-channel quantizer with ``ch_axis=0``
    quantizes each row (each embedding vector) with its own scale.

    Example:
        >>> import torch
        >>> from mqbench.fake_quantize import FixedFakeQuantize
        >>> factory = FixedFakeQuantize.with_args(
        ...     quant_min=-127, quant_max=127, qscheme=torch.per_channel_symmetric, ch_axis=0
        ... )
        >>> qat = Embedding.from_float(torch.nn.Embedding(10, 4), factory)
        >>> _ = qat(torch.tensor([1, 2]))
        >>> qat.weight_fake_quant.scale.shape
        torch.Size([10])
    """

    _FLOAT_MODULE: ClassVar[type[nn.Module]] = nn.Embedding
    _FLOAT_LAYER = nn.Embedding

    def __init__(self, *args: Any, weight_fake_quant_factory: WeightFakeQuantFactory, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.weight_fake_quant = build_weight_fake_quant(weight_fake_quant_factory, self.weight)

    @classmethod
    def _layer_kwargs(cls, layer: nn.Module) -> dict[str, Any]:
        if not isinstance(layer, nn.Embedding):
            raise TypeError(f"expected an nn.Embedding, got {type(layer).__name__}")
        return {
            "num_embeddings": layer.num_embeddings,
            "embedding_dim": layer.embedding_dim,
            "padding_idx": layer.padding_idx,
            "max_norm": layer.max_norm,
            "norm_type": layer.norm_type,
            "scale_grad_by_freq": layer.scale_grad_by_freq,
            "sparse": layer.sparse,
            "device": layer.weight.device,
            "dtype": layer.weight.dtype,
        }

    def forward(self, input: Tensor) -> Tensor:
        return F.embedding(
            input,
            self.weight_fake_quant(self.weight),
            self.padding_idx,
            self.max_norm,
            self.norm_type,
            self.scale_grad_by_freq,
            self.sparse,
        )
