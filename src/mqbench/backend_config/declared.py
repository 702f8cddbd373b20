"""A BackendConfig registered as a backend: ``register_backend(name, backend_config)``.

The backend's spec carries the BackendConfig (``BackendSpec.declared``) and a model quantizer
that runs the same engine passes with the config's per-node decisions, so
``prepare_by_platform(model, name)``, ``convert_deploy`` and ``verify_deploy`` work as for a
built-in backend. Without a QConfigMapping, every op gets the backend's default qconfig, built
from its first dtype configs: a FixedFakeQuantize with a MinMax observer for weights and an
EMA-MinMax observer for activations, on the dtype's integer range narrowed to the
constraints, with ``eps`` at the scale lower bound.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from mqbench.backend_config import BackendConfig, BackendPatternConfig, DTypeConfig
    >>> from mqbench.backend_config.declared import backend_spec_from_config
    >>> int8 = DTypeConfig(input_dtype=torch.quint8, output_dtype=torch.quint8, weight_dtype=torch.qint8)
    >>> config = BackendConfig("npu").set_backend_pattern_config(BackendPatternConfig(nn.Linear).add_dtype_config(int8))
    >>> spec = backend_spec_from_config("npu", config)
    >>> spec.weight.scheme.quant_range, spec.activation.scheme.quant_range
    ((-128, 127), (0, 255))
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from mqbench.backend_config.backend_config import BackendConfig
from mqbench.backend_config.dtype_config import DTypeConfig, DTypeWithConstraints
from mqbench.backend_config.engine import apply_backend_config
from mqbench.backend_config.qconfig import QConfig
from mqbench.backends.registry import register_spec_builder
from mqbench.backends.spec import BackendSpec, Placement, QuantizerSpec
from mqbench.custom_quantizer.model_quantizer import ModelQuantizer
from mqbench.custom_quantizer.qconfig import QConfigPair
from mqbench.scheme import QuantScheme

__all__ = ["DeclaredModelQuantizer", "backend_spec_from_config"]

_SIGNED = {torch.qint8: True, torch.quint8: False, torch.int8: True, torch.uint8: False}


# What a BackendConfig decides itself: these keys would add to it, which only a pattern can say.
_DECLARED_BY_PATTERNS = (
    "additional_function_type",
    "additional_module_type",
    "additional_node_name",
    "additional_fuser_method_mapping",
    "additional_fusion_pattern",
    "additional_qat_module_mapping",
)


class DeclaredModelQuantizer(ModelQuantizer):
    """The engine's passes with the per-node decisions of the spec's BackendConfig.

    The exclusion keys of ``extra_quantizer_dict`` (``exclude_node_name``, ``exclude_module_name``,
    ``exclude_function_type``) mean what they mean on a built-in backend; the ``additional_*``
    keys are refused, since what is quantized and fused is the BackendConfig's to declare.
    """

    def prepare(self, model: fx.GraphModule, qconfig: QConfigPair, is_qat: bool) -> fx.GraphModule:
        backend_config = self.spec.declared
        if not isinstance(backend_config, BackendConfig):
            raise ValueError(f"backend {self.spec.name!r} declares no BackendConfig")
        given = {**self.extra_quantizer_dict, **self.extra_fuse_dict}
        additions = [key for key in _DECLARED_BY_PATTERNS if given.get(key)]
        if additions:
            raise ValueError(
                f"backend {self.spec.name!r} is declared by a BackendConfig, which decides what is quantized and "
                f"fused: {', '.join(additions)} cannot add to it; add a BackendPatternConfig for the op instead"
            )
        uniform = QConfig(activation=qconfig.activation, weight=qconfig.weight)
        return apply_backend_config(
            model,
            backend_config,
            lambda *_: uniform,
            is_qat,
            self._excluded(model),
            backend=self.spec.name,
            reduce_range=qconfig.reduce_range,
            spec=self.spec,
            widths=self.quantizer_bits,
        )


def _quantizer(constraint: DTypeWithConstraints | None, weight: bool, backend: str) -> QuantizerSpec:
    dtype = constraint.dtype if constraint is not None and constraint.dtype is not None else None
    dtype = dtype or (torch.qint8 if weight else torch.quint8)
    if dtype not in _SIGNED:
        raise ValueError(
            f"backend {backend!r}: its first dtype config's {'weight' if weight else 'input'} dtype is {dtype}; "
            "a default qconfig can be built for 8-bit integer dtypes (qint8, quint8)"
        )
    signed = _SIGNED[dtype]
    scheme = QuantScheme(8, symmetric=signed)
    low, high = scheme.quant_range
    extra: dict[str, Any] = {}
    if constraint is not None:
        if constraint.quant_min_lower_bound is not None and constraint.quant_min_lower_bound > low:
            extra["quant_min"] = int(constraint.quant_min_lower_bound)
        if constraint.quant_max_upper_bound is not None and constraint.quant_max_upper_bound < high:
            extra["quant_max"] = int(constraint.quant_max_upper_bound)
        if constraint.scale_min_lower_bound is not None:
            extra["eps"] = float(constraint.scale_min_lower_bound)
    observer = "MinMaxObserver" if weight else "EMAMinMaxObserver"
    return QuantizerSpec(scheme, fake_quantize="FixedFakeQuantize", observer=observer, observer_kwargs=extra)


def backend_spec_from_config(name: str, backend_config: BackendConfig) -> BackendSpec:
    """The BackendSpec that makes ``backend_config`` a registered backend (see the module docstring)."""
    if not isinstance(backend_config, BackendConfig):
        raise ValueError(f"expected a BackendConfig, got {type(backend_config).__name__}")
    dtype_configs: list[DTypeConfig] = [dc for config in backend_config.configs for dc in config.dtype_configs]
    if not dtype_configs:
        raise ValueError(f"BackendConfig {backend_config.name!r} quantizes nothing: no pattern has a dtype config")
    with_weight = next((dc for dc in dtype_configs if dc.weight_dtype is not None), None)
    weight = _quantizer(with_weight.constraints_of("weight") if with_weight else None, True, name)
    activation = _quantizer(dtype_configs[0].constraints_of("input"), False, name)
    patterns = sum(1 for config in backend_config.configs if config.dtype_configs)
    return BackendSpec(
        name=name.lower(),
        weight=weight,
        activation=activation,
        placement=Placement(),
        description=f"declared by BackendConfig {backend_config.name!r} ({patterns} quantized patterns)",
        model_quantizer=DeclaredModelQuantizer,
        declared=backend_config,
    )


def _from_backend_config(name: str, declaration: Any) -> BackendSpec | None:
    return backend_spec_from_config(name, declaration) if isinstance(declaration, BackendConfig) else None


register_spec_builder(_from_backend_config)
