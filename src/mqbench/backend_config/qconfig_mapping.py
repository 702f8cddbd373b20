"""QConfigMapping: which QConfig each op of a model gets (PyTorch's ``QConfigMapping``).

Entries are matched with this precedence, highest first:

1. ``set_module_name_object_type_order(module_name, object_type, index, qconfig)``: the
   ``index``-th call (counting from 0) of ``object_type`` inside the forward of module ``module_name``;
2. ``set_module_name(name, qconfig)``: the module ``name`` or, failing that, its closest
   configured parent (``"a.b.c"`` falls back to ``"a.b"``, then ``"a"``);
3. ``set_module_name_regex(regex, qconfig)``: the first registered regex that ``re.match``-es the name;
4. ``set_object_type(object_type, qconfig)``: the module class, function or method name;
5. ``set_global(qconfig)``.

A ``None`` qconfig at any level means "do not quantize", and it wins over lower levels.

Example:
    >>> from torch import nn
    >>> from mqbench.backend_config import QConfigMapping, default_qconfig
    >>> mapping = QConfigMapping().set_global(default_qconfig).set_module_name("head", None)
    >>> mapping.qconfig_for("backbone.conv1", nn.Conv2d) is default_qconfig
    True
    >>> mapping.qconfig_for("head.fc", nn.Linear) is None
    True
    >>> QConfigMapping.from_dict(mapping.to_dict()).to_dict() == mapping.to_dict()
    True
"""

from __future__ import annotations

import re
from typing import Any

from mqbench.backend_config.pattern import Op, check_op, op_name
from mqbench.backend_config.qconfig import QConfig, default_qconfig

__all__ = ["QConfigMapping", "get_default_qconfig_mapping"]

_GLOBAL_KEY = ""
_OBJECT_TYPE_KEY = "object_type"
_REGEX_KEY = "module_name_regex"
_NAME_KEY = "module_name"
_ORDER_KEY = "module_name_object_type_order"
_DICT_KEYS = (_GLOBAL_KEY, _OBJECT_TYPE_KEY, _REGEX_KEY, _NAME_KEY, _ORDER_KEY)


def _check_qconfig(where: str, qconfig: Any) -> QConfig | None:
    if qconfig is not None and not isinstance(qconfig, QConfig):
        raise ValueError(f"{where}: expected a QConfig or None (do not quantize), got {qconfig!r}")
    return qconfig


def _check_name(where: str, name: Any) -> str:
    if not isinstance(name, str):
        raise ValueError(f"{where}: a module name must be a string, got {name!r}")
    return name


