"""A small name -> class registry used for observers and fake quantizers.

Example:
    >>> from mqbench.utils.registry import Registry
    >>> reg = Registry("widget", {})
    >>> class Gear: ...
    >>> reg.register(Gear) is Gear
    True
    >>> reg["Gear"] is Gear
    True
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Generic, TypeVar

__all__ = ["Registry"]

T = TypeVar("T", bound=type)


class Registry(Mapping[str, T], Generic[T]):
    """A read-only mapping of class names to classes, extended only through :meth:`register`."""

    def __init__(self, kind: str, entries: Mapping[str, T]) -> None:
        self._kind = kind
        self._entries: dict[str, T] = dict(entries)
        self._builtin = frozenset(self._entries)

    def __getitem__(self, name: str) -> T:
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(f"unknown {self._kind} {name!r}; registered: {', '.join(sorted(self._entries))}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def register(self, cls: T, name: str | None = None, replace: bool = False) -> T:
        """Add ``cls`` under ``name`` (default: its class name) and return it.

        Registering a different class under a taken name raises ValueError unless ``replace``.
        """
        key = name or cls.__name__
        existing = self._entries.get(key)
        if existing is not None and existing is not cls and not replace:
            raise ValueError(f"{self._kind} name {key!r} is already registered to {existing!r}; pass replace=True")
        self._entries[key] = cls
        return cls

    def unregister(self, name: str) -> None:
        """Remove a user-registered entry (built-in ones stay); unknown names are ignored."""
        if name in self._builtin:
            raise ValueError(f"{name!r} is a built-in {self._kind} and cannot be unregistered")
        self._entries.pop(name, None)

    def resolve(self, spec: str | T) -> T:
        """A class given either itself or its registered name."""
        if isinstance(spec, str):
            return self[spec]
        return spec
