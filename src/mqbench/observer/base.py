"""ObserverBase: records statistics of the tensors it sees and turns them into qparams.

Every observer works per-tensor or per-channel on any axis through one path:
the input is viewed as rows ``[C, N]`` (``C == 1`` per-tensor), statistics are
computed row-wise, and :func:`mqbench.functional.qparams_from_range` maps the
resulting clipping range to a scale and zero point.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from mqbench.functional import EPS, qparams_from_range
from mqbench.utils.factory import Factory
from mqbench.utils.state_dict import resize_to_state_dict

__all__ = ["EMARange", "NonFiniteInputError", "ObserverBase", "default_quant_range"]

_PER_CHANNEL = (torch.per_channel_affine, torch.per_channel_symmetric)
_SYMMETRIC = (torch.per_tensor_symmetric, torch.per_channel_symmetric)
_QSCHEMES = (torch.per_tensor_affine, torch.per_tensor_symmetric, *_PER_CHANNEL)


def row_min_max(rows: Tensor) -> tuple[Tensor, Tensor]:
    """Minimum and maximum of each row of ``rows`` ``[C, N]``, as two ``[C]`` tensors.

    A single row is reduced as a whole tensor and several rows with ``amin`` / ``amax``:
    ``torch.aminmax(rows, dim=1)`` is an order of magnitude slower on the CPU in both cases.
    """
    if rows.shape[0] == 1:
        low, high = torch.aminmax(rows)
        return low.reshape(1), high.reshape(1)
    return rows.amin(dim=1), rows.amax(dim=1)


class NonFiniteInputError(ValueError):
    """NaN or infinity reached an observer."""


def default_quant_range(dtype: torch.dtype, reduce_range: bool) -> tuple[int, int]:
    """The integer range of a quantized dtype (PyTorch's convention), halved with reduce_range."""
    if dtype == torch.qint8:
        return (-64, 63) if reduce_range else (-128, 127)
    if dtype == torch.quint8:
        return (0, 127) if reduce_range else (0, 255)
    if dtype == torch.qint32:
        return (-(2**31), 2**31 - 1)
    raise ValueError(
        f"unsupported observer dtype {dtype}; use torch.quint8 or torch.qint8, or give quant_min/quant_max"
    )


def _count_own_forward(observer: ObserverBase, args: Any, output: Any) -> None:
    if observer.num_batches == 0 and args and isinstance(args[0], Tensor) and args[0].numel():
        observer.num_batches += 1


class ObserverBase(nn.Module):
    """Base class of all observers (MQBench's signature, plus PyTorch's ``eps``).

    ``forward(x)`` records statistics and returns ``x`` unchanged;
    ``calculate_qparams()`` returns ``(scale, zero_point)``. Per-channel schemes
    (``torch.per_channel_*``) reduce over every axis but ``ch_axis`` (negative
    axes count from the end).

    Subclasses implement ``_observe(rows)`` for rows ``[C, N]`` and either
    ``clip_range()`` (most observers) or ``calculate_qparams()``.

    Example:
        >>> import torch
        >>> from mqbench.observer import MinMaxObserver
        >>> obs = MinMaxObserver(quant_min=-127, quant_max=127, qscheme=torch.per_tensor_symmetric)
        >>> _ = obs(torch.tensor([-2.54, 1.0]))
        >>> obs.calculate_qparams()
        (tensor([0.0200]), tensor([0], dtype=torch.int32))
    """

    min_val: Tensor
    max_val: Tensor
    num_batches: Tensor
    # True where ``calculate_qparams`` searches (costs more than recording a batch): a quantizer calibrating
    # without quantizing then asks once, when calibration ends, not after every batch (QuantizeBase.sync_qparams)
    defers_qparams = False

    def __init__(
        self,
        dtype: torch.dtype = torch.quint8,
        qscheme: torch.qscheme = torch.per_tensor_affine,
        reduce_range: bool = False,
        quant_min: int | None = None,
        quant_max: int | None = None,
        ch_axis: int = -1,
        pot_scale: bool = False,
        factory_kwargs: dict[str, Any] | None = None,
        eps: float = EPS,
    ) -> None:
        super().__init__()
        if qscheme not in _QSCHEMES:
            raise ValueError(f"unsupported qscheme {qscheme}; valid: {', '.join(str(q) for q in _QSCHEMES)}")
        if (quant_min is None) != (quant_max is None):
            raise ValueError("give both quant_min and quant_max, or neither")
        if quant_min is None or quant_max is None:
            quant_min, quant_max = default_quant_range(dtype, reduce_range)
        if quant_min >= quant_max:
            raise ValueError(f"quant_min ({quant_min}) must be below quant_max ({quant_max})")
        if not eps > 0:
            raise ValueError(f"eps must be positive, got {eps}")
        self.dtype = dtype
        self.qscheme = qscheme
        self.reduce_range = reduce_range
        self.quant_min = int(quant_min)
        self.quant_max = int(quant_max)
        self.ch_axis = int(ch_axis)
        self.pot_scale = bool(pot_scale)
        self.eps = float(eps)
        self.factory_kwargs = factory_kwargs
        self.name = ""
        self.register_buffer("min_val", torch.tensor(float("inf")))
        self.register_buffer("max_val", torch.tensor(float("-inf")))
        self.register_buffer("num_batches", torch.tensor(0, dtype=torch.int64))
        if type(self).forward is not ObserverBase.forward:
            # a subclass recording in its own forward (MQBench's way): its calls still count as calibration
            self.register_forward_hook(_count_own_forward)

    @classmethod
    def with_args(cls, **kwargs: Any) -> Factory:
        """A factory that builds this class with ``kwargs`` bound (PyTorch's observer idiom)."""
        return Factory(cls, kwargs)

    @property
    def is_per_channel(self) -> bool:
        return self.qscheme in _PER_CHANNEL

    @property
    def symmetric(self) -> bool:
        return self.qscheme in _SYMMETRIC

    @property
    def calibrated(self) -> bool:
        """Whether any tensor has been observed."""
        return bool(self.num_batches > 0)

    # -- recording -------------------------------------------------------------------------
    def rows(self, x: Tensor) -> Tensor:
        """``x`` as float rows ``[C, N]``: one row per channel, or a single row per-tensor."""
        if not self.is_per_channel:
            return x.reshape(1, -1).float()
        if x.dim() == 0 or not -x.dim() <= self.ch_axis < x.dim():
            raise ValueError(
                f"{self._where()}: ch_axis={self.ch_axis} is out of range for a {x.dim()}-D tensor "
                f"of shape {list(x.shape)}; set ch_axis to the channel dimension (0 for conv/linear weights)"
            )
        return x.movedim(self.ch_axis, 0).reshape(x.shape[self.ch_axis], -1).float()

    def forward(self, x: Tensor) -> Tensor:
        if x.numel() == 0:
            return x
        self._observe(self.rows(x.detach()))
        self.num_batches += 1
        return x

    def _observe(self, rows: Tensor) -> None:
        lo, hi = row_min_max(rows)
        self.check_finite(lo, hi)
        self._update_min_max(lo, hi)

    def _update_min_max(self, lo: Tensor, hi: Tensor) -> None:
        """Running min/max (replace on the first batch)."""
        lo, hi = self._shaped(lo), self._shaped(hi)
        if self.num_batches == 0:
            self.min_val, self.max_val = lo.clone(), hi.clone()
        else:
            self.check_channels(self.min_val, lo)
            self.min_val, self.max_val = torch.minimum(self.min_val, lo), torch.maximum(self.max_val, hi)

    def _update_ema_range(self, lo: Tensor, hi: Tensor, ratio: float) -> None:
        """Exponential moving average of the range (``ratio`` weights the past; replace on the first batch)."""
        lo, hi = self._shaped(lo), self._shaped(hi)
        if self.num_batches == 0:
            self.min_val, self.max_val = lo.clone(), hi.clone()
        else:
            self.check_channels(self.min_val, lo)
            self.min_val = self.min_val * ratio + lo * (1 - ratio)
            self.max_val = self.max_val * ratio + hi * (1 - ratio)

    def _shaped(self, stat: Tensor) -> Tensor:
        """Row statistics in buffer form: 0-d per-tensor, ``[C]`` per-channel."""
        return stat if self.is_per_channel else stat.reshape(())

    def check_channels(self, recorded: Tensor, new: Tensor) -> None:
        """Raise ValueError when a batch's channel count differs from the recorded statistics."""
        if recorded.shape != new.shape:
            raise ValueError(
                f"{self._where()} recorded statistics of shape {list(recorded.shape)} but received a batch "
                f"with shape {list(new.shape)} along ch_axis={self.ch_axis}; use the same channel axis in every batch"
            )

    def check_finite(self, *stats: Tensor) -> None:
        """Raise :class:`NonFiniteInputError` if any statistic of the batch is NaN or infinite."""
        for stat in stats:
            if not bool(torch.isfinite(stat).all()):
                kind = "NaN" if bool(torch.isnan(stat).any()) else "infinite"
                raise NonFiniteInputError(
                    f"{self._where()} received {kind} values; check the input data and the layer before "
                    "this quantizer (a diverged training step or a division by zero upstream)"
                )

    def _where(self) -> str:
        owner = f"quantizer {self.name!r}" if self.name else "an unnamed quantizer"
        return f"{type(self).__name__} of {owner}"

    # -- qparams ---------------------------------------------------------------------------
    def clip_range(self) -> tuple[Tensor, Tensor]:
        """The (min, max) the grid should cover; min/max of the data unless a subclass clips."""
        return self.min_val, self.max_val

    def calculate_qparams(self) -> tuple[Tensor, Tensor]:
        if not self.calibrated:
            return torch.ones(1), torch.zeros(1, dtype=torch.int32)
        lo, hi = self.clip_range()
        return qparams_from_range(lo, hi, self.quant_min, self.quant_max, self.symmetric, self.pot_scale, self.eps)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # type: ignore[no-untyped-def]
        resize_to_state_dict(self, state_dict, prefix)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        channel = f", ch_axis={self.ch_axis}" if self.is_per_channel else ""
        return f"quant_min={self.quant_min}, quant_max={self.quant_max}, qscheme={self.qscheme}{channel}"


class EMARange(ObserverBase):
    """An observer whose range is the exponential moving average of each batch's (``ema_ratio`` weights the past).

    Subclasses compute a batch's range in ``_batch_range``; the average is ``_update_ema_range``'s.
    """

    def __init__(self, *args: Any, ema_ratio: float = 0.9, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not 0.0 <= ema_ratio < 1.0:
            raise ValueError(f"ema_ratio must be in [0, 1), got {ema_ratio}")
        self.ema_ratio = ema_ratio

    def _batch_range(self, rows: Tensor) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    def _observe(self, rows: Tensor) -> None:
        lo, hi = self._batch_range(rows)
        self._update_ema_range(lo, hi, self.ema_ratio)
