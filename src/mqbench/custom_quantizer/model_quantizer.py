"""ModelQuantizer: turns a traced float model into the backend's quantization simulation.

One engine for every backend: the :class:`~mqbench.backends.BackendSpec` decides what it
does (fusion, weight quantizers, and where activation quantizers go). Subclasses may
override ``module_type_to_quant_input`` / ``function_type_to_quant_input`` (MQBench's
extension points) and are attached to a backend with :func:`register_model_quantizer`.
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from mqbench.backends.registry import ParamsTable, backend_key, pending_model_quantizers
from mqbench.backends.spec import BackendSpec
from mqbench.custom_quantizer.float_layers import float_layer_reason, float_layer_roles
from mqbench.custom_quantizer.ops import FUNCTION_KINDS, METHOD_KINDS, MODULE_KINDS, edge_layers, node_kind
from mqbench.custom_quantizer.placement import ActivationSite, Rules
from mqbench.custom_quantizer.plan import FrontEnd, prepare_graph
from mqbench.custom_quantizer.qconfig import QConfigPair, eight_bit_variant, reduced_range_variant, unsigned_variant
from mqbench.fuser_method_mapping import FUSER_METHODS, QAT_MODULE_MAPPING
from mqbench.nn.intrinsic.modules.fused import FusedModule
from mqbench.utils.config import check_keys
from mqbench.utils.factory import Factory

__all__ = [
    "DEFAULT_MODEL_QUANTIZER",
    "ModelQuantizer",
    "activation_variant",
    "build_model_quantizer",
    "register_model_quantizer",
    "with_is_qat",
]

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

    # quantizer name -> bit width: part of the plan, each named quantizer is built at its width
    # (prepare_custom_config_dict["quantizer_bits"]; prepare_by_platform sets it)
    quantizer_bits: Mapping[str, int] = {}
    # the roles of layers left float (prepare_custom_config_dict["float_layers"]; None: the backend's float_layers)
    float_layers: tuple[str, ...] | None = None

    # The backend whose spec a quantizer built MQBench's way (without a spec) follows; None: the one
    # prepare_by_platform is preparing for (it sets ``spec`` after building the quantizer).
    backend: str | None = None

    def __init__(
        self,
        spec: BackendSpec | Mapping[str, Any] | None = None,
        extra_quantizer_dict: Mapping[str, Any] | None = None,
        extra_fuse_dict: Mapping[str, Any] | None = None,
    ) -> None:
        if not isinstance(spec, BackendSpec):  # MQBench's form: ModelQuantizer(extra_quantizer_dict, extra_fuse_dict)
            if extra_fuse_dict is not None:
                raise TypeError(
                    "ModelQuantizer takes (spec, extra_quantizer_dict, extra_fuse_dict) or MQBench's "
                    f"(extra_quantizer_dict, extra_fuse_dict); got a {type(spec).__name__} first and three arguments"
                )
            spec, extra_quantizer_dict, extra_fuse_dict = None, spec, extra_quantizer_dict
        self._spec = (
            self._with_rules(spec) if spec is not None else (ParamsTable[self.backend] if self.backend else None)
        )
        self.extra_quantizer_dict = dict(extra_quantizer_dict or {})
        self.extra_fuse_dict = dict(extra_fuse_dict or {})
        check_keys(self.extra_quantizer_dict, QUANTIZER_KEYS, "extra_quantizer_dict")
        if "additional_qat_module_mappings" in self.extra_fuse_dict:  # MQBench's fuse_custom_config_dict spelling
            plural = self.extra_fuse_dict.pop("additional_qat_module_mappings")
            self.extra_fuse_dict["additional_qat_module_mapping"] = {
                **plural,
                **self.extra_fuse_dict.get("additional_qat_module_mapping", {}),
            }
        check_keys(self.extra_fuse_dict, FUSE_KEYS, "extra_fuse_dict")

    @property
    def spec(self) -> BackendSpec:
        """The backend spec this quantizer follows."""
        if self._spec is None:
            raise ValueError(
                f"{type(self).__name__} has no backend yet: prepare_by_platform sets it, or build it with a "
                "BackendSpec first (ModelQuantizer(ParamsTable['tensorrt'], ...))"
            )
        return self._spec

    @spec.setter
    def spec(self, value: BackendSpec) -> None:
        self._spec = self._with_rules(value)

    def _with_rules(self, spec: BackendSpec) -> BackendSpec:
        """``spec`` with the placement rules of this class's ``backend`` (MQBench's per-backend quantizers carry
        their backend's rules to whichever backend they are registered for)."""
        if self.backend is None or spec.name == self.backend:
            return spec
        return replace(spec, placement=ParamsTable[self.backend].placement)

    # MQBench's attribute names for the entries of extra_quantizer_dict / extra_fuse_dict
    @property
    def additional_function_type(self) -> list[Any]:
        return list(self.extra_quantizer_dict.get("additional_function_type", []))

    @property
    def additional_module_type(self) -> tuple[type, ...]:
        return tuple(self.extra_quantizer_dict.get("additional_module_type", ()))

    @property
    def additional_node_name(self) -> list[str]:
        return list(self.extra_quantizer_dict.get("additional_node_name", []))

    @property
    def exclude_module_name(self) -> list[str]:
        return list(self.extra_quantizer_dict.get("exclude_module_name", []))

    @property
    def exclude_function_type(self) -> list[Any]:
        return list(self.extra_quantizer_dict.get("exclude_function_type", []))

    @property
    def exclude_node_name(self) -> list[str]:
        return list(self.extra_quantizer_dict.get("exclude_node_name", []))

    @property
    def additional_fuser_method_mapping(self) -> dict[Any, Any]:
        return dict(self.extra_fuse_dict.get("additional_fuser_method_mapping", {}))

    @property
    def additional_fusion_pattern(self) -> dict[Any, Any]:
        return dict(self.extra_fuse_dict.get("additional_fusion_pattern", {}))

    @property
    def additional_qat_module_mapping(self) -> dict[type, type]:
        return dict(self.extra_fuse_dict.get("additional_qat_module_mapping", {}))

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
        """Fuse, swap and insert quantizers as the backend's rules decide; the plan is stored on the result."""
        return prepare_graph(model, self.front_end(model, qconfig), is_qat, self.quantizer_bits)

    def front_end(self, model: fx.GraphModule, qconfig: QConfigPair) -> FrontEnd:
        """This quantizer's decisions for ``model`` as a plan front end."""
        return _PlacementFrontEnd(self, model, qconfig)

    def _fuser_methods(self) -> dict[Any, Callable[..., nn.Module]]:
        methods = dict(FUSER_METHODS)
        for key in ("additional_fuser_method_mapping", "additional_fusion_pattern"):
            methods.update({p: with_is_qat(p, f) for p, f in self.extra_fuse_dict.get(key, {}).items()})
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
        # the user's torch ops by name, in every spelling a capture writes (x.tanh(), torch.tanh; operator.add,
        # torch.add): torch.fx keeps the spelling of the source, torch.export writes one of its own
        spelled = {_torch_op_name(f) for f in self.extra_quantizer_dict.get("additional_function_type", ())} - {None}

        def quantizes_input(node: fx.Node) -> bool:
            if node.name in node_names:
                return True
            if node.op == "call_module":
                module = modules[str(node.target)]
                if isinstance(module, FusedModule):  # a fused chain is its first op (Conv-BN-ReLU: a Conv)
                    module = module[0]
                return isinstance(module, module_types)
            if node.op in ("call_function", "call_method"):
                return any(node.target is f or node.target == f for f in functions) or (
                    bool(spelled) and _torch_op_name(node.target) in spelled
                )
            return False

        return quantizes_input


