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

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Generic, TypeVar

__all__ = ["WEIGHT_EQUALIZATION_FUNCTION", "Registry", "register_weight_equalization_function"]

# MQBench's registries and decorators, kept where they are implemented and read from here on first use (so
# that this module, which everything imports, imports nothing of the package): BACKEND_DEPLOY_FUNCTION,
# register_deploy_function, DEFAULT_MODEL_QUANTIZER, register_model_quantizer, FUSED_MODULE_CONVERT_FUNCTION,
# register_convert_function.
_ELSEWHERE = {
    "BACKEND_DEPLOY_FUNCTION": "mqbench.convert_deploy",
    "register_deploy_function": "mqbench.convert_deploy",
    "register_model_quantizer": "mqbench.custom_quantizer.model_quantizer",
    "DEFAULT_MODEL_QUANTIZER": "mqbench.custom_quantizer.model_quantizer",
    "FUSED_MODULE_CONVERT_FUNCTION": "mqbench.fusion_method",
    "register_convert_function": "mqbench.fusion_method",
}


def __getattr__(name: str) -> Any:
    if name in _ELSEWHERE:
        import importlib

        return getattr(importlib.import_module(_ELSEWHERE[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


T = TypeVar("T")

# MQBench's registry of pair equalizers: WEIGHT_EQUALIZATION_FUNCTION[first layer type] = {second layer type:
# function(modules, pair)}, where ``modules`` is ``dict(model.named_modules())`` and ``pair`` the two layers' graph
# nodes (or module names). ``mqbench.advanced_ptq.cross_layer_equalization`` equalizes a pair with the function
# registered for its two layer types (the nearest classes in their MROs) and with its own rule where none is.
PairEqualizer = Callable[[Mapping[str, Any], Sequence[Any]], Any]
WEIGHT_EQUALIZATION_FUNCTION: dict[type, dict[type, PairEqualizer]] = {}


def register_weight_equalization_function(layer1: type, layer2: type) -> Callable[[PairEqualizer], PairEqualizer]:
    """Register ``func(modules, pair)`` as the equalizer of a ``layer1`` followed by a ``layer2`` (MQBench's
    decorator; a later registration for the same ``layer1`` replaces the earlier one, as MQBench's does)."""

    def insert(
        func: Callable[[Mapping[str, Any], Sequence[Any]], Any],
    ) -> Callable[[Mapping[str, Any], Sequence[Any]], Any]:
        WEIGHT_EQUALIZATION_FUNCTION[layer1] = {layer2: func}
        return func

    return insert


def weight_equalization_function(first: type, second: type) -> Callable[[Mapping[str, Any], Sequence[Any]], Any] | None:
    """The equalizer registered for a ``first`` layer followed by a ``second`` one (nearest classes first)."""
    for one in first.__mro__:
        for two in second.__mro__:
            if two in WEIGHT_EQUALIZATION_FUNCTION.get(one, {}):
                return WEIGHT_EQUALIZATION_FUNCTION[one][two]
    return None


class Registry(Mapping[str, T], Generic[T]):
    """A read-only mapping of names to entries, extended only through :meth:`register`.

    The one registry of the package: observers and fake quantizers by class name, backends
    (:class:`mqbench.backends.BackendRegistry`) by their lowercase name. A subclass may normalise
    names (:meth:`_key`) and choose the error for an unknown one (``missing_error``).
    """

    missing_error: type[Exception] = KeyError  # raised for an unknown name (see _unknown)

    def __init__(self, kind: str, entries: Mapping[str, T]) -> None:
        self._kind = kind
        self._entries: dict[str, T] = {self._key(name): value for name, value in entries.items()}
        self._builtin = frozenset(self._entries)

    def _key(self, name: Any) -> str:
        return name

    def _unknown(self, name: Any) -> Exception:
        return self.missing_error(f"unknown {self._kind} {name!r}; registered: {', '.join(sorted(self._entries))}")

    def __getitem__(self, name: Any) -> T:
        key = self._key(name)
        if key not in self._entries:
            raise self._unknown(name) from None
        return self._entries[key]

    def __contains__(self, name: object) -> bool:
        try:
            return self._key(name) in self._entries
        except ValueError:
            return False

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def _add(self, name: Any, value: T, replace: bool) -> T:
        key = self._key(name)
        existing = self._entries.get(key)
        if existing is not None and existing is not value and not replace:
            raise ValueError(f"{self._kind} name {key!r} is already registered to {existing!r}; pass replace=True")
        self._entries[key] = value
        return value

    def __setitem__(self, name: Any, value: T) -> None:
        """``registry[name] = value``, as MQBench's dicts are extended: registers it, replacing a user entry."""
        key = self._key(name)
        if key in self._builtin and self._entries.get(key) is not value:
            raise ValueError(f"{key!r} is a built-in {self._kind}; register yours under another name")
        self._add(name, value, True)

    def register(self, cls: T, name: str | None = None, replace: bool = False) -> T:
        """Add ``cls`` under ``name`` (default: its class name) and return it.

        Registering a different entry under a taken name raises ValueError unless ``replace``.
        """
        return self._add(name or cls.__name__, cls, replace)  # type: ignore[attr-defined]

    def unregister(self, name: str) -> None:
        """Remove a user-registered entry (built-in ones stay); unknown names are ignored."""
        key = self._key(name)
        if key in self._builtin:
            raise ValueError(f"{key!r} is a built-in {self._kind} and cannot be unregistered")
        self._entries.pop(key, None)

    def resolve(self, spec: str | T) -> T:
        """An entry given either itself or its registered name."""
        if isinstance(spec, str):
            return self[spec]
        return spec