class QConfigMapping:
    """Maps the ops of a model to QConfigs; setters chain (each returns the mapping)."""

    def __init__(self) -> None:
        self._has_global = False
        self._global: QConfig | None = None
        self._object_type: dict[Op, QConfig | None] = {}
        self._module_name_regex: dict[str, QConfig | None] = {}
        self._compiled: dict[str, re.Pattern[str]] = {}
        self._module_name: dict[str, QConfig | None] = {}
        self._order: dict[tuple[str, Op, int], QConfig | None] = {}

    # -- setters ---------------------------------------------------------------------------------
    def set_global(self, global_qconfig: QConfig | None) -> QConfigMapping:
        """The qconfig of every op no other entry matches."""
        self._global = _check_qconfig("set_global", global_qconfig)
        self._has_global = True
        return self

    def set_object_type(self, object_type: Op, qconfig: QConfig | None) -> QConfigMapping:
        """The qconfig of every module of a class, call of a function, or call of a tensor method."""
        key = check_op(object_type, "set_object_type")
        self._object_type[key] = _check_qconfig("set_object_type", qconfig)
        return self

    def set_module_name_regex(self, module_name_regex: str, qconfig: QConfig | None) -> QConfigMapping:
        """The qconfig of modules whose qualified name ``re.match``-es the regex (first registered wins)."""
        _check_name("set_module_name_regex", module_name_regex)
        try:
            compiled = re.compile(module_name_regex)
        except re.error as exc:
            raise ValueError(f"set_module_name_regex: invalid regex {module_name_regex!r}: {exc}") from None
        self._module_name_regex[module_name_regex] = _check_qconfig("set_module_name_regex", qconfig)
        self._compiled[module_name_regex] = compiled
        return self

    def set_module_name(self, module_name: str, qconfig: QConfig | None) -> QConfigMapping:
        """The qconfig of the module ``module_name`` and of everything inside it."""
        self._module_name[_check_name("set_module_name", module_name)] = _check_qconfig("set_module_name", qconfig)
        return self

    def set_module_name_object_type_order(
        self, module_name: str, object_type: Op, index: int, qconfig: QConfig | None
    ) -> QConfigMapping:
        """The qconfig of the ``index``-th call (from 0) of ``object_type`` in the forward of ``module_name``."""
        where = "set_module_name_object_type_order"
        _check_name(where, module_name)
        key_type = check_op(object_type, where)
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise ValueError(f"{where}: index must be a non-negative int, got {index!r}")
        self._order[(module_name, key_type, index)] = _check_qconfig(where, qconfig)
        return self

    # -- read access -----------------------------------------------------------------------------
    @property
    def global_qconfig(self) -> QConfig | None:
        return self._global

    @property
    def object_type_qconfigs(self) -> dict[Op, QConfig | None]:
        return dict(self._object_type)

    @property
    def module_name_regex_qconfigs(self) -> dict[str, QConfig | None]:
        return dict(self._module_name_regex)

    @property
    def module_name_qconfigs(self) -> dict[str, QConfig | None]:
        return dict(self._module_name)

    @property
    def module_name_object_type_order_qconfigs(self) -> dict[tuple[str, Op, int], QConfig | None]:
        return dict(self._order)

    # -- resolution ------------------------------------------------------------------------------
    def qconfig_for(
        self, module_qualname: str, module_or_function_type: Op, *, index: int | None = None
    ) -> QConfig | None:
        """The qconfig of one op, or None (not quantized).

        ``module_qualname`` is the module's qualified name for a module call, or the name
        of the module whose forward makes the call for a function or method call (``""``
        for the top level); ``index`` counts earlier calls of the same function or method
        in that forward, and is needed only for ``set_module_name_object_type_order`` entries.
        """
        _check_name("qconfig_for", module_qualname)
        if index is not None:
            key = (module_qualname, module_or_function_type, index)
            if key in self._order:
                return self._order[key]
        name = module_qualname
        while name:
            if name in self._module_name:
                return self._module_name[name]
            name = name.rpartition(".")[0]
        for regex, compiled in self._compiled.items():
            if compiled.match(module_qualname):
                return self._module_name_regex[regex]
        if module_or_function_type in self._object_type:
            return self._object_type[module_or_function_type]
        return self._global

    # -- plain-data form -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """``{"": global, "object_type": [(type, qconfig)], "module_name_regex": [...], "module_name": [...],
        "module_name_object_type_order": [(module_name, type, index, qconfig)]}``, each list in insertion order.
        """
        out: dict[str, Any] = {}
        if self._has_global:
            out[_GLOBAL_KEY] = self._global
        out[_OBJECT_TYPE_KEY] = list(self._object_type.items())
        out[_REGEX_KEY] = list(self._module_name_regex.items())
        out[_NAME_KEY] = list(self._module_name.items())
        out[_ORDER_KEY] = [(*key, qconfig) for key, qconfig in self._order.items()]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> QConfigMapping:
        """Inverse of :meth:`to_dict` (unknown keys raise ValueError)."""
        if not isinstance(data, dict):
            raise ValueError(f"QConfigMapping.from_dict expects a dict, got {type(data).__name__}")
        unknown = sorted(repr(key) for key in data if key not in _DICT_KEYS)
        if unknown:
            raise ValueError(f"QConfigMapping.from_dict: unknown keys {unknown}; valid: {list(_DICT_KEYS)}")
        mapping = cls()
        if _GLOBAL_KEY in data:
            mapping.set_global(data[_GLOBAL_KEY])
        for key, setter, width in (
            (_OBJECT_TYPE_KEY, mapping.set_object_type, 2),
            (_REGEX_KEY, mapping.set_module_name_regex, 2),
            (_NAME_KEY, mapping.set_module_name, 2),
            (_ORDER_KEY, mapping.set_module_name_object_type_order, 4),
        ):
            for entry in data.get(key, ()):
                if not isinstance(entry, (tuple, list)) or len(entry) != width:
                    raise ValueError(f"QConfigMapping.from_dict: {key} entries must be {width}-tuples, got {entry!r}")
                setter(*entry)
        return mapping

    def __repr__(self) -> str:
        parts = []
        if self._has_global:
            parts.append(f"global={self._global!r}")
        parts += [f"object_type[{op_name(key)}]={value!r}" for key, value in self._object_type.items()]
        parts += [f"module_name_regex[{key!r}]={value!r}" for key, value in self._module_name_regex.items()]
        parts += [f"module_name[{key!r}]={value!r}" for key, value in self._module_name.items()]
        parts += [
            f"module_name_object_type_order[{name!r}, {op_name(op)}, {index}]={value!r}"
            for (name, op, index), value in self._order.items()
        ]
        return f"QConfigMapping({', '.join(parts)})"


def get_default_qconfig_mapping() -> QConfigMapping:
    """A new mapping with ``default_qconfig`` as the global qconfig.

    Example:
        >>> from mqbench.backend_config import default_qconfig, get_default_qconfig_mapping
        >>> get_default_qconfig_mapping().global_qconfig is default_qconfig
        True
    """
    return QConfigMapping().set_global(default_qconfig)
