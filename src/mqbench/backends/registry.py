"""The backend registry: built-in specs, user registrations, and the read-only ``ParamsTable``.

Example:
    >>> from mqbench.backends import ParamsTable, register_backend, BackendSpec, Placement
    >>> "tensorrt" in ParamsTable and len(ParamsTable) >= 14
    True
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace as dataclass_replace
from enum import Enum
from typing import Any

from mqbench.backends import (
    academic,
    academic_nlp,
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
    tensorrt_nlp,
    vitis,
)
from mqbench.backends.spec import BackendSpec
from mqbench.utils.registry import Registry

__all__ = ["BackendRegistry", "BackendType", "ParamsTable", "register_backend", "resolve_backend"]

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


class BackendType(str, Enum):
    """The built-in backends; each value is the registered backend name."""

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


def _key(backend: Any) -> str:
    if isinstance(backend, Enum):
        backend = backend.value
    if not isinstance(backend, str):
        raise ValueError(f"a backend is named by a BackendType, a string or a BackendSpec, got {backend!r}")
    return backend.lower()


class BackendRegistry(Registry[BackendSpec]):
    """Backend name (any case, or a BackendType) -> spec. Read-only as a mapping; extended through :meth:`register`."""

    def __init__(self, specs: Mapping[str, BackendSpec]) -> None:
        super().__init__("backend", specs)

    def _key(self, name: Any) -> str:
        return _key(name)

    def _unknown(self, name: Any) -> Exception:
        return ValueError(f"unknown backend {name!r}; valid backends: {', '.join(self)}")

    def register(self, name: str, spec: BackendSpec, replace: bool = False) -> BackendSpec:  # type: ignore[override]
        key = _key(name)
        if key in self and not replace:
            raise ValueError(f"backend {key!r} is already registered; pass replace=True to override it")
        return self._add(key, spec if spec.name == key else dataclass_replace(spec, name=key), True)


ParamsTable = BackendRegistry({module.SPEC.name: module.SPEC for module in _BUILTIN})


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
