"""Fused float modules: a layer with the BatchNorm and/or activation that follows it.

Each is an :class:`torch.nn.Sequential` of the original modules (children ``0``, ``1``
and ``2``), so it computes exactly what the modules computed in sequence; fusion only
marks the group so that it can be swapped for its QAT module
(:mod:`mqbench.nn.intrinsic.qat`), which folds the BatchNorm the way hardware does.
The activation slot takes :class:`torch.nn.ReLU` or :class:`torch.nn.ReLU6`.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from mqbench.nn.intrinsic import ConvBnReLU2d
    >>> conv, bn, relu = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU6()
    >>> fused = ConvBnReLU2d(conv, bn, relu)
    >>> x = torch.randn(2, 3, 6, 6)
    >>> torch.equal(fused(x), relu(bn(conv(x))))
    True
"""

from __future__ import annotations

from typing import ClassVar

from torch import nn

from mqbench.nn.modules.frozen_batchnorm import FrozenBatchNorm2d

__all__ = [
    "ACTIVATIONS",
    "ConvBn1d",
    "ConvBn2d",
    "ConvBn3d",
    "ConvBnReLU1d",
    "ConvBnReLU2d",
    "ConvBnReLU3d",
    "ConvFreezebn2d",
    "ConvFreezebnReLU2d",
    "ConvReLU1d",
    "ConvReLU2d",
    "ConvReLU3d",
    "ConvTransposeBn2d",
    "ConvTransposeBnReLU2d",
    "ConvTransposeFreezebn2d",
    "ConvTransposeFreezebnReLU2d",
    "ConvTransposeReLU2d",
    "FusedModule",
    "LinearBn1d",
    "LinearBnReLU1d",
    "LinearReLU",
]

#: Activation modules accepted in the ``relu`` slot of a fused module.
ACTIVATIONS: tuple[type[nn.Module], ...] = (nn.ReLU, nn.ReLU6)


class FusedModule(nn.Sequential):
    """Base of the fused float modules: checks each part's type and the BatchNorm's width.

    Subclasses set ``PARTS``: for each slot, its name and the accepted module types.
    """

    PARTS: ClassVar[tuple[tuple[str, tuple[type[nn.Module], ...]], ...]] = ()
    is_quantization_leaf: ClassVar[bool] = True  # traced as one call

    @property
    def op_kind(self) -> str:
        """The placement kind of the fused layer: ``conv``, ``deconv`` or ``linear``."""
        layer = self[0]
        if isinstance(layer, nn.modules.conv._ConvTransposeNd):
            return "deconv"
        return "linear" if isinstance(layer, nn.Linear) else "conv"

    @property
    def ends_with_relu(self) -> bool:
        """Whether the output passes through the activation (so it is non-negative)."""
        return bool(self.PARTS) and self.PARTS[-1][0] == "activation"

    def __init__(self, *modules: nn.Module) -> None:
        name = type(self).__name__
        if len(modules) != len(self.PARTS):
            slots = ", ".join(slot for slot, _ in self.PARTS)
            raise TypeError(f"{name} takes {len(self.PARTS)} modules ({slots}), got {len(modules)}")
        for module, (slot, types) in zip(modules, self.PARTS, strict=True):
            if not isinstance(module, types):
                expected = " or ".join(t.__name__ for t in types)
                raise TypeError(f"{name}: the {slot} must be {expected}, got {type(module).__name__}")
        layer = modules[0]
        out_channels = getattr(layer, "out_channels", getattr(layer, "out_features", None))
        bn = modules[1] if len(modules) > 1 and isinstance(modules[1], nn.modules.batchnorm._BatchNorm) else None
        if bn is not None and bn.num_features != out_channels:
            raise ValueError(
                f"{name}: the BatchNorm has {bn.num_features} features but the {type(layer).__name__} has "
                f"{out_channels} output channels"
            )
        super().__init__(*modules)


def _parts(
    layer: type[nn.Module], bn: type[nn.Module] | None, relu: bool
) -> tuple[tuple[str, tuple[type[nn.Module], ...]], ...]:
    parts: list[tuple[str, tuple[type[nn.Module], ...]]] = [(layer.__name__, (layer,))]
    if bn is not None:
        parts.append((bn.__name__, (bn,)))
    if relu:
        parts.append(("activation", ACTIVATIONS))
    return tuple(parts)


