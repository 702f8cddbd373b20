"""Does a QConfig meet a backend's DTypeConfig? A table-driven check naming each broken constraint.

The qconfig's factories are built once (``activation`` for the input and output,
``weight`` for the weight) and their settings read into an :class:`ObserverInfo`:
dtype, integer range, ``eps`` (the smallest scale the observer produces) and, for
fixed-qparams observers, the fixed ``(scale, zero_point)``. Each limit of a
:class:`~mqbench.backend_config.DTypeWithConstraints` is then checked by the function
its field name maps to. A broken limit is reported as a :class:`ConstraintViolation`,
a string ``"<field name>: <explanation>"`` (``"dtype: ..."`` for a dtype mismatch).

Example:
    >>> import torch
    >>> from mqbench.backend_config import (
    ...     DTypeConfig, DTypeWithConstraints, QConfig, check_dtype_config, default_weight_observer)
    >>> from mqbench.observer import MinMaxObserver
    >>> act = DTypeWithConstraints(dtype=torch.quint8, scale_min_lower_bound=2**-12)
    >>> config = DTypeConfig(input_dtype=act, output_dtype=act, weight_dtype=torch.qint8)
    >>> good = QConfig(activation=MinMaxObserver.with_args(eps=2**-12), weight=default_weight_observer)
    >>> check_dtype_config(good, config)
    []
    >>> bad = QConfig(activation=MinMaxObserver, weight=default_weight_observer)
    >>> check_dtype_config(bad, config)
    ["scale_min_lower_bound: the activation observer's eps 1.19e-07 is below 2**-12"]
    >>> check_dtype_config(bad, config)[0].constraint
    'scale_min_lower_bound'
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from mqbench.backend_config.backend_config import BackendPatternConfig
from mqbench.backend_config.dtype_config import DTYPE_KINDS, DTypeConfig, DTypeKind, DTypeWithConstraints
from mqbench.backend_config.qconfig import ObserverFactory, QConfig

__all__ = [
    "CONSTRAINT_NAMES",
    "ConstraintViolation",
    "ObserverInfo",
    "check_dtype_config",
    "first_matching_dtype_config",
    "observer_info",
]


@dataclass(frozen=True)
class ObserverInfo:
    """The settings of a built observer or fake quantizer that backend constraints are checked against.

    ``eps`` is the smallest scale it can produce; ``fixed_qparams`` is ``(scale, zero_point)``
    for observers whose parameters never change (a ``fixed_qparams`` attribute), else None.
    """

    name: str
    dtype: torch.dtype | None
    qscheme: torch.qscheme | None
    quant_min: int | None
    quant_max: int | None
    ch_axis: int | None
    eps: float | None
    pot_scale: bool
    fixed_qparams: tuple[float, int] | None
    is_dynamic: bool

    @property
    def is_per_channel(self) -> bool:
        return self.qscheme in (torch.per_channel_affine, torch.per_channel_symmetric)

    @property
    def symmetric(self) -> bool:
        return self.qscheme in (torch.per_tensor_symmetric, torch.per_channel_symmetric)


def _attr(objects: Iterable[Any], name: str) -> Any:
    """The first non-None ``name`` attribute among ``objects``."""
    for obj in objects:
        value = getattr(obj, name, None)
        if value is not None:
            return value
    return None


def observer_info(factory: ObserverFactory) -> ObserverInfo:
    """Build ``factory`` once and read its settings (a fake quantizer is read together with its observer)."""
    try:
        instance = factory()
    except Exception as exc:
        raise ValueError(f"could not build an observer from {factory!r}: {type(exc).__name__}: {exc}") from exc
    observer = getattr(instance, "activation_post_process", None)
    sources = (instance,) if observer is None else (instance, observer)
    name = type(instance).__name__ + ("" if observer is None else f"({type(observer).__name__})")
    quant_min, quant_max, eps = _attr(sources, "quant_min"), _attr(sources, "quant_max"), _attr(sources, "eps")
    qscheme = _attr(sources, "qscheme")
    fixed = _attr(reversed(sources), "fixed_qparams")
    per_channel = qscheme in (torch.per_channel_affine, torch.per_channel_symmetric)
    return ObserverInfo(
        name=name,
        dtype=_attr(sources, "dtype"),
        qscheme=qscheme,
        quant_min=None if quant_min is None else int(quant_min),
        quant_max=None if quant_max is None else int(quant_max),
        ch_axis=int(_attr(sources, "ch_axis")) if per_channel else None,
        eps=None if eps is None else float(eps),
        pot_scale=bool(_attr(sources, "pot_scale")),
        fixed_qparams=None if fixed is None else (float(fixed[0]), int(fixed[1])),
        is_dynamic=bool(_attr(sources, "is_dynamic")),
    )


class ConstraintViolation(str):
    """``"<constraint>: <explanation>"``, with the parts as ``constraint``, ``explanation`` and ``kind``.

    ``constraint`` is a :class:`~mqbench.backend_config.DTypeWithConstraints` field name,
    or ``"dtype"``; ``kind`` is the tensor checked (``"input"``, ``"output"``, ``"weight"``).
    """

    constraint: str
    explanation: str
    kind: str

    def __new__(cls, constraint: str, explanation: str, kind: str) -> ConstraintViolation:
        self = super().__new__(cls, f"{constraint}: {explanation}")
        self.constraint, self.explanation, self.kind = constraint, explanation, kind
        return self

    def __getnewargs__(self) -> tuple[str, str, str]:  # type: ignore[override]
        return self.constraint, self.explanation, self.kind


def _bound(value: float) -> str:
    """A backend limit as written in configs: ``2**-12`` for powers of two below one."""
    if isinstance(value, int) or float(value).is_integer():
        return str(int(value))
    mantissa, exponent = math.frexp(value)
    return f"2**{exponent - 1}" if mantissa == 0.5 and value < 1 else f"{value:.3g}"


# -- one function per constraint: (limit, observer, role) -> explanation when broken --------------------
def _quant_min_lower_bound(limit: int, info: ObserverInfo, role: str) -> str | None:
    if info.quant_min is None:
        return f"the {role} observer sets no quant_min; the backend needs it to be at least {limit}"
    if info.quant_min < limit:
        return f"the {role} observer's quant_min {info.quant_min} is below {limit}"
    return None


def _quant_max_upper_bound(limit: int, info: ObserverInfo, role: str) -> str | None:
    if info.quant_max is None:
        return f"the {role} observer sets no quant_max; the backend needs it to be at most {limit}"
    if info.quant_max > limit:
        return f"the {role} observer's quant_max {info.quant_max} is above {limit}"
    return None


def _scale_min_lower_bound(limit: float, info: ObserverInfo, role: str) -> str | None:
    if info.fixed_qparams is not None:
        scale = info.fixed_qparams[0]
        return f"the {role} observer's fixed scale {scale:.3g} is below {_bound(limit)}" if scale < limit else None
    if info.eps is None:
        return f"the {role} observer has no eps, so nothing keeps its scale at or above {_bound(limit)}"
    if info.eps < limit:
        return f"the {role} observer's eps {info.eps:.3g} is below {_bound(limit)}"
    return None


def _scale_max_upper_bound(limit: float, info: ObserverInfo, role: str) -> str | None:
    # Observers put no ceiling on a calibrated scale, so only a fixed scale can be checked before calibration.
    if info.fixed_qparams is not None and info.fixed_qparams[0] > limit:
        return f"the {role} observer's fixed scale {info.fixed_qparams[0]:.3g} is above {_bound(limit)}"
    return None


def _scale_exact_match(limit: float, info: ObserverInfo, role: str) -> str | None:
    if info.fixed_qparams is None:
        return (
            f"the backend fixes the scale to {_bound(limit)}, but the {role} observer {info.name} computes its own; "
            "use FixedQParamsObserver"
        )
    if info.fixed_qparams[0] != limit:
        return f"the {role} observer's fixed scale {info.fixed_qparams[0]:.3g} differs from {_bound(limit)}"
    return None


def _zero_point_exact_match(limit: int, info: ObserverInfo, role: str) -> str | None:
    if info.fixed_qparams is None:
        return (
            f"the backend fixes the zero point to {limit}, but the {role} observer {info.name} computes its own; "
            "use FixedQParamsObserver"
        )
    if info.fixed_qparams[1] != limit:
        return f"the {role} observer's fixed zero point {info.fixed_qparams[1]} differs from {limit}"
    return None


_CHECKS: Mapping[str, Callable[[Any, ObserverInfo, str], str | None]] = MappingProxyType(
    {
        "quant_min_lower_bound": _quant_min_lower_bound,
        "quant_max_upper_bound": _quant_max_upper_bound,
        "scale_min_lower_bound": _scale_min_lower_bound,
        "scale_max_upper_bound": _scale_max_upper_bound,
        "scale_exact_match": _scale_exact_match,
        "zero_point_exact_match": _zero_point_exact_match,
    }
)
CONSTRAINT_NAMES: tuple[str, ...] = ("dtype", *_CHECKS)
"""Every name a :class:`ConstraintViolation` can carry."""

_ROLE = {"input": "activation", "output": "activation", "weight": "weight"}


def _kinds(kind: DTypeKind | Iterable[DTypeKind] | None) -> tuple[DTypeKind, ...]:
    kinds: tuple[Any, ...] = DTYPE_KINDS if kind is None else (kind,) if isinstance(kind, str) else tuple(kind)
    for entry in kinds:
        if entry not in DTYPE_KINDS:
            raise ValueError(f"unknown dtype kind {entry!r}; valid: {', '.join(DTYPE_KINDS)}")
    return kinds


class _Observers:
    """Builds each of a qconfig's factories at most once."""

    def __init__(self, qconfig: QConfig) -> None:
        if not isinstance(qconfig, QConfig):
            raise ValueError(f"expected a QConfig, got {qconfig!r}")
        self.qconfig = qconfig
        self._built: dict[str, ObserverInfo | None] = {}

    def get(self, role: str) -> ObserverInfo | None:
        if role not in self._built:
            factory = self.qconfig.activation if role == "activation" else self.qconfig.weight
            self._built[role] = None if factory is None else observer_info(factory)
        return self._built[role]