def _torch_op_name(target: Any) -> str | None:
    """The name of a torch op in any of its spellings (a method name, ``torch.*``, ``F.*``, ``operator.*``, a
    ``Tensor`` method), or None for any other function."""
    if isinstance(target, str):
        return target
    name = getattr(target, "__name__", None)
    if not isinstance(name, str):
        return None
    for namespace in (torch, F, operator, torch.Tensor):
        if getattr(namespace, name, None) is target:
            return name
    return None


class _PlacementFrontEnd(FrontEnd):
    """A built-in backend's decisions: its Placement rules, the user's additions and exclusions, its qconfig."""

    name = "placement"
    spec: BackendSpec

    def __init__(self, quantizer: ModelQuantizer, model: fx.GraphModule, qconfig: QConfigPair) -> None:
        self.quantizer = quantizer
        self.spec = quantizer.spec
        self.backend = quantizer.spec.name
        self.qconfig = qconfig
        self._excluded = quantizer._excluded(model)
        self.edges: set[fx.Node] = set()
        self.modules: dict[str, nn.Module] = {}
        roles = quantizer.float_layers if quantizer.float_layers is not None else self.spec.float_layers
        self.float_roles = {node.name: role for node, role in float_layer_roles(model, roles).items()}

    def excluded(self, node: fx.Node) -> bool:
        return node.name in self.float_roles or self._excluded(node)

    def excluded_reason(self, node: fx.Node) -> str:
        role = self.float_roles.get(node.name)
        return float_layer_reason(role) if role is not None else super().excluded_reason(node)

    def fusion(self) -> tuple[Mapping[Any, Callable[..., nn.Module]], Callable[[fx.Node], bool]]:
        if not self.spec.fuse:
            return {}, lambda node: True
        return self.quantizer._fuser_methods(), lambda node: False

    def qat_mapping(self) -> Mapping[type, Any]:
        return self.quantizer._qat_mapping()

    def decide(self, gm: fx.GraphModule) -> None:
        if self.spec.placement.first_last_8bit:
            self.edges = edge_layers(gm.graph, dict(gm.named_modules()))
        self.modules = dict(gm.named_modules())

    def weight_quantizer(self, node: fx.Node, module: nn.Module) -> Factory | None:
        qconfig = self.qconfig
        factory = qconfig.weight
        if node in self.edges:
            factory = eight_bit_variant(factory)
            if qconfig.reduce_range:
                factory = reduced_range_variant(factory, self.spec.name)
        if node_kind(node, self.modules) == "deconv" and qconfig.weight_spec.scheme.per_channel:
            # ConvTranspose weights: [in, out / groups, ...]; their input channels are axis 0, so a group-wise
            # scheme quantizes them per output channel instead
            factory = factory.with_args(ch_axis=1, group_size=None)
        return factory

    def rules(self, gm: fx.GraphModule) -> Rules:
        return Rules(self.spec.placement, self.quantizer._quantizes_input(dict(gm.named_modules())), self.excluded)

    def activation_quantizer(self, site: ActivationSite) -> Factory:
        if self.qconfig.activation is None:
            raise ValueError(
                f"backend {self.spec.name!r} quantizes weights only and has no activation quantizer for {site}; "
                "drop the extra_quantizer_dict entries that ask for one, or use a backend with activation quantizers"
            )
        chosen = self.qconfig.activation
        if site.product_input and self.qconfig.product_activation is not None:
            chosen = self.qconfig.product_activation
        factory = activation_variant(chosen, site, self.qconfig.reduce_range, self.backend)
        if self.spec.placement.per_channel_depthwise_inputs and self._read_by_depthwise_only(site):
            factory = per_channel_input_variant(factory)
        return factory

    def _read_by_depthwise_only(self, site: ActivationSite) -> bool:
        readers = site.consumers if site.consumers is not None else set(site.value.users)
        return bool(readers) and all(_depthwise(node, self.modules) for node in readers)

    def float_reason(self, node: fx.Node, modules: Mapping[str, nn.Module]) -> str:
        kind = node_kind(node, modules)
        what = f"a {kind} op" if kind else "this op"
        return f"backend {self.backend!r} quantizes no input or output of {what} (its Placement rules)"


