"""MQBench's deploy-time BatchNorm merging per fused module type (``mqbench.fusion_method``).

``FUSED_MODULE_CONVERT_FUNCTION`` maps each BatchNorm-folding QAT module type to a function
``convert(model, fused_node)`` that replaces that node's module, in place, by the equivalent
module without BatchNorm (the statistics merged into the weight and bias);
``register_convert_function(module_type)`` adds one for a user's module type.
:func:`mqbench.convert_deploy.convert_merge_bn` merges every such module of a model at once.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from mqbench.prepare_by_platform import prepare_by_platform
    >>> from mqbench.fusion_method import FUSED_MODULE_CONVERT_FUNCTION
    >>> qmodel = prepare_by_platform(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).train(), "tensorrt")
    >>> node = next(n for n in qmodel.graph.nodes if n.target == "0")
    >>> FUSED_MODULE_CONVERT_FUNCTION[type(qmodel.get_submodule("0"))](qmodel, node)
    >>> type(qmodel.get_submodule("0")).__name__
    'Conv2d'
"""

from __future__ import annotations

from collections.abc import Callable

from torch import fx

from mqbench.custom_quantizer.passes import set_submodule
from mqbench.nn.intrinsic import qat as nniqat
from mqbench.nn.intrinsic.qat.modules.bn_folding import BnFoldingModule

__all__ = [
    "FUSED_MODULE_CONVERT_FUNCTION",
    "convert_nniqat_convbn",
    "convert_nniqat_convbnrelu",
    "convert_qnni_deconvbn",
    "convert_qnni_deconvbnrelu",
    "convert_qnni_linearbn",
    "convert_qnniqat_convbn",
    "convert_qnniqat_convbnrelu",
    "convert_qnniqat_deconvbn",
    "convert_qnniqat_deconvbnrelu",
    "convert_qnniqat_linearbn",
    "register_convert_function",
]

ConvertFunction = Callable[[fx.GraphModule, fx.Node], None]
FUSED_MODULE_CONVERT_FUNCTION: dict[type, ConvertFunction] = {}


def register_convert_function(module_type: type) -> Callable[[ConvertFunction], ConvertFunction]:
    """Decorator: ``convert(model, fused_node)`` merges the BatchNorm of modules of ``module_type``."""

    def register(function: ConvertFunction) -> ConvertFunction:
        FUSED_MODULE_CONVERT_FUNCTION[module_type] = function
        return function

    return register


def _merge_node(model: fx.GraphModule, fused_node: fx.Node) -> None:
    module = model.get_submodule(str(fused_node.target))
    if not isinstance(module, BnFoldingModule):
        raise ValueError(f"node {fused_node.name!r} calls a {type(module).__name__}, which holds no BatchNorm to merge")
    set_submodule(model, str(fused_node.target), module.merge_bn().train(module.training))


def _merging(name: str) -> ConvertFunction:
    def convert(model: fx.GraphModule, fused_node: fx.Node) -> None:
        _merge_node(model, fused_node)

    convert.__name__ = convert.__qualname__ = name
    convert.__doc__ = "Merge the BatchNorm of ``fused_node``'s module into its layer, in place."
    return convert


# MQBench's names: its float fused modules (qnni) and QAT modules (qnniqat, nniqat) all arrive here as the
# package's one set of BatchNorm-folding QAT modules.
convert_nniqat_convbn = _merging("convert_nniqat_convbn")
convert_nniqat_convbnrelu = _merging("convert_nniqat_convbnrelu")
convert_qnniqat_convbn = _merging("convert_qnniqat_convbn")
convert_qnniqat_convbnrelu = _merging("convert_qnniqat_convbnrelu")
convert_qnni_linearbn = _merging("convert_qnni_linearbn")
convert_qnniqat_linearbn = _merging("convert_qnniqat_linearbn")
convert_qnni_deconvbn = _merging("convert_qnni_deconvbn")
convert_qnniqat_deconvbn = _merging("convert_qnniqat_deconvbn")
convert_qnni_deconvbnrelu = _merging("convert_qnni_deconvbnrelu")
convert_qnniqat_deconvbnrelu = _merging("convert_qnniqat_deconvbnrelu")

_BUILTIN: dict[str, ConvertFunction] = {
    "ConvBn1d": convert_nniqat_convbn,
    "ConvBn2d": convert_nniqat_convbn,
    "ConvBn3d": convert_nniqat_convbn,
    "ConvBnReLU1d": convert_nniqat_convbnrelu,
    "ConvBnReLU2d": convert_nniqat_convbnrelu,
    "ConvBnReLU3d": convert_nniqat_convbnrelu,
    "ConvFreezebn2d": convert_nniqat_convbn,
    "ConvFreezebnReLU2d": convert_nniqat_convbnrelu,
    "LinearBn1d": convert_qnniqat_linearbn,
    "LinearBnReLU1d": convert_qnniqat_linearbn,
    "ConvTransposeBn2d": convert_qnniqat_deconvbn,
    "ConvTransposeBnReLU2d": convert_qnniqat_deconvbnrelu,
    "ConvTransposeFreezebn2d": convert_qnniqat_deconvbn,
    "ConvTransposeFreezebnReLU2d": convert_qnniqat_deconvbnrelu,
}
for _name, _function in _BUILTIN.items():
    FUSED_MODULE_CONVERT_FUNCTION[getattr(nniqat, _name)] = _function