def _check_kind(
    observers: _Observers, spec: DTypeWithConstraints, kind: DTypeKind, dynamic: bool | None
) -> list[ConstraintViolation]:
    expected = spec.dtype
    if expected is None or kind == "bias" or (kind == "output" and (dynamic or expected.is_floating_point)):
        # Bias dtypes follow from the lowering (a qconfig has no bias observer); a dynamic op's output, and
        # an output the backend wants in float (quantized inputs only), are not observed.
        return []
    if kind == "input" and expected.is_floating_point:
        return []  # a float input: a weight-only pattern, the input is not observed
    role = _ROLE[kind]
    info = observers.get(role)
    if info is None:
        if expected.is_floating_point:
            return []
        explanation = f"the qconfig has no {role} observer, but the backend expects {expected} for the {kind}"
        return [ConstraintViolation("dtype", explanation, kind)]
    if info.dtype != expected:
        explanation = f"the {role} observer {info.name} produces {info.dtype}, the backend expects {expected}"
        return [ConstraintViolation("dtype", f"{explanation} for the {kind}", kind)]
    if kind == "input" and dynamic is not None and info.is_dynamic != dynamic:
        mode = "dynamically (per batch)" if dynamic else "statically"
        explanation = f"the backend expects the input quantized {mode}, the {role} observer {info.name} does not"
        return [ConstraintViolation("dtype", explanation, kind)]
    found = []
    for name, check in _CHECKS.items():
        limit = getattr(spec, name)
        if limit is not None:
            problem = check(limit, info, role)
            if problem is not None:
                found.append(ConstraintViolation(name, problem, kind))
    return found