def activation_variant(factory: Factory, site: ActivationSite, reduce_range: bool, backend: str) -> Factory:
    """An activation quantizer's factory adjusted to its site: 8-bit edges, unsigned inputs, reduced products.

    One meaning on every front end: ``reduce_range`` narrows the signed right operand of every
    product of two activations, whoever declared the backend.
    """
    if site.eight_bit:
        factory = eight_bit_variant(factory)
    if site.unsigned:
        factory = unsigned_variant(factory)
    elif site.product_operand and reduce_range and _signed_eight_bit(factory):
        factory = reduced_range_variant(factory, backend)
    return factory


def _depthwise(node: fx.Node, modules: Mapping[str, nn.Module]) -> bool:
    """Whether ``node`` calls a depthwise 2-d convolution (fused with what follows it or not)."""
    module = modules.get(str(node.target)) if node.op == "call_module" else None
    if isinstance(module, nn.Sequential) and len(module):  # a fused ConvReLU2d / ConvBn2d before folding
        module = module[0]
    return isinstance(module, nn.Conv2d) and module.groups > 1 and module.groups == module.in_channels


def per_channel_input_variant(factory: Factory) -> Factory:
    """The activation quantizer with one scale per channel (axis 1) on the same grid."""
    low = factory.kwargs.get("quant_min")
    qscheme = factory.kwargs.get("qscheme")
    symmetric = qscheme in (torch.per_tensor_symmetric, torch.per_channel_symmetric) or (
        qscheme is None and low is not None and low < 0
    )
    return factory.with_args(qscheme=torch.per_channel_symmetric if symmetric else torch.per_channel_affine, ch_axis=1)


