"""The backend registry: built-in specs, user registrations, and the read-only ``ParamsTable``.

Example:
    >>> from mqbench.backends import ParamsTable, register_backend, BackendSpec, Placement
    >>> "tensorrt" in ParamsTable and len(ParamsTable) >= 14
    True
"""

from __future__ import annotations

import typing
from collections.abc import Callable, Mapping
from dataclasses import replace as dataclass_replace
from enum import Enum
from typing import Any

from mqbench.backends import (
    academic,
    academic_nlp,
    llm_w4a16,
    llm_w8a16,
    nnie,
    onnx_qnn,
    openvino,
    pplcuda,
    pplw8a16,
    qdq,
    snpe,
    stpu,
    tengine_u8,
    tensorrt,
    tensorrt_fp8,
    tensorrt_nlp,
    vitis,
)
from mqbench.backends.spec import BackendSpec, PTQRecipe, QuantizerSpec
from mqbench.scheme import QuantScheme
from mqbench.utils.registry import Registry

__all__ = [
    "PARAMS_KEYS",
    "BackendRegistry",
    "BackendType",
    "ParamsTable",
    "backend_key",
    "pending_model_quantizers",
    "register_backend",
    "resolve_backend",
    "spec_from_params",
]

_BUILTIN = (
    academic,
    tensorrt,
    snpe,
    pplw8a16,
    nnie,
    vitis,
    onnx_qnn,
    pplcuda,
    openvino,
    tengine_u8,
    tensorrt_nlp,
    academic_nlp,
    stpu,
    qdq,
)
# Built in beyond MQBench's fourteen (no BackendType member, whose list is MQBench's): the LLM formats.
_BUILTIN_BY_NAME = (llm_w4a16, llm_w8a16, tensorrt_fp8)


class BackendType(str, Enum):
    """The built-in backends; each value is the registered backend name.

    Where MQBench's guide adds a member to this enumeration in its source, call
    ``BackendType.add("Example")``: ``BackendType.Example`` (value ``"example"``) then exists.
    """

    Academic = "academic"
    Tensorrt = "tensorrt"
    SNPE = "snpe"
    PPLW8A16 = "pplw8a16"
    NNIE = "nnie"
    Vitis = "vitis"
    ONNX_QNN = "onnx_qnn"
    PPLCUDA = "pplcuda"
    OPENVINO = "openvino"
    Tengine_u8 = "tengine_u8"
    Tensorrt_NLP = "tensorrt_nlp"
    Academic_NLP = "academic_nlp"
    STPU = "stpu"
    QDQ = "qdq"

    @classmethod
    def add(cls, name: str, value: str | None = None) -> BackendType:
        """Add the member ``name`` (value ``value``, default ``name.lower()``) and return it; existing: returned."""
        value = (value or name).lower()
        if not name.isidentifier() or name.startswith("_"):
            raise ValueError(f"a BackendType member is named by a public identifier, got {name!r}")
        existing = cls._member_map_.get(name)
        if existing is not None:
            if existing.value != value:
                raise ValueError(f"BackendType.{name} exists with value {existing.value!r}, not {value!r}")
            return typing.cast(BackendType, existing)
        if value in cls._value2member_map_:
            raise ValueError(f"the value {value!r} is BackendType.{cls._value2member_map_[value].name} already")
        member = str.__new__(cls, value)
        member._name_, member._value_ = name, value
        member.__objclass__ = cls  # type: ignore[attr-defined]
        cls._member_map_[name] = member
        cls._member_names_.append(name)
        cls._value2member_map_[value] = member
        type.__setattr__(cls, name, member)
        return member

    @classmethod
    def remove(cls, name: str) -> None:
        """Remove a member added with :meth:`add` (built-in members stay); unknown names are ignored."""
        member = cls._member_map_.get(name)
        if member is None:
            return
        if name in _BUILTIN_MEMBERS:
            raise ValueError(f"BackendType.{name} is built in and cannot be removed")
        del cls._member_map_[name]
        cls._member_names_.remove(name)
        del cls._value2member_map_[member.value]
        type.__delattr__(cls, name)


_BUILTIN_MEMBERS = frozenset(BackendType.__members__)


def backend_key(backend: Any) -> str:
    """The registry key of a backend named by a BackendType or a string (its lowercase name)."""
    return _key(backend)


def _key(backend: Any) -> str:
    if isinstance(backend, Enum):
        backend = backend.value
    if not isinstance(backend, str):
        raise ValueError(f"a backend is named by a BackendType, a string or a BackendSpec, got {backend!r}")
    return backend.lower()


# ModelQuantizer classes registered (register_model_quantizer) for backends not registered yet: each
# applies when a backend of that name is registered, as MQBench's registration order allows.
pending_model_quantizers: dict[str, type] = {}


