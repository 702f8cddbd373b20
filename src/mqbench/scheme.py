"""Quantization schemes: the numbers that define one quantizer.

A :class:`QuantScheme` says how many bits a quantizer has, whether its grid is
symmetric around zero, per-tensor or per-channel, and whether its scale is a
power of two. The integer range (``quant_min``, ``quant_max``) is derived from
those fields and never stored.

Example:
    >>> from mqbench.scheme import QuantScheme
    >>> QuantScheme(bits=8, symmetric=True, symmetric_range=True).quant_range
    (-127, 127)
    >>> QuantScheme(bits=4, symmetric=False).quant_range
    (0, 15)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

__all__ = [
    "FP8_LARGEST",
    "MAX_BITS",
    "MIN_BITS",
    "SCALE_DTYPES",
    "QuantScheme",
    "QuantizeScheme",
    "check_group_size",
    "rounded_scale",
]

MIN_BITS = 2
MAX_BITS = 16
FP8_LARGEST = {"e4m3": 448, "e5m2": 57344}  # the largest finite value of E4M3FN and E5M2
SCALE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}  # scale_dtype: the 16-bit scale types


def rounded_scale(scale: torch.Tensor, dtype: str) -> torch.Tensor:
    """``scale`` (float32) rounded to the nearest value of ``dtype`` (a :data:`SCALE_DTYPES` name), kept within its
    normal range: the scale a format storing 16-bit scales holds, as float32.

    Example:
        >>> rounded_scale(torch.tensor([0.1, 1e-9]), "float16").tolist()
        [0.0999755859375, 6.103515625e-05]
    """
    target = SCALE_DTYPES[dtype]
    info = torch.finfo(target)
    return torch.clamp(scale.float(), min=info.tiny, max=info.max).to(target).float()


def check_group_size(group_size: Any, per_channel: bool, ch_axis: int) -> int:
    """``group_size`` checked: an int of at least 2 on a per-channel scheme of axis 0 (groups of input channels
    within each output channel)."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2:
        raise ValueError(f"group_size must be an int of at least 2 (32, 64, 128 are usual), got {group_size!r}")
    if not per_channel or ch_axis != 0:
        raise ValueError(
            f"group_size={group_size} groups the input channels of each output channel: it needs per_channel=True "
            f"on ch_axis 0 (got per_channel={per_channel}, ch_axis={ch_axis})"
        )
    return group_size


