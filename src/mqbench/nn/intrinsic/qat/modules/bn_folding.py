"""Simulated BatchNorm folding: the machinery shared by every ``*Bn*`` QAT module.

Deployed hardware runs a layer followed by BatchNorm as one layer with the folded
weight ``w * factor`` and bias ``(b - running_mean) * factor + beta``, where
``factor = gamma / sqrt(running_var + eps)``; the weight quantizer sees the folded
weight. The QAT modules simulate this:

* training (BatchNorm not frozen):
  ``y = layer(x, fq(w * factor)) / factor + b``, then ``bn(y)`` with the batch
  statistics, which also updates the running statistics. Up to weight quantization
  this is exactly ``bn(layer(x))`` in training mode;
* eval, or BatchNorm frozen (:meth:`BnFoldingModule.freeze_bn_stats`):
  ``layer(x, fq(w * factor), (b - running_mean) * factor + beta)`` with the running
  statistics, i.e. what the deployed layer computes. Gradients still reach
  ``gamma`` and ``beta``; the running statistics stay fixed.

``ReLUMixin`` applies the activation module (ReLU or ReLU6) after the layer.
"""

from __future__ import annotations

import copy
from typing import Any, ClassVar, TypeVar

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from mqbench.nn.qat.modules.base import QATModule, WeightFakeQuantFactory, build_weight_fake_quant
from mqbench.utils.fusion import (
    bn_running_stats,
    bn_scale_factor,
    fold_bn_bias,
    fold_bn_into,
    scale_output_channels,
)

__all__ = ["BnFoldingModule", "ReLUMixin", "freeze_bn_stats", "update_bn_stats"]

BnFoldingT = TypeVar("BnFoldingT", bound="BnFoldingModule")


