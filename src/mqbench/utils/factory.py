"""``with_args``: class factories with bound keyword arguments (PyTorch's observer idiom).

Example:
    >>> from mqbench.observer import MinMaxObserver
    >>> factory = MinMaxObserver.with_args(quant_min=0, quant_max=15)
    >>> factory().quant_max
    15
"""

from __future__ import annotations

from typing import Any

__all__ = ["Factory"]


class Factory:
    """A callable that builds ``cls`` with the bound keyword arguments, updated by call-time ones."""

    def __init__(self, cls: type, kwargs: dict[str, Any]) -> None:
        self.cls = cls
        self.kwargs = dict(kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.cls(*args, **{**self.kwargs, **kwargs})

    def with_args(self, **kwargs: Any) -> Factory:
        return Factory(self.cls, {**self.kwargs, **kwargs})

    def __repr__(self) -> str:
        bound = ", ".join(f"{key}={value!r}" for key, value in self.kwargs.items())
        return f"{self.cls.__name__}.with_args({bound})"