def _dedupe(violations: Iterable[ConstraintViolation]) -> list[ConstraintViolation]:
    seen: set[str] = set()
    out = []
    for violation in violations:
        if str(violation) not in seen:
            seen.add(str(violation))
            out.append(violation)
    return out


def _check_with(
    observers: _Observers, dtype_config: DTypeConfig, kinds: tuple[DTypeKind, ...]
) -> list[ConstraintViolation]:
    if not isinstance(dtype_config, DTypeConfig):
        raise ValueError(f"expected a DTypeConfig, got {dtype_config!r}")
    found: list[ConstraintViolation] = []
    for kind in kinds:
        found += _check_kind(observers, dtype_config.constraints_of(kind), kind, dtype_config.is_dynamic)
    return _dedupe(found)


def check_dtype_config(
    qconfig: QConfig, dtype_config: DTypeConfig, kind: DTypeKind | Iterable[DTypeKind] | None = None
) -> list[ConstraintViolation]:
    """The constraints of ``dtype_config`` that ``qconfig`` breaks (empty: it is supported).

    ``kind`` selects the tensors checked: ``"input"``, ``"output"``, ``"weight"``, ``"bias"``
    or several of them; None checks every kind the config specifies. For each, a dtype
    mismatch is reported as ``"dtype"`` (and the kind's limits are then skipped); otherwise
    each limit set on the kind's :class:`DTypeWithConstraints` is checked. Identical
    reports from input and output (same observer, same limits) appear once. Not checked:
    ``bias`` (a qconfig has no bias observer; the lowering produces the bias dtype),
    the output of a dynamic config (it stays float), a float input (weight-only quantization),
    and ``scale_max_upper_bound`` for observers that compute their scale (only a fixed scale is
    known before calibration).
    """
    return _check_with(_Observers(qconfig), dtype_config, _kinds(kind))


def first_matching_dtype_config(
    qconfig: QConfig | None,
    pattern_config: BackendPatternConfig,
    kind: DTypeKind | Iterable[DTypeKind] | None = None,
) -> tuple[DTypeConfig | None, list[ConstraintViolation]]:
    """The first of ``pattern_config.dtype_configs`` that ``qconfig`` meets, and why the others failed.

    Returns ``(dtype_config, [])`` on a match, else ``(None, reasons)`` with the
    violations of every dtype config (duplicates once). ``(None, [])`` means there was
    nothing to match: ``qconfig`` is None (not quantized) or the pattern has no dtype
    configs (a fusion-only pattern). ``kind`` is passed to :func:`check_dtype_config`
    (e.g. ``("input", "output")`` for an op without a weight).
    """
    if not isinstance(pattern_config, BackendPatternConfig):
        raise ValueError(f"expected a BackendPatternConfig, got {pattern_config!r}")
    if qconfig is None:
        return None, []
    observers, kinds = _Observers(qconfig), _kinds(kind)
    reasons: list[ConstraintViolation] = []
    for dtype_config in pattern_config.dtype_configs:
        found = _check_with(observers, dtype_config, kinds)
        if not found:
            return dtype_config, []
        reasons += found
    return None, _dedupe(reasons)