class ReLUMixin(QATModule):
    """Adds the activation module ``relu`` (default ``nn.ReLU()``; ReLU6 for MobileNet) after the layer."""

    ends_with_relu: ClassVar[bool] = True

    def __init__(self, *args: Any, relu: nn.Module | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.relu = nn.ReLU() if relu is None else relu

    def forward(self, input: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        return self.relu(super().forward(input, *args, **kwargs))


class BnFoldingModule(QATModule):
    """Mixin of the QAT layer + BatchNorm modules (listed before the float layer among the bases).

    Holds the BatchNorm as ``bn`` and the weight quantizer as ``weight_fake_quant``; the
    layer's own ``weight`` and ``bias`` are the unfolded float parameters. ``freeze_bn``
    (set by :meth:`freeze_bn_stats`, cleared by :meth:`update_bn_stats`) makes training
    use the running statistics and stop updating them.

    Subclasses set ``_BN`` (the BatchNorm class), ``_MERGED_QAT`` (the QAT module without
    BatchNorm that :meth:`merge_bn` returns), ``_TRANSPOSED`` (the weight's output channels
    are on axis 1, grouped) and ``_CHANNEL_AXIS`` (the output's channel axis), and
    implement ``_apply_weight``.
    """

    _BN: ClassVar[type[_BatchNorm]]
    _MERGED_QAT: ClassVar[type[QATModule]]
    _TRANSPOSED: ClassVar[bool] = False
    _CHANNEL_AXIS: ClassVar[int] = 1

    weight: Tensor
    bn: _BatchNorm
    freeze_bn: bool

    def __init__(
        self,
        *args: Any,
        weight_fake_quant_factory: WeightFakeQuantFactory,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        freeze_bn: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.weight_fake_quant = build_weight_fake_quant(weight_fake_quant_factory, self.weight)
        channels = int(getattr(self, "out_channels", getattr(self, "out_features", 0)))
        self.bn = self._BN(channels, eps=eps, momentum=momentum, device=self.weight.device, dtype=self.weight.dtype)
        self.freeze_bn = bool(freeze_bn)

    # -- BatchNorm statistics --------------------------------------------------------------------
    def freeze_bn_stats(self: BnFoldingT) -> BnFoldingT:
        """Use the running statistics in training too and stop updating them; returns self."""
        self.freeze_bn = True
        return self

    def update_bn_stats(self: BnFoldingT) -> BnFoldingT:
        """Train with batch statistics and update the running ones again (the default); returns self."""
        self.freeze_bn = False
        return self

    # -- folding ---------------------------------------------------------------------------------
    def _layer_bias(self) -> Tensor | None:
        bias = getattr(self, "bias", None)
        return bias if isinstance(bias, Tensor) else None

    def _bn_affine(self) -> tuple[Tensor | None, Tensor | None]:
        return (self.bn.weight, self.bn.bias) if self.bn.affine else (None, None)

    def folded_weight_and_bias(self) -> tuple[Tensor, Tensor]:
        """The folded float (weight, bias) of the deployed layer, from the running statistics.

        Differentiable (no quantization applied); the quantized layer uses
        ``weight_fake_quant(weight)`` of the first.
        """
        running_mean, running_var = bn_running_stats(self.bn)
        gamma, beta = self._bn_affine()
        factor = bn_scale_factor(running_var, self.bn.eps, gamma)
        weight = scale_output_channels(self.weight, factor, self._TRANSPOSED)
        return weight, fold_bn_bias(self._layer_bias(), running_mean, factor, beta)

    def weight_to_quantize(self) -> Tensor:
        """The folded weight (running statistics), which the forward quantizes in training and in eval."""
        return self.folded_weight_and_bias()[0]

    def _per_channel(self, values: Tensor, like: Tensor) -> Tensor:
        shape = [1] * like.dim()
        shape[self._CHANNEL_AXIS] = -1
        return values.reshape(shape)

    def _apply_weight(self, x: Tensor, weight: Tensor, bias: Tensor | None, **options: Any) -> Tensor:
        """The layer's operation with the given weight and bias."""
        raise NotImplementedError

    def _unfold(self, folded: Tensor, factor: Tensor) -> Tensor:
        """``folded / factor`` per output channel; the float weight where ``factor`` is 0.

        A channel with gamma 0 (zero-initialised residual branches, a channel pruned by its BN) folds
        to zero weights and outputs beta whatever its input; dividing its quantized zero weights by 0
        would give NaN. Its unfolded weight is the float one, so that the batch statistics and gamma's
        gradient are those of ``bn(layer(x))``.
        """
        dead = factor == 0
        if not bool(dead.any()):
            return scale_output_channels(folded, 1.0 / factor, self._TRANSPOSED)
        safe = torch.where(dead, torch.ones_like(factor), factor)
        unfolded = scale_output_channels(folded, 1.0 / safe, self._TRANSPOSED)
        mask = scale_output_channels(torch.ones_like(folded), dead.to(folded.dtype), self._TRANSPOSED) > 0
        return torch.where(mask, self.weight, unfolded)

    def _folded_forward(self, x: Tensor, **options: Any) -> Tensor:
        running_mean, running_var = bn_running_stats(self.bn)
        gamma, beta = self._bn_affine()
        factor = bn_scale_factor(running_var, self.bn.eps, gamma)
        bias = self._layer_bias()
        if self.training and not self.freeze_bn:
            # conv(x, fq(w f)) / f, with the division applied to the weight's output channels: the
            # layer is linear in its weight, and the weight is far smaller than the output. A
            # quantizer that can (LSQ) scales, quantizes and unscales in one pass.
            fused = getattr(self.weight_fake_quant, "quantize_folded", None)
            unscaled = None if fused is None or self._TRANSPOSED else fused(self.weight, factor)
            if unscaled is None:
                weight = self.weight_fake_quant(scale_output_channels(self.weight, factor, self._TRANSPOSED))
                unscaled = self._unfold(weight, factor)
            y = self._apply_weight(x, unscaled, None, **options)
            if bias is not None:
                y = y + self._per_channel(bias, y)
            return self.bn(y)
        weight = self.weight_fake_quant(scale_output_channels(self.weight, factor, self._TRANSPOSED))
        return self._apply_weight(x, weight, fold_bn_bias(bias, running_mean, factor, beta), **options)

    # -- conversion ------------------------------------------------------------------------------
    def _float_layer(self) -> nn.Module:
        return fold_bn_into(self, self.bn)

    def merge_bn(self) -> QATModule:
        """A new QAT module without BatchNorm (e.g. ConvBn2d -> nnqat.Conv2d, ConvBnReLU2d -> ConvReLU2d).

        It holds the folded weight and bias and a copy of ``weight_fake_quant``, so in eval
        mode it computes what this module computes in eval mode (the deployed layer).
        """
        merged = self._MERGED_QAT.from_float(self.to_float(), lambda: copy.deepcopy(self.weight_fake_quant))
        qconfig = getattr(self, "qconfig", None)
        if qconfig is not None:
            merged.qconfig = qconfig
        return merged

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, freeze_bn={self.freeze_bn}"


def freeze_bn_stats(module: nn.Module) -> None:
    """Freeze the BatchNorm statistics of ``module`` if it folds a BatchNorm (use with ``model.apply``)."""
    if isinstance(module, BnFoldingModule):
        module.freeze_bn_stats()


def update_bn_stats(module: nn.Module) -> None:
    """Resume updating the BatchNorm statistics of ``module`` if it folds one (use with ``model.apply``)."""
    if isinstance(module, BnFoldingModule):
        module.update_bn_stats()
