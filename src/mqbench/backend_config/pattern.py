"""Patterns: the ops a backend config or qconfig mapping refers to.

An *op* is a module class (``torch.nn.Conv2d``), a function or operator
(``torch.add``, ``operator.add``, ``torch.nn.functional.relu``) or the name of a
tensor method (``"relu"``, ``"view"``). A *pattern* is one op, or a tuple of two or
more ops in execution order for a fusion, e.g. ``(nn.Conv2d, nn.BatchNorm2d, nn.ReLU)``.

Example:
    >>> import operator
    >>> from torch import nn
    >>> from mqbench.backend_config.pattern import check_pattern, pattern_ops, op_name
    >>> check_pattern((nn.Conv2d, nn.ReLU))
    (<class 'torch.nn.modules.conv.Conv2d'>, <class 'torch.nn.modules.activation.ReLU'>)
    >>> [op_name(op) for op in pattern_ops((nn.Linear, operator.add, "relu"))]
    ['torch.nn.modules.linear.Linear', '_operator.add', "'relu'"]
    >>> check_pattern(nn.ReLU())
    Traceback (most recent call last):
    ...
    ValueError: pattern: got an instance of ReLU; pass the module class ReLU instead
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeAlias

from torch import nn

__all__ = ["Op", "Pattern", "check_op", "check_pattern", "op_name", "pattern_ops"]

Op: TypeAlias = type[nn.Module] | Callable[..., Any] | str
Pattern: TypeAlias = Op | tuple[Op, ...]


def check_op(op: Any, what: str = "op") -> Op:
    """Return ``op`` if it is a module class, a function / operator or a method name; else raise ValueError."""
    if isinstance(op, str):
        if not op.isidentifier():
            raise ValueError(f"{what}: a method name must be a Python identifier, got {op!r}")
        return op
    if isinstance(op, tuple):
        raise ValueError(f"{what}: expected a single op here, got the tuple {op!r}")
    if isinstance(op, nn.Module):
        cls = type(op).__name__
        raise ValueError(f"{what}: got an instance of {cls}; pass the module class {cls} instead")
    if isinstance(op, type):
        if not issubclass(op, nn.Module):
            raise ValueError(f"{what}: a class must be a torch.nn.Module subclass, got {op!r}")
        return op
    if not callable(op):
        raise ValueError(
            f"{what}: expected a module class, a function or operator, or a method name string, got {op!r}"
        )
    try:
        hash(op)
    except TypeError:
        raise ValueError(f"{what}: {op!r} is not hashable, so it cannot key a configuration") from None
    return op


def check_pattern(pattern: Any, what: str = "pattern") -> Pattern:
    """Return ``pattern`` if it is one op or a flat tuple of two or more ops; else raise ValueError."""
    if isinstance(pattern, list):
        raise ValueError(f"{what}: a fusion pattern must be a tuple, got the list {pattern!r}")
    if not isinstance(pattern, tuple):
        return check_op(pattern, what)
    if len(pattern) < 2:
        raise ValueError(f"{what}: a fusion pattern needs at least two ops, got {pattern!r}; pass a single op bare")
    for position, op in enumerate(pattern):
        if isinstance(op, tuple):
            raise ValueError(
                f"{what}: fusion patterns are flat tuples of ops in execution order, "
                f"got a nested tuple at position {position} of {pattern!r}"
            )
        check_op(op, f"{what}[{position}]")
    return tuple(pattern)


def pattern_ops(pattern: Pattern) -> tuple[Op, ...]:
    """The ops of ``pattern`` in execution order (a one-element tuple for a single op)."""
    return pattern if isinstance(pattern, tuple) else (pattern,)


def op_name(op: Op) -> str:
    """A readable, stable name: ``module.Qualname`` for classes and functions, the quoted name for methods."""
    if isinstance(op, str):
        return repr(op)
    module = getattr(op, "__module__", None)
    name = getattr(op, "__qualname__" if isinstance(op, type) else "__name__", None)
    if name is None:
        return repr(op)
    return f"{module}.{name}" if module else str(name)
