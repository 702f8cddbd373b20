"""BackendConfig: the patterns a backend can fuse and quantize, and the dtypes it accepts for each.

Mirrors PyTorch's ``BackendConfig`` / ``BackendPatternConfig`` API. A
:class:`BackendPatternConfig` describes one pattern: how its input and output are
observed (:class:`ObservationType`), the :class:`~mqbench.backend_config.DTypeConfig`
entries the backend supports for it, the module classes involved when it is
quantized (root, QAT, reference quantized module), and, for a fusion pattern, the
fused module and the function that builds it.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from mqbench.backend_config import BackendConfig, BackendPatternConfig, DTypeConfig, ObservationType
    >>> int8 = DTypeConfig(input_dtype=torch.quint8, output_dtype=torch.quint8, weight_dtype=torch.qint8)
    >>> linear = (
    ...     BackendPatternConfig()
    ...     .set_pattern(nn.Linear)
    ...     .set_observation_type(ObservationType.OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT)
    ...     .add_dtype_config(int8)
    ...     .set_root_module(nn.Linear)
    ... )
    >>> backend = BackendConfig("example").set_backend_pattern_config(linear)
    >>> backend.config_for(nn.Linear) is linear, backend.config_for(nn.Conv2d)
    (True, None)
    >>> BackendConfig.from_dict(backend.to_dict()).to_dict() == backend.to_dict()
    True
"""

from __future__ import annotations

import enum
import inspect
from collections.abc import Callable, Iterable
from typing import Any

from torch import nn

from mqbench.backend_config.dtype_config import DTypeConfig
from mqbench.backend_config.pattern import Pattern, check_pattern, op_name, pattern_ops

__all__ = ["BackendConfig", "BackendPatternConfig", "ObservationType"]


class ObservationType(enum.Enum):
    """How the output of a quantized pattern is observed relative to its input.

    * ``OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT``: the output gets its own observer, so its
      quantization parameters differ from the input's (weighted ops, add, ...);
    * ``OUTPUT_SHARE_OBSERVER_WITH_INPUT``: the output reuses the input's observer and
      parameters (ops that only move or select values: max pooling, reshape, cat, ...);
    * ``INPUT_OUTPUT_NOT_OBSERVED``: neither is observed (ops on shapes or indices).
    """

    OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT = 0
    OUTPUT_SHARE_OBSERVER_WITH_INPUT = 1
    INPUT_OUTPUT_NOT_OBSERVED = 2


_PATTERN = "pattern"
_OBSERVATION_TYPE = "observation_type"
_DTYPE_CONFIGS = "dtype_configs"
_ROOT_MODULE = "root_module"
_QAT_MODULE = "qat_module"
_REFERENCE_MODULE = "reference_quantized_module_for_root"
_FUSED_MODULE = "fused_module"
_FUSER_METHOD = "fuser_method"
_SHARED_INPUTS = "shared_input_quantizer"  # mqbench's addition: the inputs share one quantizer
_PATTERN_DICT_KEYS = (
    _PATTERN,
    _OBSERVATION_TYPE,
    _DTYPE_CONFIGS,
    _ROOT_MODULE,
    _QAT_MODULE,
    _REFERENCE_MODULE,
    _FUSED_MODULE,
    _FUSER_METHOD,
    _SHARED_INPUTS,
)


def _check_module_class(setter: str, value: Any) -> type[nn.Module] | None:
    if value is None:
        return None
    if isinstance(value, nn.Module):
        cls = type(value).__name__
        raise ValueError(f"{setter}: got an instance of {cls}; pass the class {cls}")
    if not (isinstance(value, type) and issubclass(value, nn.Module)):
        raise ValueError(f"{setter}: expected a torch.nn.Module subclass or None, got {value!r}")
    return value


def _check_keys(owner: str, data: Any, valid: Iterable[str]) -> None:
    valid = list(valid)
    if not isinstance(data, dict):
        raise ValueError(f"{owner}.from_dict expects a dict, got {type(data).__name__}")
    unknown = sorted(repr(key) for key in data if key not in valid)
    if unknown:
        raise ValueError(f"{owner}.from_dict: unknown keys {unknown}; valid: {valid}")


