"""Every backend of :mod:`mqbench.backends` read back as a :class:`BackendConfig`.

:func:`get_backend_config` turns a :class:`~mqbench.backends.BackendSpec` (its schemes, its
placement and whether it fuses) into the BackendConfig vocabulary:

* one fusion config per pattern of :data:`~mqbench.fuser_method_mapping.FUSER_METHODS`
  (when the spec fuses), the ReLU matcher expanded into one pattern per member (a
  pattern holds one op per position), with the fused module the fuser builds for QAT
  and the fuser method itself; these configs carry no dtype configs;
* one quantization config per module class, function and method (see
  :mod:`mqbench.custom_quantizer.ops`) of every kind in ``inputs_of``, ``outputs_of`` and
  ``passthrough``, plus, for the weighted kinds (conv, linear, deconv), the fused modules
  (when the spec fuses) and the QAT modules, each with its root, QAT and integer
  reference module (:mod:`mqbench.nn.quantized`; for add, mul and concat the module the
  op converts to, although the pattern has no root module).

Observation types and dtypes, per kind:

* in ``outputs_of``: ``OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT``; input and output on the
  activation grid;
* in ``shared_inputs_of`` as well: ``set_shared_input_quantizer(True)`` (mqbench's addition to
  the vocabulary), the inputs share one quantizer;
* else in ``passthrough``: ``OUTPUT_SHARE_OBSERVER_WITH_INPUT``; input and output on the
  same activation grid;
* a weighted kind (conv, linear, deconv) in none of them: its weights are quantized all the
  same, so a weight-only pattern: ``torch.float`` input and output, the weight grid;
* else (``inputs_of`` only: the input is quantized, the output stays float):
  ``OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT`` with a ``torch.float`` output dtype, the way
  PyTorch writes an op whose quantized input yields a float output (its dynamic linear).
  ``INPUT_OUTPUT_NOT_OBSERVED`` would say the input is not observed either (it is for
  ``x.shape``). A qconfig has a single activation factory for input and output, so check
  such a pattern with ``kind=("input", "weight")``.

The grid of a scheme becomes a :class:`DTypeWithConstraints`: ``quint8`` / ``qint8`` up to
8 bits and ``uint16`` / ``int16`` above (``qint32`` where torch lacks them), unsigned when
``quant_min >= 0``, bounded by the scheme's ``quant_min`` / ``quant_max``; weighted kinds add
the weight grid and a ``torch.float`` bias. mqbench's observers report ``quint8`` / ``qint8``
for any width, so :func:`check_dtype_config` flags the dtype of a 16-bit grid while its range
still checks. The Academic backends leave their quantizers to the user (no schemes): they
are described with 8-bit defaults, ``quint8`` [0, 255] activations and ``qint8`` [-128, 127]
weights. A backend with ``unsigned_after`` kinds gets, for every pattern, a second dtype
config whose input is the unsigned grid of the same width (a consumer of a ReLU's output).

A BackendConfig is a description of the spec, not an equivalent; it cannot express:

* placement in the graph: whether a quantizer sits on an op's input or on its producer's
  output, and that a ``passthrough`` op moves its producer's output quantizer past itself
  only when it is the sole consumer;
* ``fused_mul_add`` (no quantizer between a mul and the add it alone feeds),
  ``add_needs_activations`` (an add quantized only when its inputs descend from weighted or
  normalising ops), ``network_inputs`` / ``network_outputs`` and ``first_last_8bit`` (8-bit
  first and last layers);
* which producers ``unsigned_after`` applies to (the unsigned config is only allowed);
* scheme details besides dtype and range: per-channel axis, symmetric zero point,
  power-of-two scales, and the fake quantizer and observer classes.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from mqbench.backend_config import get_backend_config
    >>> from mqbench.prepare_by_platform import BackendType
    >>> tensorrt = get_backend_config(BackendType.Tensorrt)
    >>> tensorrt.name
    'tensorrt'
    >>> conv = tensorrt.config_for(nn.Conv2d)
    >>> conv.observation_type.name, conv.qat_module.__name__, conv.reference_quantized_module.__module__
    ('OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT', 'Conv2d', 'mqbench.nn.quantized.conv')
    >>> int8 = conv.dtype_configs[0]
    >>> int8.weight_dtype, int8.constraints_of("weight").quant_min_lower_bound, int8.output_dtype
    (torch.qint8, -127, torch.float32)
    >>> tensorrt.config_for((nn.Conv2d, nn.BatchNorm2d, nn.ReLU)).fused_module.__name__
    'ConvBnReLU2d'
    >>> get_backend_config("snpe").config_for("view").observation_type.name
    'OUTPUT_SHARE_OBSERVER_WITH_INPUT'
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from mqbench.backend_config.backend_config import BackendConfig, BackendPatternConfig, ObservationType
from mqbench.backend_config.dtype_config import DTypeConfig, DTypeWithConstraints
from mqbench.backend_config.pattern import Op, check_op, op_name
from mqbench.backend_config.qconfig import QConfig
from mqbench.backend_config.qconfig_mapping import QConfigMapping
from mqbench.backends.registry import resolve_backend
from mqbench.backends.spec import BackendSpec, Placement, QuantizerSpec
from mqbench.custom_quantizer.ops import FUNCTION_KINDS, METHOD_KINDS, MODULE_KINDS, WEIGHTED_KINDS
from mqbench.custom_quantizer.qconfig import resolve_qconfig
from mqbench.fuser_method_mapping import FUSER_METHODS, QAT_MODULE_MAPPING, activation_module
from mqbench.nn import intrinsic as nni
from mqbench.nn import quantized as nnq
from mqbench.scheme import QuantScheme

__all__ = ["get_backend_config", "get_qconfig_mapping"]

# Used where a spec has no schemes (the Academic backends): PyTorch's 8-bit defaults.
_DEFAULT_ACTIVATION = QuantScheme(8, symmetric=False)  # quint8 [0, 255]
_DEFAULT_WEIGHT = QuantScheme(8, symmetric=True)  # qint8 [-128, 127]

# Integer modules of the ops without a root module, by op kind.
_ELEMENTWISE_REFERENCE: Mapping[str, type[nn.Module]] = MappingProxyType(
    {"add": nnq.Add, "mul": nnq.Mul, "concat": nnq.Cat}
)


# -- dtypes ----------------------------------------------------------------------------------------------
def _grid(bits: int, quant_min: int, quant_max: int) -> DTypeWithConstraints:
    """The dtype holding an integer grid of ``bits`` bits, bounded by the grid's range."""
    signed = quant_min < 0
    dtype: torch.dtype
    if bits <= 8:
        dtype = torch.qint8 if signed else torch.quint8
    else:
        wide = getattr(torch, "int16" if signed else "uint16", None)
        dtype = wide if isinstance(wide, torch.dtype) else torch.qint32
    return DTypeWithConstraints(dtype=dtype, quant_min_lower_bound=quant_min, quant_max_upper_bound=quant_max)


