"""The backend registry: built-in specs, user registrations, and the read-only ``ParamsTable``.

Example:
    >>> from mqbench.backends import ParamsTable, register_backend, BackendSpec, Placement
    >>> "tensorrt" in ParamsTable and len(ParamsTable) >= 14
    True
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
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


class BackendRegistry(Mapping[str, BackendSpec]):
    """Backend name -> spec. Read-only as a mapping; extended through :meth:`register`."""

    def __init__(self, specs: Mapping[str, BackendSpec]) -> None:
        self._specs = dict(specs)
        self._builtin = frozenset(self._specs)

    def __getitem__(self, backend: Any) -> BackendSpec:
        key = _key(backend)
        if key not in self._specs:
            raise ValueError(f"unknown backend {backend!r}; valid backends: {', '.join(self._specs)}")
        return self._specs[key]

    def __contains__(self, backend: object) -> bool:
        try:
            return _key(backend) in self._specs
        except ValueError:
            return False

    def __iter__(self) -> Iterator[str]:
        return iter(self._specs)

    def __len__(self) -> int:
        return len(self._specs)

    def register(self, name: str, spec: BackendSpec, replace: bool = False) -> BackendSpec:
        key = _key(name)
        if key in self._specs and not replace:
            raise ValueError(f"backend {key!r} is already registered; pass replace=True to override it")
        if spec.name != key:
            from dataclasses import replace as dataclass_replace

            spec = dataclass_replace(spec, name=key)
        self._specs[key] = spec
        return spec

    def unregister(self, name: str) -> None:
        """Remove a user-registered backend (built-in ones stay); unknown names are ignored."""
        key = _key(name)
        if key in self._builtin:
            raise ValueError(f"{key!r} is a built-in backend and cannot be unregistered")
        self._specs.pop(key, None)


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
