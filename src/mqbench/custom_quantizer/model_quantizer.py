"""ModelQuantizer: turns a traced float model into the backend's quantization simulation.

One engine for every backend: the :class:`~mqbench.backends.BackendSpec` decides what it
does (fusion, weight quantizers, and where activation quantizers go). Subclasses may
override ``module_type_to_quant_input`` / ``function_type_to_quant_input`` (MQBench's
extension points) and are attached to a backend with :func:`register_model_quantizer`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from torch import fx, nn

from mqbench.backends.registry import ParamsTable, resolve_backend
from mqbench.backends.spec import BackendSpec
from mqbench.custom_quantizer.ops import FUNCTION_KINDS, METHOD_KINDS, MODULE_KINDS, edge_layers, node_kind
from mqbench.custom_quantizer.passes import fuse_patterns, insert_activation_quantizers, swap_modules
from mqbench.custom_quantizer.placement import ActivationSite, Rules, plan_activation_quantizers
from mqbench.custom_quantizer.qconfig import QConfigPair, eight_bit_variant, reduced_range_variant, unsigned_variant
from mqbench.fuser_method_mapping import FUSER_METHODS, QAT_MODULE_MAPPING
from mqbench.utils.config import check_keys
from mqbench.utils.factory import Factory

__all__ = ["ModelQuantizer", "register_model_quantizer"]

QUANTIZER_KEYS = (
    "additional_function_type",
    "additional_module_type",
    "additional_node_name",
    "exclude_module_name",
    "exclude_function_type",
    "exclude_node_name",
)
FUSE_KEYS = ("additional_fuser_method_mapping", "additional_fusion_pattern", "additional_qat_module_mapping")


class ModelQuantizer:
    """Fuse, swap in QAT modules and insert activation quantizers, following a backend spec.

    Example:
        >>> import torch
        >>> from mqbench.custom_quantizer import ModelQuantizer
        >>> from mqbench.backends import ParamsTable
        >>> quantizer = ModelQuantizer(ParamsTable["tensorrt"])
        >>> torch.nn.Conv2d in quantizer.module_type_to_quant_input
        True
    """

    def __init__(
        self,
        spec: BackendSpec,
        extra_quantizer_dict: Mapping[str, Any] | None = None,
        extra_fuse_dict: Mapping[str, Any] | None = None,
    ) -> None:
        self.spec = spec
        self.extra_quantizer_dict = dict(extra_quantizer_dict or {})
        self.extra_fuse_dict = dict(extra_fuse_dict or {})
        check_keys(self.extra_quantizer_dict, QUANTIZER_KEYS, "extra_quantizer_dict")
        check_keys(self.extra_fuse_dict, FUSE_KEYS, "extra_fuse_dict")

    # -- MQBench's extension points -----------------------------------------------------------
    @property
    def module_type_to_quant_input(self) -> tuple[type, ...]:
        """Module classes whose input is quantized (from the backend's ``inputs_of`` kinds)."""
        kinds = self.spec.placement.inputs_of
        builtin = tuple(cls for cls, kind in MODULE_KINDS.items() if kind in kinds)
        return builtin + tuple(self.extra_quantizer_dict.get("additional_module_type", ()))

    @property
    def function_type_to_quant_input(self) -> list[Any]:
        """Functions and method names whose tensor inputs are quantized."""
        kinds = self.spec.placement.inputs_of
        functions = [fn for fn, kind in FUNCTION_KINDS.items() if kind in kinds]
        methods = [name for name, kind in METHOD_KINDS.items() if kind in kinds]
        return functions + methods + list(self.extra_quantizer_dict.get("additional_function_type", ()))

    # -- the pipeline -------------------------------------------------------------------------
    def prepare(self, model: fx.GraphModule, qconfig: QConfigPair, is_qat: bool) -> fx.GraphModule:
        excluded = self._excluded(model)
        if self.spec.fuse:
            model = fuse_patterns(model, self._fuser_methods(), is_qat, skip=excluded)
        model = swap_modules(model, self._qat_mapping(), self._weight_factory(model, qconfig, excluded))
        modules = dict(model.named_modules())
        rules = Rules(self.spec.placement, self._quantizes_input(modules), excluded)
        sites = plan_activation_quantizers(model.graph, modules, rules)
        return insert_activation_quantizers(model, sites, self._activation_factory(qconfig))

    def _fuser_methods(self) -> dict[Any, Callable[..., nn.Module]]:
        methods = dict(FUSER_METHODS)
        methods.update(self.extra_fuse_dict.get("additional_fuser_method_mapping", {}))
        methods.update(self.extra_fuse_dict.get("additional_fusion_pattern", {}))
        return methods

    def _qat_mapping(self) -> dict[type, type]:
        return {**QAT_MODULE_MAPPING, **self.extra_fuse_dict.get("additional_qat_module_mapping", {})}

    def _excluded(self, model: fx.GraphModule) -> Callable[[fx.Node], bool]:
        names = set(self.extra_quantizer_dict.get("exclude_node_name", ()))
        module_names = set(self.extra_quantizer_dict.get("exclude_module_name", ()))
        functions = set(self.extra_quantizer_dict.get("exclude_function_type", ()))

        def excluded(node: fx.Node) -> bool:
            if node.name in names:
                return True
            if node.op == "call_module":
                target = str(node.target)
                return any(target == name or target.startswith(name + ".") for name in module_names)
            return node.op == "call_function" and node.target in functions

        return excluded

    def _quantizes_input(self, modules: Mapping[str, nn.Module]) -> Callable[[fx.Node], bool]:
        module_types = self.module_type_to_quant_input
        functions = self.function_type_to_quant_input
        node_names = set(self.extra_quantizer_dict.get("additional_node_name", ()))

        def quantizes_input(node: fx.Node) -> bool:
            if node.name in node_names:
                return True
            if node.op == "call_module":
                return isinstance(modules[str(node.target)], module_types)
            if node.op in ("call_function", "call_method"):
                return any(node.target is f or node.target == f for f in functions)
            return False

        return quantizes_input

    def _weight_factory(
        self, model: fx.GraphModule, qconfig: QConfigPair, excluded: Callable[[fx.Node], bool]
    ) -> Callable[[fx.Node, nn.Module], Factory | None]:
        modules = dict(model.named_modules())
        edges = edge_layers(model.graph, modules) if self.spec.placement.first_last_8bit else set()

        def factory_for(node: fx.Node, module: nn.Module) -> Factory | None:
            if excluded(node):
                return None
            factory = qconfig.weight
            if node in edges:
                factory = eight_bit_variant(factory)
                if qconfig.reduce_range:
                    factory = reduced_range_variant(factory, self.spec.name)
            if node_kind(node, modules) == "deconv" and qconfig.weight_spec.scheme.per_channel:
                factory = factory.with_args(ch_axis=1)  # ConvTranspose weights: [in, out / groups, ...]
            return factory

        return factory_for

    def _activation_factory(self, qconfig: QConfigPair) -> Callable[[ActivationSite], Factory]:
        def factory_for(site: ActivationSite) -> Factory:
            factory = qconfig.activation
            if site.eight_bit:
                factory = eight_bit_variant(factory)
            if site.unsigned:
                factory = unsigned_variant(factory)
            elif site.product_operand and qconfig.reduce_range and _signed_eight_bit(factory):
                factory = reduced_range_variant(factory, self.spec.name)
            return factory

        return factory_for


def _signed_eight_bit(factory: Factory) -> bool:
    low, high = factory.kwargs.get("quant_min"), factory.kwargs.get("quant_max")
    return low is not None and high is not None and low < 0 and high - low + 1 in (255, 256)


def register_model_quantizer(backend: Any) -> Callable[[type[ModelQuantizer]], type[ModelQuantizer]]:
    """Class decorator: use this ModelQuantizer subclass for ``backend`` (a name or BackendType)."""

    def register(cls: type[ModelQuantizer]) -> type[ModelQuantizer]:
        if not (isinstance(cls, type) and issubclass(cls, ModelQuantizer)):
            raise ValueError(f"register_model_quantizer expects a ModelQuantizer subclass, got {cls!r}")
        spec = resolve_backend(backend)
        ParamsTable.register(spec.name, replace(spec, model_quantizer=cls), replace=True)
        return cls

    return register
