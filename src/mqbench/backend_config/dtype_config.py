"""Dtypes a backend accepts for one pattern, with optional limits on their quantization parameters.

A :class:`DTypeConfig` names the dtype of each tensor around a quantized op
(``input``, ``output``, ``weight``, ``bias``); each entry is a ``torch.dtype`` or a
:class:`DTypeWithConstraints` that also bounds the integer range and the scale a
qconfig may use for it.

Example:
    >>> import torch
    >>> from mqbench.backend_config import DTypeConfig, DTypeWithConstraints
    >>> act = DTypeWithConstraints(dtype=torch.quint8, quant_min_lower_bound=0, quant_max_upper_bound=255)
    >>> config = DTypeConfig(input_dtype=act, output_dtype=act, weight_dtype=torch.qint8, bias_dtype=torch.float)
    >>> config.input_dtype, config.weight_dtype
    (torch.quint8, torch.qint8)
    >>> config.constraints_of("input").quant_max_upper_bound
    255
    >>> DTypeConfig.from_dict(config.to_dict()) == config
    True
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Literal, TypeAlias

import torch

__all__ = ["DTYPE_KINDS", "DTypeConfig", "DTypeKind", "DTypeLike", "DTypeWithConstraints"]

DTypeKind: TypeAlias = Literal["input", "output", "weight", "bias"]
DTYPE_KINDS: tuple[DTypeKind, ...] = ("input", "output", "weight", "bias")


def _check_number(owner: str, name: str, value: Any, *, integer: bool, positive: bool = False) -> None:
    if value is None:
        return
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        expected = "an int" if integer else "a number"
        raise ValueError(f"{owner}: {name} must be {expected} or None, got {value!r}")
    if not integer and not math.isfinite(value):
        raise ValueError(f"{owner}: {name} must be finite, got {value!r}")
    if positive and not value > 0:
        raise ValueError(f"{owner}: {name} must be positive, got {value!r}")


@dataclass(frozen=True)
class DTypeWithConstraints:
    """A dtype plus the limits a backend puts on the quantization parameters used with it.

    Every limit is optional (``None``: no limit):

    * ``quant_min_lower_bound`` / ``quant_max_upper_bound``: the smallest ``quant_min``
      and largest ``quant_max`` the integer range may use;
    * ``scale_min_lower_bound`` / ``scale_max_upper_bound``: the smallest and largest scale
      the backend can represent (an observer meets the lower bound when its ``eps``, the
      smallest scale it ever produces, is at least the bound);
    * ``scale_exact_match`` / ``zero_point_exact_match``: the op has fixed quantization
      parameters (e.g. a sigmoid's output), so the qconfig must produce exactly these.

    Example:
        >>> import torch
        >>> DTypeWithConstraints(dtype=torch.quint8, scale_min_lower_bound=2**-12).has_constraints
        True
        >>> DTypeWithConstraints(dtype=torch.quint8, quant_min_lower_bound=10, quant_max_upper_bound=5)
        Traceback (most recent call last):
        ...
        ValueError: DTypeWithConstraints: quant_min_lower_bound (10) must not exceed quant_max_upper_bound (5)
    """

    dtype: torch.dtype | None = None
    quant_min_lower_bound: int | None = None
    quant_max_upper_bound: int | None = None
    scale_min_lower_bound: float | None = None
    scale_max_upper_bound: float | None = None
    scale_exact_match: float | None = None
    zero_point_exact_match: int | None = None

    def __post_init__(self) -> None:
        owner = type(self).__name__
        if self.dtype is not None and not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"{owner}: dtype must be a torch.dtype or None, got {self.dtype!r}")
        _check_number(owner, "quant_min_lower_bound", self.quant_min_lower_bound, integer=True)
        _check_number(owner, "quant_max_upper_bound", self.quant_max_upper_bound, integer=True)
        _check_number(owner, "zero_point_exact_match", self.zero_point_exact_match, integer=True)
        for name in ("scale_min_lower_bound", "scale_max_upper_bound", "scale_exact_match"):
            _check_number(owner, name, getattr(self, name), integer=False, positive=True)
        low, high = self.quant_min_lower_bound, self.quant_max_upper_bound
        if low is not None and high is not None and low > high:
            raise ValueError(f"{owner}: quant_min_lower_bound ({low}) must not exceed quant_max_upper_bound ({high})")
        low_s, high_s = self.scale_min_lower_bound, self.scale_max_upper_bound
        if low_s is not None and high_s is not None and low_s > high_s:
            raise ValueError(
                f"{owner}: scale_min_lower_bound ({low_s}) must not exceed scale_max_upper_bound ({high_s})"
            )

    @property
    def has_constraints(self) -> bool:
        """Whether any limit besides the dtype is set."""
        return any(getattr(self, f.name) is not None for f in fields(self) if f.name != "dtype")


DTypeLike: TypeAlias = torch.dtype | DTypeWithConstraints | None


def _normalize(kind: str, value: Any) -> DTypeWithConstraints:
    if value is None:
        return DTypeWithConstraints()
    if isinstance(value, DTypeWithConstraints):
        return value
    if isinstance(value, torch.dtype):
        return DTypeWithConstraints(dtype=value)
    raise ValueError(f"DTypeConfig: {kind}_dtype must be a torch.dtype, a DTypeWithConstraints or None, got {value!r}")


@dataclass(frozen=True, init=False)
class DTypeConfig:
    """The dtypes of one quantized op's input, output, weight and bias (PyTorch's ``DTypeConfig``).

    ``DTypeConfig(input_dtype=..., output_dtype=..., weight_dtype=..., bias_dtype=..., is_dynamic=...)``
    takes a ``torch.dtype`` or a :class:`DTypeWithConstraints` for each tensor (``None``:
    not specified). The stored fields are the normalized ``*_dtype_with_constraints``;
    the ``*_dtype`` properties give the bare dtype. ``is_dynamic=True`` means the input
    is quantized at run time from each batch's range and the output stays in float.
    """

    input_dtype_with_constraints: DTypeWithConstraints
    output_dtype_with_constraints: DTypeWithConstraints
    weight_dtype_with_constraints: DTypeWithConstraints
    bias_dtype_with_constraints: DTypeWithConstraints
    is_dynamic: bool | None

    def __init__(
        self,
        input_dtype: DTypeLike = None,
        output_dtype: DTypeLike = None,
        weight_dtype: DTypeLike = None,
        bias_dtype: DTypeLike = None,
        is_dynamic: bool | None = None,
    ) -> None:
        if is_dynamic is not None and not isinstance(is_dynamic, bool):
            raise ValueError(f"DTypeConfig: is_dynamic must be a bool or None, got {is_dynamic!r}")
        object.__setattr__(self, "input_dtype_with_constraints", _normalize("input", input_dtype))
        object.__setattr__(self, "output_dtype_with_constraints", _normalize("output", output_dtype))
        object.__setattr__(self, "weight_dtype_with_constraints", _normalize("weight", weight_dtype))
        object.__setattr__(self, "bias_dtype_with_constraints", _normalize("bias", bias_dtype))
        object.__setattr__(self, "is_dynamic", is_dynamic)

    # -- the bare dtypes -----------------------------------------------------------------------
    @property
    def input_dtype(self) -> torch.dtype | None:
        return self.input_dtype_with_constraints.dtype

    @property
    def output_dtype(self) -> torch.dtype | None:
        return self.output_dtype_with_constraints.dtype

    @property
    def weight_dtype(self) -> torch.dtype | None:
        return self.weight_dtype_with_constraints.dtype

    @property
    def bias_dtype(self) -> torch.dtype | None:
        return self.bias_dtype_with_constraints.dtype

    # -- by kind ---------------------------------------------------------------------------------
    def constraints_of(self, kind: DTypeKind) -> DTypeWithConstraints:
        """The dtype and limits for ``kind`` (``"input"``, ``"output"``, ``"weight"`` or ``"bias"``)."""
        if kind not in DTYPE_KINDS:
            raise ValueError(f"unknown dtype kind {kind!r}; valid: {', '.join(DTYPE_KINDS)}")
        value: DTypeWithConstraints = getattr(self, f"{kind}_dtype_with_constraints")
        return value

    def dtype_of(self, kind: DTypeKind) -> torch.dtype | None:
        """The bare dtype for ``kind`` (None when not specified)."""
        return self.constraints_of(kind).dtype

    # -- plain-data form -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The set entries: a ``torch.dtype``, or a :class:`DTypeWithConstraints` where limits are set."""
        out: dict[str, Any] = {}
        for kind in DTYPE_KINDS:
            entry = self.constraints_of(kind)
            if entry.dtype is not None or entry.has_constraints:
                out[f"{kind}_dtype"] = entry if entry.has_constraints else entry.dtype
        if self.is_dynamic is not None:
            out["is_dynamic"] = self.is_dynamic
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DTypeConfig:
        """Inverse of :meth:`to_dict` (unknown keys raise ValueError)."""
        valid = [f"{kind}_dtype" for kind in DTYPE_KINDS] + ["is_dynamic"]
        if not isinstance(data, dict):
            raise ValueError(f"DTypeConfig.from_dict expects a dict, got {type(data).__name__}")
        unknown = sorted(str(key) for key in data if key not in valid)
        if unknown:
            raise ValueError(f"DTypeConfig.from_dict: unknown keys {unknown}; valid: {valid}")
        return cls(**data)
