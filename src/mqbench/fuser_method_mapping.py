"""Fusion: patterns -> fuser methods -> fused modules -> QAT modules, as tables.

A pattern is a tuple of matchers, one per op in a chain (layer, then BatchNorm and/or
activation); a matcher is a module class, a function, or a method name. Each pattern
maps to a fuser method ``fuser(is_qat, *modules) -> nn.Module`` (PyTorch's signature):
with ``is_qat`` the fused module keeps its BatchNorm (the QAT module folds it while
training); without (PTQ) the BatchNorm is folded into the weights right away.
``QAT_MODULE_MAPPING`` maps each float or fused type to its QAT module.

Example:
    >>> from torch import nn
    >>> from mqbench.fuser_method_mapping import FUSER_METHODS, RELU
    >>> fuser = FUSER_METHODS[(nn.Conv2d, nn.BatchNorm2d, RELU)]
    >>> type(fuser(True, nn.Conv2d(1, 2, 1), nn.BatchNorm2d(2), nn.ReLU())).__name__
    'ConvBnReLU2d'
    >>> type(fuser(False, nn.Conv2d(1, 2, 1), nn.BatchNorm2d(2).eval(), nn.ReLU())).__name__
    'ConvReLU2d'
"""

from __future__ import annotations

from collections.abc import Callable
from types import MappingProxyType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from mqbench.nn import intrinsic as nni
from mqbench.nn import qat as nnqat
from mqbench.nn.intrinsic import qat as nniqat
from mqbench.nn.modules import FrozenBatchNorm2d
from mqbench.utils.fusion import fold_bn_into

__all__ = [
    "FUSER_METHODS",
    "QAT_MODULE_MAPPING",
    "RELU",
    "Pattern",
    "activation_module",
    "fuse_conv_freezebn",
    "fuse_conv_freezebn_relu",
    "fuse_custom_config_dict",
    "fuse_deconv_bn",
    "fuse_deconv_bn_relu",
    "fuse_deconv_freezebn",
    "fuse_deconv_freezebn_relu",
    "fuse_linear_bn",
]

Matcher = type | Callable[..., Any] | str
Pattern = tuple[Any, ...]

# One matcher for ReLU-like activations, as modules, functions or methods.
RELU = (nn.ReLU, nn.ReLU6, F.relu, F.relu6, torch.relu, "relu", "relu_")


def activation_module(module_or_function: Any) -> nn.Module:
    """The activation as a module (functional ReLU6 becomes nn.ReLU6, other ReLUs nn.ReLU)."""
    if isinstance(module_or_function, nn.Module):
        return module_or_function
    return nn.ReLU6() if module_or_function is F.relu6 else nn.ReLU()


def _layer_bn(fused: type) -> Callable[..., nn.Module]:
    def fuse(is_qat: bool, layer: nn.Module, bn: _BatchNorm) -> nn.Module:
        return fused(layer, bn) if is_qat else fold_bn_into(layer, bn)

    return fuse


def _layer_bn_relu(fused: type, folded: type) -> Callable[..., nn.Module]:
    def fuse(is_qat: bool, layer: nn.Module, bn: _BatchNorm, relu: Any) -> nn.Module:
        if is_qat:
            return fused(layer, bn, activation_module(relu))
        return folded(fold_bn_into(layer, bn), activation_module(relu))

    return fuse


def _layer_relu(fused: type) -> Callable[..., nn.Module]:
    def fuse(is_qat: bool, layer: nn.Module, relu: Any) -> nn.Module:
        return fused(layer, activation_module(relu))

    return fuse


_FAMILIES: tuple[tuple[type, type | None, type | None, type | None, type], ...] = (
    # layer, its BatchNorm, layer+bn, layer+bn+relu, layer+relu
    (nn.Conv1d, nn.BatchNorm1d, nni.ConvBn1d, nni.ConvBnReLU1d, nni.ConvReLU1d),
    (nn.Conv2d, nn.BatchNorm2d, nni.ConvBn2d, nni.ConvBnReLU2d, nni.ConvReLU2d),
    (nn.Conv3d, nn.BatchNorm3d, nni.ConvBn3d, nni.ConvBnReLU3d, nni.ConvReLU3d),
    (nn.Linear, nn.BatchNorm1d, nni.LinearBn1d, nni.LinearBnReLU1d, nni.LinearReLU),
    (nn.ConvTranspose2d, nn.BatchNorm2d, nni.ConvTransposeBn2d, nni.ConvTransposeBnReLU2d, nni.ConvTransposeReLU2d),
    # BatchNorm with frozen statistics (mqbench.nn.modules.FrozenBatchNorm2d)
    (nn.Conv2d, FrozenBatchNorm2d, nni.ConvFreezebn2d, nni.ConvFreezebnReLU2d, nni.ConvReLU2d),
    (
        nn.ConvTranspose2d,
        FrozenBatchNorm2d,
        nni.ConvTransposeFreezebn2d,
        nni.ConvTransposeFreezebnReLU2d,
        nni.ConvTransposeReLU2d,
    ),
)


