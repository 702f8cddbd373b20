"""QDropFakeQuantize: a learned activation scale and random dropping of quantization (Wei et al., 2022).

The quantizer of :class:`~mqbench.fake_quantize.LearnableFakeQuantize` (scale, and zero point for
affine schemes, learned; no LSQ gradient scaling by default, as QDrop trains it) plus ``prob``:
the probability that an element is quantized. With ``prob < 1`` each element of the output is,
independently, the quantized value with probability ``prob`` (resolved in steps of 1/256, see
:func:`keep_mask`) and the float input otherwise;
reconstruction sets ``prob`` (MQBench's config key ``prob``) and restores 1.0 afterwards, so the
deployed model always quantizes.

Example:
    >>> import torch
    >>> from mqbench.fake_quantize import QDropFakeQuantize
    >>> fq = QDropFakeQuantize(quant_min=0, quant_max=15)
    >>> _ = fq(torch.linspace(0, 1.5, 7)); fq.disable_observer()
    >>> x = torch.full((1000,), 0.33)
    >>> fq.prob = 0.0
    >>> torch.equal(fq(x), x)
    True
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from mqbench.fake_quantize.lsq import LearnableFakeQuantize
from mqbench.observer import MinMaxObserver

__all__ = ["QDropFakeQuantize", "drop_bytes", "keep_mask"]


def drop_bytes(like: Tensor) -> Tensor:
    """One random byte per element of ``like`` (uint8, same shape), cut from 64-bit random words.

    About four times cheaper than ``torch.rand_like(like)`` on a CPU, where drawing the random
    numbers dominates a QDrop iteration. An element is quantized when its byte is below
    ``round(prob * 256)``.
    """
    count = like.numel()
    words = torch.randint(-(2**63), 2**63 - 1, ((count + 7) // 8,), dtype=torch.int64, device=like.device)
    return words.view(torch.uint8)[:count].view(like.shape)


def keep_mask(like: Tensor, prob: float) -> Tensor:
    """A boolean tensor shaped like ``like``, each element True with probability ``prob`` (in steps of 1/256)."""
    return drop_bytes(like) < round(prob * 256)


class QDropFakeQuantize(LearnableFakeQuantize):
    """Learned-scale fake quantization that keeps each element float with probability ``1 - prob``."""

    def __init__(
        self, observer: Any = MinMaxObserver, use_grad_scaling: bool = False, prob: float = 1.0, **kwargs: Any
    ) -> None:
        super().__init__(observer, use_grad_scaling=use_grad_scaling, **kwargs)
        self.prob = prob

    @property
    def prob(self) -> float:
        return self._prob

    @prob.setter
    def prob(self, value: float) -> None:
        if not 0.0 <= float(value) <= 1.0:
            raise ValueError(f"prob is the probability of quantizing an element, in [0, 1]; got {value}")
        self._prob = float(value)

    def quantize(self, x: Tensor) -> Tensor:
        if self._prob >= 1.0:
            return super().quantize(x)
        return self._learnable_quantize(x, drop_bytes(x), round(self._prob * 256))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, prob={self._prob}"