def _scheme(quantizer: QuantizerSpec | None, default: QuantScheme) -> QuantScheme:
    return default if quantizer is None else quantizer.scheme


def _activation_grids(spec: BackendSpec) -> list[DTypeWithConstraints]:
    """The activation grid, then its unsigned variant when the spec uses one after some kinds."""
    scheme = _scheme(spec.activation, _DEFAULT_ACTIVATION)
    grids = [_grid(scheme.bits, scheme.quant_min, scheme.quant_max)]
    if spec.placement.unsigned_after and scheme.quant_min < 0:
        # Same width, shifted to start at zero (as mqbench.custom_quantizer.qconfig.unsigned_variant does).
        grids.append(_grid(scheme.bits, 0, scheme.quant_max - scheme.quant_min))
    return grids


def _observation(kind: str, placement: Placement) -> tuple[ObservationType, bool]:
    """The observation type of ``kind`` and whether its output is quantized."""
    if kind in placement.outputs_of:
        return ObservationType.OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT, True
    if kind in placement.passthrough:
        return ObservationType.OUTPUT_SHARE_OBSERVER_WITH_INPUT, True
    return ObservationType.OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT, False


def _dtype_configs(kind: str, spec: BackendSpec) -> list[DTypeConfig]:
    observation, output_quantized = _observation(kind, spec.placement)
    grids = _activation_grids(spec)
    weighted = kind in WEIGHTED_KINDS
    weight_scheme = _scheme(spec.weight, _DEFAULT_WEIGHT)
    weight = _grid(weight_scheme.bits, weight_scheme.quant_min, weight_scheme.quant_max) if weighted else None
    configs = []
    for grid in grids:
        if observation is ObservationType.OUTPUT_SHARE_OBSERVER_WITH_INPUT:
            output: DTypeWithConstraints | torch.dtype = grid
        else:
            output = grids[0] if output_quantized else torch.float
        configs.append(
            DTypeConfig(
                input_dtype=grid,
                output_dtype=output,
                weight_dtype=weight,
                bias_dtype=torch.float if weighted else None,
            )
        )
    return configs