class BackendRegistry(Registry[BackendSpec]):
    """Backend name (any case, or a BackendType) -> spec. Read-only as a mapping; extended through :meth:`register`."""

    def __init__(self, specs: Mapping[str, BackendSpec]) -> None:
        super().__init__("backend", specs)

    def _key(self, name: Any) -> str:
        return _key(name)

    def _unknown(self, name: Any) -> Exception:
        return ValueError(f"unknown backend {name!r}; valid backends: {', '.join(self)}")

    def unregister(self, name: str) -> None:
        """Remove a user-registered backend and any ModelQuantizer registered for its name."""
        super().unregister(name)
        pending_model_quantizers.pop(_key(name), None)

    def __setitem__(self, name: Any, spec: Any) -> None:
        """``ParamsTable[BackendType.X] = {...}``: MQBench's table entry (see :func:`spec_from_params`), or a spec."""
        if not isinstance(spec, BackendSpec):
            spec = spec_from_params(_key(name), spec)
        self.register(name, spec, replace=_key(name) not in self._builtin)

    def register(self, name: str, spec: BackendSpec, replace: bool = False) -> BackendSpec:  # type: ignore[override]
        key = _key(name)
        if key in self and not replace:
            raise ValueError(f"backend {key!r} is already registered; pass replace=True to override it")
        if spec.name != key:
            spec = dataclass_replace(spec, name=key)
        if spec.model_quantizer is None and key in pending_model_quantizers:
            spec = dataclass_replace(spec, model_quantizer=pending_model_quantizers[key])
        return self._add(key, spec, True)


# MQBench's ParamsTable entry keys, and the BackendSpec field each one becomes.
PARAMS_KEYS = (
    "qtype",
    "w_qscheme",
    "a_qscheme",
    "default_weight_quantize",
    "default_act_quantize",
    "default_weight_observer",
    "default_act_observer",
)


def _scheme(value: Any, key: str) -> QuantScheme:
    if isinstance(value, QuantScheme):
        return value
    if isinstance(value, Mapping):
        return QuantScheme.from_dict(value)
    raise ValueError(f"{key} must be a QuantizeScheme or a dict of its keys (bit, symmetry, ...), got {value!r}")


def spec_from_params(name: str, params: Mapping[str, Any], like: str = "tensorrt") -> BackendSpec:
    """A BackendSpec from MQBench's ``ParamsTable`` entry (``dict(qtype=..., w_qscheme=..., ...)``).

    The schemes and classes come from the entry; what MQBench keeps elsewhere (where quantizers go,
    which files deploy writes) from the backend ``like`` (default: TensorRT, whose rules MQBench's
    guide extends: the inputs of quantizable ops). A ``ModelQuantizer`` registered for ``name``
    (``register_model_quantizer``) decides placement as in MQBench. An entry without schemes
    (``dict(qtype="affine")``, the Academic entry) takes them from ``extra_qconfig_dict``.
    """
    if not isinstance(params, Mapping):
        raise ValueError(f"a ParamsTable entry is a dict of {', '.join(PARAMS_KEYS)}, got {type(params).__name__}")
    unknown = [key for key in params if key not in PARAMS_KEYS]
    if unknown:
        raise ValueError(f"unknown ParamsTable key(s) {unknown}; valid keys: {', '.join(PARAMS_KEYS)}")
    qtype = params.get("qtype", "affine")
    if qtype not in ("affine", "nnie", "vitis"):
        raise ValueError(f"qtype must be 'affine', 'nnie' or 'vitis', got {qtype!r}")
    base = ParamsTable[like]

    def quantizer(scheme_key: str, fake_key: str, observer_key: str) -> QuantizerSpec | None:
        if scheme_key not in params:
            missing = [k for k in (fake_key, observer_key) if k in params]
            if missing:
                raise ValueError(f"the ParamsTable entry gives {missing} but no {scheme_key}")
            return None
        return QuantizerSpec(
            _scheme(params[scheme_key], scheme_key),
            params.get(fake_key, "LearnableFakeQuantize"),
            params.get(observer_key, "MinMaxObserver"),
        )

    weight = quantizer("w_qscheme", "default_weight_quantize", "default_weight_observer")
    activation = quantizer("a_qscheme", "default_act_quantize", "default_act_observer")
    return dataclass_replace(
        base,
        name=name,
        weight=weight,
        activation=activation,
        model_quantizer=None,
        description=f"registered through ParamsTable (placement of {like!r})",
        deploy=(),
        declared=None,
        ptq_recipe=PTQRecipe(),  # its own observers, calibrated as they are
    )


ParamsTable = BackendRegistry({module.SPEC.name: module.SPEC for module in (*_BUILTIN, *_BUILTIN_BY_NAME)})


# Builders of a BackendSpec from another declaration (mqbench.backend_config adds the BackendConfig one
# when it is imported, which anyone holding a BackendConfig has done): each returns None for objects
# it does not build from.
_SPEC_BUILDERS: list[Callable[[str, Any], BackendSpec | None]] = []


def register_spec_builder(builder: Callable[[str, Any], BackendSpec | None]) -> None:
    """Let :func:`register_backend` accept another kind of declaration: ``builder(name, obj)``."""
    if builder not in _SPEC_BUILDERS:
        _SPEC_BUILDERS.append(builder)


def register_backend(name: str, spec: Any, replace: bool = False) -> BackendSpec:
    """Make ``name`` usable everywhere a backend is accepted.

    ``spec`` is a BackendSpec, or a ``mqbench.backend_config.BackendConfig`` (compiled into one:
    the same engine, deciding per node from its patterns and dtype constraints).
    Registering a taken name raises ValueError unless ``replace``.
    """
    if not isinstance(spec, BackendSpec):
        built = next((b for b in (builder(name, spec) for builder in _SPEC_BUILDERS) if b is not None), None)
        if built is None:
            raise ValueError(f"register_backend expects a BackendSpec or a BackendConfig, got {type(spec).__name__}")
        spec = built
    return ParamsTable.register(name, spec, replace)


def resolve_backend(backend: Any) -> BackendSpec:
    """The spec for a BackendType, a registered name or a BackendSpec."""
    if isinstance(backend, BackendSpec):
        return backend
    return ParamsTable[backend]