class BackendPatternConfig:
    """How a backend fuses and/or quantizes one pattern; setters chain (each returns the config).

    ``pattern`` is a module class, a function or operator, a method name, or a tuple of
    those in execution order for a fusion (``(nn.Conv2d, nn.ReLU)``). The fuser method
    of a fusion pattern is called as ``fuser_method(is_qat, *modules)`` with the matched
    modules in the same order.
    """

    def __init__(self, pattern: Pattern | None = None) -> None:
        self._pattern: Pattern | None = None
        self._observation_type = ObservationType.OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT
        self._dtype_configs: list[DTypeConfig] = []
        self._root_module: type[nn.Module] | None = None
        self._qat_module: type[nn.Module] | None = None
        self._reference_quantized_module: type[nn.Module] | None = None
        self._fused_module: type[nn.Module] | None = None
        self._fuser_method: Callable[..., nn.Module] | None = None
        self._shared_input_quantizer = False
        if pattern is not None:
            self.set_pattern(pattern)

    # -- setters ---------------------------------------------------------------------------------
    def set_pattern(self, pattern: Pattern) -> BackendPatternConfig:
        """The op, or tuple of ops in execution order, this config describes."""
        self._pattern = check_pattern(pattern, "set_pattern")
        return self

    def set_observation_type(self, observation_type: ObservationType) -> BackendPatternConfig:
        """How the output is observed relative to the input (see :class:`ObservationType`)."""
        if not isinstance(observation_type, ObservationType):
            valid = ", ".join(f"ObservationType.{member.name}" for member in ObservationType)
            raise ValueError(f"set_observation_type: expected one of {valid}, got {observation_type!r}")
        self._observation_type = observation_type
        return self

    def add_dtype_config(self, dtype_config: DTypeConfig) -> BackendPatternConfig:
        """Add one supported combination of dtypes (tried in the order added)."""
        if not isinstance(dtype_config, DTypeConfig):
            raise ValueError(f"add_dtype_config: expected a DTypeConfig, got {dtype_config!r}")
        self._dtype_configs.append(dtype_config)
        return self

    def set_dtype_configs(self, dtype_configs: Iterable[DTypeConfig]) -> BackendPatternConfig:
        """Replace the supported dtype combinations."""
        if isinstance(dtype_configs, DTypeConfig):
            raise ValueError("set_dtype_configs: expected a list of DTypeConfig; use add_dtype_config for one")
        configs = list(dtype_configs)
        for config in configs:
            if not isinstance(config, DTypeConfig):
                raise ValueError(f"set_dtype_configs: every entry must be a DTypeConfig, got {config!r}")
        self._dtype_configs = configs
        return self

    def set_root_module(self, root_module: type[nn.Module] | None) -> BackendPatternConfig:
        """The float module class at the heart of the pattern (``nn.Conv2d`` for a conv-relu)."""
        self._root_module = _check_module_class("set_root_module", root_module)
        return self

    def set_qat_module(self, qat_module: type[nn.Module] | None) -> BackendPatternConfig:
        """The QAT module class the pattern's module is swapped for in quantization-aware training."""
        self._qat_module = _check_module_class("set_qat_module", qat_module)
        return self

    def set_reference_quantized_module(
        self, reference_quantized_module: type[nn.Module] | None
    ) -> BackendPatternConfig:
        """The reference quantized module class the root module is converted to."""
        self._reference_quantized_module = _check_module_class(
            "set_reference_quantized_module", reference_quantized_module
        )
        return self

    def set_fused_module(self, fused_module: type[nn.Module] | None) -> BackendPatternConfig:
        """The module class a fusion pattern is fused into."""
        self._fused_module = _check_module_class("set_fused_module", fused_module)
        return self

    def set_fuser_method(self, fuser_method: Callable[..., nn.Module] | None) -> BackendPatternConfig:
        """``fuser_method(is_qat, *modules) -> nn.Module``: builds the fused module of a fusion pattern."""
        if fuser_method is not None and (isinstance(fuser_method, (type, nn.Module)) or not callable(fuser_method)):
            raise ValueError(
                f"set_fuser_method: expected a function fuser_method(is_qat, *modules), got {fuser_method!r}"
            )
        self._fuser_method = fuser_method
        return self

    def set_shared_input_quantizer(self, shared: bool) -> BackendPatternConfig:
        """All tensor inputs of the op share one quantizer (a concatenation on power-of-two hardware).

        An addition to PyTorch's vocabulary: the hardware requires the inputs on one grid, so
        the plan gives them one quantizer module and deployment writes one set of parameters.
        """
        if not isinstance(shared, bool):
            raise ValueError(f"set_shared_input_quantizer: expected True or False, got {shared!r}")
        self._shared_input_quantizer = shared
        return self

    # -- read access -----------------------------------------------------------------------------
    @property
    def pattern(self) -> Pattern | None:
        return self._pattern

    @property
    def observation_type(self) -> ObservationType:
        return self._observation_type

    @property
    def dtype_configs(self) -> list[DTypeConfig]:
        return list(self._dtype_configs)

    @property
    def root_module(self) -> type[nn.Module] | None:
        return self._root_module

    @property
    def qat_module(self) -> type[nn.Module] | None:
        return self._qat_module

    @property
    def reference_quantized_module(self) -> type[nn.Module] | None:
        return self._reference_quantized_module

    @property
    def fused_module(self) -> type[nn.Module] | None:
        return self._fused_module

    @property
    def fuser_method(self) -> Callable[..., nn.Module] | None:
        return self._fuser_method

    @property
    def shared_input_quantizer(self) -> bool:
        return self._shared_input_quantizer

    def validate(self) -> BackendPatternConfig:
        """Check the fields against each other (done when added to a BackendConfig); raise ValueError."""
        pattern = self._pattern
        if pattern is None:
            raise ValueError("BackendPatternConfig has no pattern; call set_pattern(...) first")
        if self._fuser_method is not None:
            ops = pattern_ops(pattern)
            if len(ops) < 2:
                raise ValueError(
                    f"BackendPatternConfig for {op_name(ops[0])}: a fuser method needs a fusion pattern "
                    "(a tuple of two or more ops)"
                )
            try:
                signature = inspect.signature(self._fuser_method)
            except (TypeError, ValueError):  # builtins without a signature: trust them
                signature = None
            if signature is not None:
                try:
                    signature.bind(False, *ops)
                except TypeError:
                    names = ", ".join(op_name(op) for op in ops)
                    raise ValueError(
                        f"fuser method {getattr(self._fuser_method, '__name__', self._fuser_method)!r} must accept "
                        f"(is_qat, {len(ops)} modules) for the pattern ({names}); its signature is {signature}"
                    ) from None
        return self

    # -- plain-data form -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """``pattern``, ``observation_type``, ``dtype_configs`` (as dicts) and every set module/method entry."""
        out: dict[str, Any] = {
            _PATTERN: self._pattern,
            _OBSERVATION_TYPE: self._observation_type,
            _DTYPE_CONFIGS: [config.to_dict() for config in self._dtype_configs],
        }
        optional = {
            _ROOT_MODULE: self._root_module,
            _QAT_MODULE: self._qat_module,
            _REFERENCE_MODULE: self._reference_quantized_module,
            _FUSED_MODULE: self._fused_module,
            _FUSER_METHOD: self._fuser_method,
        }
        out.update({key: value for key, value in optional.items() if value is not None})
        if self._shared_input_quantizer:
            out[_SHARED_INPUTS] = True
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BackendPatternConfig:
        """Inverse of :meth:`to_dict` (dtype configs as dicts or DTypeConfig; unknown keys raise ValueError)."""
        _check_keys("BackendPatternConfig", data, _PATTERN_DICT_KEYS)
        config = cls()
        if data.get(_PATTERN) is not None:
            config.set_pattern(data[_PATTERN])
        if _OBSERVATION_TYPE in data:
            config.set_observation_type(data[_OBSERVATION_TYPE])
        config.set_dtype_configs(
            entry if isinstance(entry, DTypeConfig) else DTypeConfig.from_dict(entry)
            for entry in data.get(_DTYPE_CONFIGS, ())
        )
        config.set_root_module(data.get(_ROOT_MODULE))
        config.set_qat_module(data.get(_QAT_MODULE))
        config.set_reference_quantized_module(data.get(_REFERENCE_MODULE))
        config.set_fused_module(data.get(_FUSED_MODULE))
        config.set_fuser_method(data.get(_FUSER_METHOD))
        config.set_shared_input_quantizer(data.get(_SHARED_INPUTS, False))
        return config

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BackendPatternConfig):
            return NotImplemented
        return self.to_dict() == other.to_dict()

    __hash__ = None  # type: ignore[assignment]  # mutable

    def __repr__(self) -> str:
        pattern = "None" if self._pattern is None else ", ".join(op_name(op) for op in pattern_ops(self._pattern))
        return (
            f"BackendPatternConfig(pattern=({pattern}), {self._observation_type.name}, "
            f"{len(self._dtype_configs)} dtype configs)"
        )