# -- fusion ----------------------------------------------------------------------------------------------
def _fused_classes() -> list[type[nni.FusedModule]]:
    """The fused module classes of :mod:`mqbench.nn.intrinsic`."""
    found = []
    for name in nni.__all__:
        obj = getattr(nni, name)
        if isinstance(obj, type) and issubclass(obj, nni.FusedModule) and obj.PARTS:
            found.append(obj)
    return found


def _expand(pattern: tuple[object, ...]) -> Iterator[tuple[Op, ...]]:
    """The flat patterns of a FUSER_METHODS key: every combination of the members of its tuple matchers."""
    choices = [entry if isinstance(entry, tuple) else (entry,) for entry in pattern]
    for ops in itertools.product(*choices):
        yield tuple(check_op(op, "fusion pattern") for op in ops)


def _module_type(op: Op) -> type[nn.Module]:
    """The module class an op of a fusion pattern becomes in the fused module (as the fuser converts it)."""
    return op if isinstance(op, type) else type(activation_module(op))


def _fused_module(pattern: tuple[Op, ...], candidates: list[type[nni.FusedModule]]) -> type[nni.FusedModule]:
    """The fused class whose parts accept the pattern's modules, position by position."""
    types = [_module_type(op) for op in pattern]
    matches = [
        cls
        for cls in candidates
        if len(cls.PARTS) == len(types)
        and all(issubclass(t, accepted) for t, (_, accepted) in zip(types, cls.PARTS, strict=True))
    ]
    if len(matches) > 1:  # the most specific one (ConvFreezebn2d's FrozenBatchNorm2d before ConvBn2d's BatchNorm2d)
        matches = [
            cls
            for cls in matches
            if all(
                all(
                    issubclass(mine[0], theirs[0])
                    for (_, mine), (_, theirs) in zip(cls.PARTS, other.PARTS, strict=True)
                )
                for other in matches
            )
        ]
    if len(matches) != 1:
        names = ", ".join(op_name(op) for op in pattern)
        found = ", ".join(cls.__name__ for cls in matches) or "none"
        raise ValueError(
            f"the fusion pattern ({names}) should match exactly one fused module of mqbench.nn.intrinsic, "
            f"matched: {found}"
        )
    return matches[0]


def _fusion_configs() -> list[BackendPatternConfig]:
    candidates = _fused_classes()
    configs = []
    for key, fuser in FUSER_METHODS.items():
        for pattern in _expand(key):
            configs.append(
                BackendPatternConfig(pattern)
                .set_fused_module(_fused_module(pattern, candidates))
                .set_fuser_method(fuser)
            )
    return configs


# -- quantization ----------------------------------------------------------------------------------------
def _layer(cls: type[nn.Module]) -> type[nn.Module]:
    """The float layer class of a float or fused module class."""
    if issubclass(cls, nni.FusedModule):
        return cls.PARTS[0][1][0]
    return cls


def _ops_of(kind: str) -> list[Op]:
    """The module classes, functions and method names of ``kind``, in that order."""
    ops: list[Op] = [cls for cls, k in MODULE_KINDS.items() if k == kind]
    ops += [fn for fn, k in FUNCTION_KINDS.items() if k == kind]
    ops += [name for name, k in METHOD_KINDS.items() if k == kind]
    return ops


def _weight_only(spec: BackendSpec) -> list[DTypeConfig]:
    """Float input and output, quantized weight: a layer the placement quantizes no activation of."""
    scheme = _scheme(spec.weight, _DEFAULT_WEIGHT)
    weight = _grid(scheme.bits, scheme.quant_min, scheme.quant_max)
    return [DTypeConfig(input_dtype=torch.float, output_dtype=torch.float, weight_dtype=weight, bias_dtype=torch.float)]