class ConvReLU1d(FusedModule):
    """Conv1d followed by ReLU/ReLU6."""

    PARTS = _parts(nn.Conv1d, None, True)


class ConvReLU2d(FusedModule):
    """Conv2d followed by ReLU/ReLU6."""

    PARTS = _parts(nn.Conv2d, None, True)


class ConvReLU3d(FusedModule):
    """Conv3d followed by ReLU/ReLU6."""

    PARTS = _parts(nn.Conv3d, None, True)


class ConvBn1d(FusedModule):
    """Conv1d followed by BatchNorm1d."""

    PARTS = _parts(nn.Conv1d, nn.BatchNorm1d, False)


class ConvBn2d(FusedModule):
    """Conv2d followed by BatchNorm2d.

    Example:
        >>> from torch import nn
        >>> [type(part).__name__ for part in ConvBn2d(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))]
        ['Conv2d', 'BatchNorm2d']
        >>> ConvBn2d(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(8))
        Traceback (most recent call last):
        ...
        ValueError: ConvBn2d: the BatchNorm has 8 features but the Conv2d has 4 output channels
    """

    PARTS = _parts(nn.Conv2d, nn.BatchNorm2d, False)


class ConvBn3d(FusedModule):
    """Conv3d followed by BatchNorm3d."""

    PARTS = _parts(nn.Conv3d, nn.BatchNorm3d, False)


class ConvBnReLU1d(FusedModule):
    """Conv1d, BatchNorm1d and ReLU/ReLU6."""

    PARTS = _parts(nn.Conv1d, nn.BatchNorm1d, True)


class ConvBnReLU2d(FusedModule):
    """Conv2d, BatchNorm2d and ReLU/ReLU6."""

    PARTS = _parts(nn.Conv2d, nn.BatchNorm2d, True)


class ConvBnReLU3d(FusedModule):
    """Conv3d, BatchNorm3d and ReLU/ReLU6."""

    PARTS = _parts(nn.Conv3d, nn.BatchNorm3d, True)


class LinearReLU(FusedModule):
    """Linear followed by ReLU/ReLU6."""

    PARTS = _parts(nn.Linear, None, True)


class LinearBn1d(FusedModule):
    """Linear followed by BatchNorm1d (input ``[N, C]``)."""

    PARTS = _parts(nn.Linear, nn.BatchNorm1d, False)


class LinearBnReLU1d(FusedModule):
    """Linear, BatchNorm1d and ReLU/ReLU6 (input ``[N, C]``)."""

    PARTS = _parts(nn.Linear, nn.BatchNorm1d, True)


class ConvTransposeReLU2d(FusedModule):
    """ConvTranspose2d followed by ReLU/ReLU6."""

    PARTS = _parts(nn.ConvTranspose2d, None, True)


class ConvTransposeBn2d(FusedModule):
    """ConvTranspose2d followed by BatchNorm2d."""

    PARTS = _parts(nn.ConvTranspose2d, nn.BatchNorm2d, False)


class ConvTransposeBnReLU2d(FusedModule):
    """ConvTranspose2d, BatchNorm2d and ReLU/ReLU6."""

    PARTS = _parts(nn.ConvTranspose2d, nn.BatchNorm2d, True)


# -- BatchNorm with frozen statistics (MQBench's freezebn family) -----------------------------------------
class ConvFreezebn2d(ConvBn2d):
    """Conv2d followed by a FrozenBatchNorm2d (its QAT module never updates the statistics)."""

    PARTS = _parts(nn.Conv2d, FrozenBatchNorm2d, False)


class ConvFreezebnReLU2d(ConvBnReLU2d):
    """Conv2d, FrozenBatchNorm2d and ReLU/ReLU6."""

    PARTS = _parts(nn.Conv2d, FrozenBatchNorm2d, True)


class ConvTransposeFreezebn2d(ConvTransposeBn2d):
    """ConvTranspose2d followed by a FrozenBatchNorm2d."""

    PARTS = _parts(nn.ConvTranspose2d, FrozenBatchNorm2d, False)


class ConvTransposeFreezebnReLU2d(ConvTransposeBnReLU2d):
    """ConvTranspose2d, FrozenBatchNorm2d and ReLU/ReLU6."""

    PARTS = _parts(nn.ConvTranspose2d, FrozenBatchNorm2d, True)