class BackendConfig:
    """A named set of :class:`BackendPatternConfig`, one per pattern; setters chain.

    Setting a config for a pattern that already has one replaces it (in place, so
    :attr:`configs` keeps the order in which patterns were first set).
    """

    def __init__(self, name: str = "") -> None:
        self._name = ""
        self._configs: list[BackendPatternConfig] = []
        self.set_name(name)

    def set_name(self, name: str) -> BackendConfig:
        if not isinstance(name, str):
            raise ValueError(f"BackendConfig: name must be a string, got {name!r}")
        self._name = name
        return self

    @property
    def name(self) -> str:
        return self._name

    def set_backend_pattern_config(self, config: BackendPatternConfig) -> BackendConfig:
        """Add ``config`` (validated), replacing any config with the same pattern."""
        if not isinstance(config, BackendPatternConfig):
            raise ValueError(f"set_backend_pattern_config: expected a BackendPatternConfig, got {config!r}")
        config.validate()
        for position, existing in enumerate(self._configs):
            if existing.pattern == config.pattern:
                self._configs[position] = config
                return self
        self._configs.append(config)
        return self

    def set_backend_pattern_configs(self, configs: Iterable[BackendPatternConfig]) -> BackendConfig:
        """Add each config in turn (see :meth:`set_backend_pattern_config`)."""
        if isinstance(configs, BackendPatternConfig):
            raise ValueError("set_backend_pattern_configs: expected a list; use set_backend_pattern_config for one")
        for config in configs:
            self.set_backend_pattern_config(config)
        return self

    @property
    def configs(self) -> list[BackendPatternConfig]:
        """The pattern configs, in the order their patterns were first set."""
        return list(self._configs)

    def config_for(self, pattern: Pattern) -> BackendPatternConfig | None:
        """The config whose pattern equals ``pattern``, or None."""
        pattern = check_pattern(pattern, "config_for")
        for config in self._configs:
            if config.pattern == pattern:
                return config
        return None

    def to_dict(self) -> dict[str, Any]:
        """``{"name": ..., "configs": [pattern config dicts]}``."""
        return {"name": self._name, "configs": [config.to_dict() for config in self._configs]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BackendConfig:
        """Inverse of :meth:`to_dict` (configs as dicts or BackendPatternConfig; unknown keys raise ValueError)."""
        _check_keys("BackendConfig", data, ("name", "configs"))
        backend = cls(data.get("name", ""))
        backend.set_backend_pattern_configs(
            entry if isinstance(entry, BackendPatternConfig) else BackendPatternConfig.from_dict(entry)
            for entry in data.get("configs", ())
        )
        return backend

    def __repr__(self) -> str:
        return f"BackendConfig(name={self._name!r}, {len(self._configs)} pattern configs)"