def _quantization_configs(
    kind: str, spec: BackendSpec, fused: list[type[nn.Module]], weight_only: bool = False
) -> list[BackendPatternConfig]:
    observation, _ = _observation(kind, spec.placement)
    dtype_configs = _weight_only(spec) if weight_only else _dtype_configs(kind, spec)

    shared = kind in spec.placement.shared_inputs_of

    def config(pattern: Op) -> BackendPatternConfig:
        return (
            BackendPatternConfig(pattern)
            .set_observation_type(observation)
            .set_dtype_configs(dtype_configs)
            .set_shared_input_quantizer(shared)
        )

    configs = []
    for op in _ops_of(kind):
        entry = config(op)
        if isinstance(op, type):
            entry.set_root_module(op).set_qat_module(QAT_MODULE_MAPPING.get(op))
            entry.set_reference_quantized_module(nnq.integer_module_for(op) if kind in WEIGHTED_KINDS else None)
        if entry.reference_quantized_module is None:
            entry.set_reference_quantized_module(_ELEMENTWISE_REFERENCE.get(kind))
        configs.append(entry)
    if kind not in WEIGHTED_KINDS:
        return configs
    fused_of_kind = [cls for cls in fused if MODULE_KINDS.get(_layer(cls)) == kind]
    for cls in fused_of_kind:
        configs.append(
            config(cls)
            .set_root_module(_layer(cls))
            .set_qat_module(QAT_MODULE_MAPPING.get(cls))
            .set_reference_quantized_module(nnq.integer_module_for(cls))
        )
    float_of_kind = [cls for cls in MODULE_KINDS if MODULE_KINDS[cls] == kind]
    for source in [*float_of_kind, *fused_of_kind]:
        qat = QAT_MODULE_MAPPING.get(source)
        if qat is not None:
            configs.append(
                config(qat)
                .set_root_module(_layer(source))
                .set_reference_quantized_module(nnq.integer_module_for(source))
            )
    return configs


def get_backend_config(backend: BackendSpec | str) -> BackendConfig:
    """The :class:`BackendConfig` describing ``backend`` (a BackendType, a registered name or a BackendSpec).

    A backend registered from a BackendConfig gives that BackendConfig back. Otherwise the
    result is named after the backend; fusion configs first (when the backend fuses), then the
    quantization configs by op kind. See the module docstring for the mapping and for
    what the description leaves out. Raises ValueError for an unknown backend.
    """
    spec = resolve_backend(backend)
    if isinstance(spec.declared, BackendConfig):  # registered from a BackendConfig: that one
        return spec.declared
    config = BackendConfig(spec.name)
    fusions = _fusion_configs() if spec.fuse else []
    config.set_backend_pattern_configs(fusions)
    fused = list(dict.fromkeys(entry.fused_module for entry in fusions if entry.fused_module is not None))
    placement = spec.placement
    activations = placement.inputs_of | placement.outputs_of | placement.passthrough
    for kind in sorted(activations):
        config.set_backend_pattern_configs(_quantization_configs(kind, spec, fused))
    for kind in sorted(WEIGHTED_KINDS - activations):  # prepare quantizes every layer's weights
        config.set_backend_pattern_configs(_quantization_configs(kind, spec, fused, weight_only=True))
    return config


def _with_dtype(factory: Any) -> Any:
    """``factory`` with the dtype its integer range needs (16-bit grids declare int16 / uint16)."""
    low, high = factory.kwargs.get("quant_min"), factory.kwargs.get("quant_max")
    if low is None or high is None:
        return factory
    return factory.with_args(dtype=_grid(16 if high - low + 1 > 256 else 8, low, high).dtype)


def get_qconfig_mapping(
    backend: BackendSpec | str, extra_qconfig_dict: Mapping[str, Any] | None = None
) -> QConfigMapping:
    """The QConfigMapping whose qconfig the backend's dtype configs accept: its own default quantizers.

    With ``get_backend_config(backend)``, ``prepare_fx`` then quantizes what ``prepare_by_platform``
    quantizes (``get_default_qconfig_mapping`` is PyTorch's quint8 default, which most backends'
    constraints refuse). ``extra_qconfig_dict`` changes the schemes as it does for
    ``prepare_by_platform`` (the Academic backends need it).

    Example:
        >>> from mqbench.backend_config import get_qconfig_mapping
        >>> qconfig = get_qconfig_mapping("tensorrt").global_qconfig
        >>> qconfig.weight.kwargs["quant_min"], qconfig.activation.kwargs["quant_min"]
        (-127, -128)
    """
    pair = resolve_qconfig(resolve_backend(backend), extra_qconfig_dict)
    qconfig = QConfig(activation=_with_dtype(pair.activation), weight=_with_dtype(pair.weight))
    return QConfigMapping().set_global(qconfig)