def _fuser_methods() -> dict[Pattern, Callable[..., nn.Module]]:
    methods: dict[Pattern, Callable[..., nn.Module]] = {}
    for layer, bn, with_bn, with_bn_relu, with_relu in _FAMILIES:
        if bn is not None and with_bn_relu is not None:
            methods[(layer, bn, RELU)] = _layer_bn_relu(with_bn_relu, with_relu)
        if bn is not None and with_bn is not None:
            methods[(layer, bn)] = _layer_bn(with_bn)
        methods[(layer, RELU)] = _layer_relu(with_relu)
    return methods


FUSER_METHODS = MappingProxyType(_fuser_methods())

QAT_MODULE_MAPPING = MappingProxyType(
    {
        nn.Conv1d: nnqat.Conv1d,
        nn.Conv2d: nnqat.Conv2d,
        nn.Conv3d: nnqat.Conv3d,
        nn.Linear: nnqat.Linear,
        nn.ConvTranspose1d: nnqat.ConvTranspose1d,
        nn.ConvTranspose2d: nnqat.ConvTranspose2d,
        nn.ConvTranspose3d: nnqat.ConvTranspose3d,
        **{
            getattr(nni, name): getattr(nniqat, name)
            for name in nni.__all__
            if hasattr(nniqat, name) and name not in ("FusedModule", "ACTIVATIONS")
        },
    }
)


# -- MQBench's names ----------------------------------------------------------------------------------------
# MQBench's fusers take the modules alone and return the fused module that keeps its BatchNorm (the QAT
# form); ``extra_fuse_dict`` accepts them as they are (mqbench.custom_quantizer.model_quantizer.with_is_qat).
def fuse_linear_bn(linear: nn.Linear, bn: _BatchNorm) -> nn.Module:
    return FUSER_METHODS[(nn.Linear, nn.BatchNorm1d)](True, linear, bn)


def fuse_deconv_bn(deconv: nn.ConvTranspose2d, bn: _BatchNorm) -> nn.Module:
    return FUSER_METHODS[(nn.ConvTranspose2d, nn.BatchNorm2d)](True, deconv, bn)


def fuse_deconv_bn_relu(deconv: nn.ConvTranspose2d, bn: _BatchNorm, relu: nn.Module) -> nn.Module:
    return FUSER_METHODS[(nn.ConvTranspose2d, nn.BatchNorm2d, RELU)](True, deconv, bn, relu)


def fuse_conv_freezebn(conv: nn.Conv2d, bn: FrozenBatchNorm2d) -> nn.Module:
    return FUSER_METHODS[(nn.Conv2d, FrozenBatchNorm2d)](True, conv, bn)


def fuse_conv_freezebn_relu(conv: nn.Conv2d, bn: FrozenBatchNorm2d, relu: nn.Module) -> nn.Module:
    return FUSER_METHODS[(nn.Conv2d, FrozenBatchNorm2d, RELU)](True, conv, bn, relu)


def fuse_deconv_freezebn(deconv: nn.ConvTranspose2d, bn: FrozenBatchNorm2d) -> nn.Module:
    return FUSER_METHODS[(nn.ConvTranspose2d, FrozenBatchNorm2d)](True, deconv, bn)


def fuse_deconv_freezebn_relu(deconv: nn.ConvTranspose2d, bn: FrozenBatchNorm2d, relu: nn.Module) -> nn.Module:
    return FUSER_METHODS[(nn.ConvTranspose2d, FrozenBatchNorm2d, RELU)](True, deconv, bn, relu)


# MQBench's extra_fuse_dict of its own patterns. Every pattern in it is built in here (FUSER_METHODS,
# QAT_MODULE_MAPPING), so passing it changes nothing; it is kept for code that passes or extends it.
fuse_custom_config_dict: dict[str, dict[Any, Any]] = {
    "additional_fuser_method_mapping": {
        (nn.Linear, nn.BatchNorm1d): fuse_linear_bn,
        (nn.ConvTranspose2d, nn.BatchNorm2d): fuse_deconv_bn,
        (nn.ConvTranspose2d, nn.BatchNorm2d, nn.ReLU): fuse_deconv_bn_relu,
        (nn.Conv2d, FrozenBatchNorm2d): fuse_conv_freezebn,
        (nn.Conv2d, FrozenBatchNorm2d, nn.ReLU): fuse_conv_freezebn_relu,
        (nn.ConvTranspose2d, FrozenBatchNorm2d): fuse_deconv_freezebn,
        (nn.ConvTranspose2d, FrozenBatchNorm2d, nn.ReLU): fuse_deconv_freezebn_relu,
    },
    "additional_fusion_pattern": {},
    "additional_qat_module_mapping": {},
}
