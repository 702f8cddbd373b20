"""Declarative backends with the names of PyTorch's BackendConfig API, on mqbench's own observers.

* :class:`BackendConfig` / :class:`BackendPatternConfig`: which patterns a backend fuses and
  quantizes, how they are observed (:class:`ObservationType`) and which dtypes it accepts
  (:class:`DTypeConfig`, :class:`DTypeWithConstraints`);
* :class:`QConfig` / :class:`QConfigMapping`: which observers each op of a model gets;
* :func:`check_dtype_config` / :func:`first_matching_dtype_config`: whether a qconfig meets
  a backend's dtype constraints, naming each broken one.

Example (a backend whose only op is an int8 linear with a minimum scale of 2**-12):
    >>> import torch
    >>> from torch import nn
    >>> from mqbench.backend_config import (BackendConfig, BackendPatternConfig, DTypeConfig,
    ...     DTypeWithConstraints, QConfig, QConfigMapping, default_weight_observer,
    ...     first_matching_dtype_config, get_default_qconfig_mapping)
    >>> from mqbench.observer import MinMaxObserver
    >>> act = DTypeWithConstraints(dtype=torch.quint8, scale_min_lower_bound=2**-12)
    >>> int8 = DTypeConfig(input_dtype=act, output_dtype=act, weight_dtype=torch.qint8, bias_dtype=torch.float)
    >>> backend = BackendConfig("example").set_backend_pattern_config(
    ...     BackendPatternConfig(nn.Linear).add_dtype_config(int8).set_root_module(nn.Linear))
    >>> qconfig = QConfig(activation=MinMaxObserver.with_args(eps=2**-12), weight=default_weight_observer)
    >>> mapping = QConfigMapping().set_object_type(nn.Linear, qconfig)
    >>> first_matching_dtype_config(mapping.qconfig_for("fc", nn.Linear), backend.config_for(nn.Linear))[0] is int8
    True
    >>> default = get_default_qconfig_mapping().qconfig_for("fc", nn.Linear)
    >>> first_matching_dtype_config(default, backend.config_for(nn.Linear))[1]
    ["scale_min_lower_bound: the activation observer's eps 1.19e-07 is below 2**-12"]
"""

from __future__ import annotations

from mqbench.backend_config import declared as _declared  # noqa: F401  (registers BackendConfig with register_backend)
from mqbench.backend_config.backend_config import BackendConfig, BackendPatternConfig, ObservationType
from mqbench.backend_config.builtin import get_backend_config, get_qconfig_mapping
from mqbench.backend_config.constraints import (
    CONSTRAINT_NAMES,
    ConstraintViolation,
    ObserverInfo,
    check_dtype_config,
    first_matching_dtype_config,
    observer_info,
)
from mqbench.backend_config.dtype_config import (
    DTYPE_KINDS,
    DTypeConfig,
    DTypeKind,
    DTypeLike,
    DTypeWithConstraints,
)
from mqbench.backend_config.fixed_qparams import FixedQParamsObserver
from mqbench.backend_config.pattern import Op, Pattern, check_pattern, op_name, pattern_ops
from mqbench.backend_config.qconfig import (
    ObserverFactory,
    QConfig,
    default_observer,
    default_qconfig,
    default_weight_observer,
)
from mqbench.backend_config.qconfig_mapping import QConfigMapping, get_default_qconfig_mapping
from mqbench.backend_config.quantize_fx import convert_fx, prepare_fx, prepare_qat_fx
from mqbench.backend_config.report import quantization_report

__all__ = [
    "CONSTRAINT_NAMES",
    "DTYPE_KINDS",
    "BackendConfig",
    "BackendPatternConfig",
    "ConstraintViolation",
    "DTypeConfig",
    "DTypeKind",
    "DTypeLike",
    "DTypeWithConstraints",
    "FixedQParamsObserver",
    "ObservationType",
    "ObserverFactory",
    "ObserverInfo",
    "Op",
    "Pattern",
    "QConfig",
    "QConfigMapping",
    "check_dtype_config",
    "check_pattern",
    "convert_fx",
    "default_observer",
    "default_qconfig",
    "default_weight_observer",
    "first_matching_dtype_config",
    "get_backend_config",
    "get_default_qconfig_mapping",
    "get_qconfig_mapping",
    "observer_info",
    "op_name",
    "pattern_ops",
    "prepare_fx",
    "prepare_qat_fx",
    "quantization_report",
]