def _signed_eight_bit(factory: Factory) -> bool:
    low, high = factory.kwargs.get("quant_min"), factory.kwargs.get("quant_max")
    return low is not None and high is not None and low < 0 and high - low + 1 in (255, 256)


def with_is_qat(pattern: Any, fuser: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    """``fuser`` called as ``fuser(is_qat, *modules)`` (PyTorch's signature, used here).

    A fuser written without ``is_qat`` (``fuser(conv, bn)``, MQBench's older form: one parameter
    per op of the pattern) is wrapped so that it gets the modules alone.
    """
    try:
        parameters = list(inspect.signature(fuser).parameters.values())
    except (TypeError, ValueError):
        return fuser
    if any(p.kind is p.VAR_POSITIONAL for p in parameters) or (parameters and parameters[0].name == "is_qat"):
        return fuser
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    ops = len(pattern) if isinstance(pattern, tuple) else 1
    if len(positional) != ops:
        return fuser

    def fuse(is_qat: bool, *modules: nn.Module) -> nn.Module:
        return fuser(*modules)

    return fuse


def register_model_quantizer(backend: Any) -> Callable[[type[ModelQuantizer]], type[ModelQuantizer]]:
    """Class decorator: use this ModelQuantizer subclass for ``backend`` (a name or BackendType).

    As in MQBench, the backend need not be registered yet: the class is kept and applies when a
    backend of that name is (``ParamsTable[...] = ...`` or ``register_backend``).
    """

    def register(cls: type[ModelQuantizer]) -> type[ModelQuantizer]:
        if not (isinstance(cls, type) and issubclass(cls, ModelQuantizer)):
            raise ValueError(f"register_model_quantizer expects a ModelQuantizer subclass, got {cls!r}")
        key = backend_key(backend)
        pending_model_quantizers[key] = cls
        if key in ParamsTable:
            spec = ParamsTable[key]
            ParamsTable.register(spec.name, replace(spec, model_quantizer=cls), replace=True)
        return cls

    return register


def build_model_quantizer(
    spec: BackendSpec, extra_quantizer_dict: Mapping[str, Any] | None, extra_fuse_dict: Mapping[str, Any] | None
) -> ModelQuantizer:
    """The backend's ModelQuantizer, built with this package's signature or MQBench's two-argument one."""
    cls: type[ModelQuantizer] = spec.model_quantizer or pending_model_quantizers.get(spec.name) or ModelQuantizer
    try:
        parameters = [
            p
            for p in list(inspect.signature(cls.__init__).parameters.values())[1:]
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):
        parameters = []
    if parameters and parameters[0].name != "spec" and len(parameters) == 2:  # MQBench's (extra_q..., extra_fuse...)
        quantizer = cls(extra_quantizer_dict, extra_fuse_dict)  # type: ignore[arg-type]
        quantizer.spec = spec
        return quantizer
    return cls(spec, extra_quantizer_dict, extra_fuse_dict)


class _ModelQuantizers(MutableMapping[Any, type]):
    """MQBench's ``DEFAULT_MODEL_QUANTIZER``: backend -> the ModelQuantizer class prepare builds for it.

    A live view of the registered backends (their spec's ``model_quantizer``, else the rule-driven
    ``ModelQuantizer``) and of classes registered for names not registered yet; assigning a class
    is :func:`register_model_quantizer`.
    """

    def __getitem__(self, backend: Any) -> type:
        key = backend_key(backend)
        if key in ParamsTable:
            return ParamsTable[key].model_quantizer or pending_model_quantizers.get(key) or ModelQuantizer
        return pending_model_quantizers[key]

    def __setitem__(self, backend: Any, cls: type) -> None:
        register_model_quantizer(backend)(cls)

    def __delitem__(self, backend: Any) -> None:
        key = backend_key(backend)
        pending_model_quantizers.pop(key, None)
        if key in ParamsTable and ParamsTable[key].model_quantizer is not None:
            ParamsTable.register(key, replace(ParamsTable[key], model_quantizer=None), replace=True)

    def __iter__(self) -> Iterator[str]:
        return iter(dict.fromkeys([*ParamsTable, *pending_model_quantizers]))

    def __len__(self) -> int:
        return len(dict.fromkeys([*ParamsTable, *pending_model_quantizers]))


DEFAULT_MODEL_QUANTIZER = _ModelQuantizers()
