"""Batch-norm folding math: fold an eval-mode BatchNorm into the layer before it.

A BatchNorm in eval mode is an affine map per output channel ``c``:
``bn(y)[c] = (y[c] - mean[c]) * gamma[c] / sqrt(var[c] + eps) + beta[c]``.
Following a convolution or linear layer ``y = w * x + b``, it folds into the
layer as ``w' = w * factor`` (per output channel) and ``b' = (b - mean) * factor + beta``
with ``factor = gamma / sqrt(var + eps)``.

The functions here are pure and differentiable (the QAT modules of
:mod:`mqbench.nn.intrinsic.qat` use them in their forward pass);
:func:`fold_bn_into` builds the folded float layer used by PTQ and deployment.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from mqbench.utils.fusion import fold_bn_into
    >>> conv, bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)
    >>> _ = bn.running_mean.uniform_(-1, 1), bn.running_var.uniform_(0.5, 2), bn.eval()
    >>> folded = fold_bn_into(conv, bn)
    >>> x = torch.randn(2, 3, 8, 8)
    >>> torch.allclose(folded(x), bn(conv(x)), atol=1e-5)
    True
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = [
    "FOLDABLE_LAYERS",
    "bn_running_stats",
    "bn_scale_factor",
    "fold_bn_bias",
    "fold_bn_into",
    "fuse_conv_bn_weights",
    "fuse_linear_bn_weights",
    "layer_init_kwargs",
    "scale_output_channels",
]

#: The float layer types a BatchNorm can be folded into (subclasses count as their base).
FOLDABLE_LAYERS: tuple[type[nn.Module], ...] = (
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
    nn.Linear,
)


def bn_scale_factor(running_var: Tensor, eps: float, gamma: Tensor | None = None) -> Tensor:
    """``gamma / sqrt(running_var + eps)`` per channel (``gamma`` None: a BatchNorm without affine)."""
    std = torch.sqrt(running_var + eps)
    return 1.0 / std if gamma is None else gamma / std


def scale_output_channels(weight: Tensor, factor: Tensor, transpose: bool = False) -> Tensor:
    """Multiply each output channel of a conv/linear weight by ``factor[channel]``.

    Ordinary conv and linear weights have their output channels on axis 0. A
    transposed conv weight has shape ``[in, out / groups, *kernel]``: output channel
    ``g * (out / groups) + j`` is ``weight[g * in / groups : (g + 1) * in / groups, j]``,
    so the number of groups is ``factor.numel() / weight.shape[1]``.
    """
    if factor.dim() != 1:
        raise ValueError(f"factor must be 1-D (one value per output channel), got shape {list(factor.shape)}")
    channels = factor.numel()
    if not transpose:
        if weight.shape[0] != channels:
            raise ValueError(
                f"weight of shape {list(weight.shape)} has {weight.shape[0]} output channels, not {channels}"
            )
        return weight * factor.reshape([-1] + [1] * (weight.dim() - 1))
    if weight.dim() < 2:
        raise ValueError(f"a transposed conv weight has at least 2 dimensions, got shape {list(weight.shape)}")
    per_group = weight.shape[1]
    groups = channels // per_group if per_group else 0
    if groups == 0 or groups * per_group != channels or weight.shape[0] % groups != 0:
        raise ValueError(
            f"transposed conv weight of shape {list(weight.shape)} does not match {channels} output channels "
            f"(expected [in, out / groups, ...] with in and out divisible by groups)"
        )
    kernel = list(weight.shape[2:])
    grouped = weight.reshape([groups, weight.shape[0] // groups, per_group, *kernel])
    scaled = grouped * factor.reshape([groups, 1, per_group] + [1] * len(kernel))
    return scaled.reshape(weight.shape)


def fold_bn_bias(bias: Tensor | None, running_mean: Tensor, factor: Tensor, beta: Tensor | None) -> Tensor:
    """``(bias - running_mean) * factor + beta`` (``bias``/``beta`` None count as zero)."""
    shifted = -running_mean if bias is None else bias - running_mean
    folded = shifted * factor
    return folded if beta is None else folded + beta


def fuse_conv_bn_weights(
    weight: Tensor,
    bias: Tensor | None,
    running_mean: Tensor,
    running_var: Tensor,
    eps: float,
    gamma: Tensor | None,
    beta: Tensor | None,
    transpose: bool = False,
) -> tuple[Tensor, Tensor]:
    """The (weight, bias) of a conv (``transpose`` for ConvTranspose) followed by an eval-mode BatchNorm.

    ``bias`` None is a conv without bias; ``gamma``/``beta`` None a BatchNorm without affine.
    The result is differentiable with respect to every tensor argument.
    """
    factor = bn_scale_factor(running_var, eps, gamma)
    return scale_output_channels(weight, factor, transpose), fold_bn_bias(bias, running_mean, factor, beta)


def fuse_linear_bn_weights(
    weight: Tensor,
    bias: Tensor | None,
    running_mean: Tensor,
    running_var: Tensor,
    eps: float,
    gamma: Tensor | None,
    beta: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """The (weight, bias) of a linear layer (weight ``[out, in]``) followed by an eval-mode BatchNorm1d."""
    return fuse_conv_bn_weights(weight, bias, running_mean, running_var, eps, gamma, beta)


def bn_running_stats(bn: _BatchNorm) -> tuple[Tensor, Tensor]:
    """``(running_mean, running_var)``, or ValueError for a BatchNorm that does not track them."""
    if bn.running_mean is None or bn.running_var is None:
        raise ValueError(
            f"{bn!r} does not track running statistics (track_running_stats=False), so it cannot be folded; "
            "build the BatchNorm with track_running_stats=True"
        )
    return bn.running_mean, bn.running_var


def _foldable_base(layer: nn.Module) -> type[nn.Module]:
    for base in FOLDABLE_LAYERS:
        if isinstance(layer, base):
            return base
    names = ", ".join(base.__name__ for base in FOLDABLE_LAYERS)
    raise TypeError(f"cannot fold a BatchNorm into {type(layer).__name__}; supported layers: {names}")


def layer_init_kwargs(layer: nn.Module) -> dict[str, Any]:
    """Constructor arguments that rebuild ``layer``'s float base class (conv, transposed conv or linear).

    Includes ``bias``, ``device`` and ``dtype`` (those of the layer's weight).
    """
    base = _foldable_base(layer)
    weight = layer.weight
    if not isinstance(weight, Tensor):
        raise TypeError(f"{type(layer).__name__} has no weight tensor")
    common: dict[str, Any] = {"bias": layer.bias is not None, "device": weight.device, "dtype": weight.dtype}
    if base is nn.Linear:
        return {"in_features": layer.in_features, "out_features": layer.out_features, **common}
    kwargs: dict[str, Any] = {
        name: getattr(layer, name)
        for name in (
            "in_channels",
            "out_channels",
            "kernel_size",
            "stride",
            "padding",
            "dilation",
            "groups",
            "padding_mode",
        )
    }
    if issubclass(base, nn.modules.conv._ConvTransposeNd):
        kwargs["output_padding"] = layer.output_padding
    return {**kwargs, **common}


def fold_bn_into(module: nn.Module, bn: _BatchNorm) -> nn.Module:
    """A new float layer computing ``bn(module(x))`` with ``bn`` in eval mode (its running statistics).

    ``module`` is a Conv1d/2d/3d, ConvTranspose1d/2d/3d or Linear (or a subclass, such as a
    QAT module, whose raw float weight is used); the result is a plain instance of that
    base class, always with a bias, holding the folded weights. Neither input is changed.
    """
    base = _foldable_base(module)
    if not isinstance(bn, _BatchNorm):
        raise TypeError(f"expected a BatchNorm module, got {type(bn).__name__}")
    kwargs = layer_init_kwargs(module)
    out_channels = kwargs.get("out_features", kwargs.get("out_channels"))
    if bn.num_features != out_channels:
        raise ValueError(
            f"{type(bn).__name__} has {bn.num_features} features but {type(module).__name__} has "
            f"{out_channels} output channels"
        )
    running_mean, running_var = bn_running_stats(bn)
    with torch.no_grad():
        weight, bias = fuse_conv_bn_weights(
            module.weight,  # type: ignore[arg-type]
            module.bias,  # type: ignore[arg-type]
            running_mean,
            running_var,
            bn.eps,
            bn.weight if bn.affine else None,
            bn.bias if bn.affine else None,
            transpose=isinstance(module, nn.modules.conv._ConvTransposeNd),
        )
        # skip_init: no random initialisation of parameters that are replaced on the next lines
        folded = torch.nn.utils.skip_init(base, **{**kwargs, "bias": True, "device": "meta"})
    trainable = bool(getattr(module.weight, "requires_grad", True))
    folded.weight = nn.Parameter(weight.detach().contiguous(), requires_grad=trainable)
    folded.bias = nn.Parameter(bias.detach().contiguous(), requires_grad=trainable)
    folded.train(module.training)
    return folded