@dataclass(frozen=True)
class QuantScheme:
    """The fixed description of one quantizer's integer grid.

    Attributes:
        bits: integer width, 2 to 16.
        symmetric: zero point fixed at 0 (signed grid unless ``unsigned``).
        per_channel: one scale per slice along ``ch_axis``.
        ch_axis: the channel axis for per-channel schemes (0 for conv and linear weights).
        pot_scale: scales are powers of two.
        symmetric_range: drop the most negative level, e.g. [-127, 127] for 8 bits.
        unsigned: a symmetric grid on [0, 2**bits - 1] with zero point 0 (inputs known to
            be non-negative, such as the output of a ReLU).
        group_size: one scale (and zero point) per group of this many input channels (axis 1) of each
            output channel: group-wise weights (W4A16 with groups of 128). Needs ``per_channel`` on axis 0.
        fp8: ``"e4m3"`` or ``"e5m2"``: the 8 bits are an FP8 number, not an integer (FP8FakeQuantize); the
            range is then the format's largest value, negated and itself (448 or 57344).
        scale_dtype: ``"float16"`` or ``"bfloat16"``: each scale is rounded to that type (to nearest, within its
            normal range) where the observer gives it, so the simulation computes with the scales a format that
            stores 16-bit scales holds (GGUF's Q4_0 / Q8_0, a 16-bit checkpoint). None: float32 scales.
    """

    bits: int = 8
    symmetric: bool = True
    per_channel: bool = False
    ch_axis: int = 0
    pot_scale: bool = False
    symmetric_range: bool = False
    unsigned: bool = False
    group_size: int | None = None
    fp8: str | None = None
    scale_dtype: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or not isinstance(self.bits, int):
            raise ValueError(f"bits must be an int, got {self.bits!r}")
        if not MIN_BITS <= self.bits <= MAX_BITS:
            raise ValueError(f"bits must be between {MIN_BITS} and {MAX_BITS}, got {self.bits}")
        if isinstance(self.ch_axis, bool) or not isinstance(self.ch_axis, int):
            raise ValueError(f"ch_axis must be an int, got {self.ch_axis!r}")
        if self.symmetric_range and not self.symmetric:
            raise ValueError("symmetric_range needs symmetric=True: an asymmetric grid has no mirrored range")
        if self.symmetric_range and self.unsigned:
            raise ValueError("symmetric_range and unsigned cannot both be set: an unsigned grid has no negative side")
        if self.unsigned and not self.symmetric:
            raise ValueError("unsigned is a symmetric grid with zero point 0; set symmetric=True or drop unsigned")
        if self.group_size is not None:
            check_group_size(self.group_size, self.per_channel, self.ch_axis)
        if self.scale_dtype is not None and self.scale_dtype not in SCALE_DTYPES:
            raise ValueError(f"scale_dtype must be one of {sorted(SCALE_DTYPES)} or None, got {self.scale_dtype!r}")
        if self.fp8 is not None:
            if self.fp8 not in FP8_LARGEST:
                raise ValueError(f"fp8 must be one of {sorted(FP8_LARGEST)}, got {self.fp8!r}")
            if self.bits != 8 or not self.symmetric or self.unsigned or self.symmetric_range or self.pot_scale:
                raise ValueError(
                    f"fp8={self.fp8!r} is an 8-bit symmetric grid with a float scale: bit 8, symmetry True, and no "
                    "unsigned, symmetric_range or pot_scale"
                )
            if self.group_size is not None:
                raise ValueError("fp8 scales are per tensor or per channel; drop group_size")

    @property
    def quant_min(self) -> int:
        if self.fp8 is not None:
            return -FP8_LARGEST[self.fp8]
        if not self.symmetric or self.unsigned:
            return 0
        low = -(2 ** (self.bits - 1))
        return low + 1 if self.symmetric_range else low

    @property
    def quant_max(self) -> int:
        if self.fp8 is not None:
            return FP8_LARGEST[self.fp8]
        if not self.symmetric or self.unsigned:
            return 2**self.bits - 1
        return 2 ** (self.bits - 1) - 1

    @property
    def quant_range(self) -> tuple[int, int]:
        return self.quant_min, self.quant_max

    @property
    def torch_qscheme(self) -> torch.qscheme:
        if self.per_channel:
            return torch.per_channel_symmetric if self.symmetric else torch.per_channel_affine
        return torch.per_tensor_symmetric if self.symmetric else torch.per_tensor_affine

    def observer_kwargs(self) -> dict[str, Any]:
        """The keyword arguments that give an observer or fake quantizer this scheme (``group_size`` only where
        set: it is the fake quantizer's, which groups the weight before its observer sees it)."""
        group = {} if self.group_size is None else {"group_size": self.group_size}
        fp8 = {} if self.fp8 is None else {"fp8": self.fp8}
        rounded = {} if self.scale_dtype is None else {"scale_dtype": self.scale_dtype}
        return {
            **group,
            **fp8,
            **rounded,
            "dtype": torch.qint8 if self.quant_min < 0 else torch.quint8,
            "qscheme": self.torch_qscheme,
            "quant_min": self.quant_min,
            "quant_max": self.quant_max,
            "ch_axis": self.ch_axis if self.per_channel else -1,
            "pot_scale": self.pot_scale,
        }

    def to_observer_params(self) -> dict[str, Any]:
        """MQBench's name for :meth:`observer_kwargs` (with ``reduce_range=False``, as MQBench's includes)."""
        return {**self.observer_kwargs(), "reduce_range": False}

    @staticmethod
    def _fields_of(values: Mapping[str, Any]) -> dict[str, Any]:
        aliases = {"bit": "bits", "symmetry": "symmetric"}
        fields = set(QuantScheme.__dataclass_fields__)
        kwargs: dict[str, Any] = {}
        for key, value in values.items():
            name = aliases.get(key, key)
            if name not in fields:
                valid = sorted(fields | set(aliases))
                raise ValueError(f"unknown quantization scheme key {key!r}; valid keys: {', '.join(valid)}")
            kwargs[name] = value
        return kwargs

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> QuantScheme:
        """Build a scheme from a dict using MQBench's keys (``bit``, ``symmetry``, ``per_channel``,
        ``pot_scale``, ``symmetric_range``) or this class's own field names.

        Raises ValueError naming an unknown key and listing the valid ones.
        """
        return cls(**cls._fields_of(values))

    def updated(self, values: Mapping[str, Any]) -> QuantScheme:
        """This scheme with the keys of ``values`` (as :meth:`from_dict` reads them) changed, the others kept.

        An asymmetric grid has no mirrored range and no unsigned form, so ``symmetry=False``
        also clears ``symmetric_range`` and ``unsigned`` unless ``values`` sets them; ``per_channel=False``
        clears ``group_size``.

        Example:
            >>> QuantScheme(8, per_channel=True, symmetric_range=True).updated({"bit": 4}).quant_range
            (-7, 7)
        """
        changes = self._fields_of(values)
        if changes.get("symmetric") is False:
            changes.setdefault("symmetric_range", False)
            changes.setdefault("unsigned", False)
        if changes.get("per_channel") is False:  # per-tensor has no groups
            changes.setdefault("group_size", None)
        if "fp8" in changes and changes["fp8"] is not None:  # an FP8 grid has no groups or integer options
            for key in ("group_size", "symmetric_range", "unsigned", "pot_scale"):
                changes.setdefault(key, None if key == "group_size" else False)
        return replace(self, **changes)


def QuantizeScheme(
    symmetry: bool = True, per_channel: bool = False, pot_scale: bool = False, bit: int = 8, **kwargs: Any
) -> QuantScheme:
    """MQBench's ``QuantizeScheme(symmetry, per_channel, pot_scale, bit, **kwargs)`` as a :class:`QuantScheme`.

    ``kwargs`` may hold the other scheme fields (``symmetric_range``, ``ch_axis``, ``unsigned``);
    ``factory_kwargs`` is accepted and ignored (MQBench passes observer options through it).

    Example:
        >>> QuantizeScheme(symmetry=False, bit=4).to_observer_params()["quant_max"]
        15
    """
    kwargs.pop("factory_kwargs", None)
    return QuantScheme.from_dict(
        {"symmetry": symmetry, "per_channel": per_channel, "pot_scale": pot_scale, "bit": bit, **kwargs}
    )
