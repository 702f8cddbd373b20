"""A small two-head dense detector, defined in the project, random init.

A conv-bn-relu backbone with outputs at strides 4 and 8, a box-regression head on
the stride-4 feature, and a classification head whose stride-8 prediction is
upsampled with ``F.interpolate(scale_factor=2, mode="nearest")`` and added to the
stride-4 prediction (an FPN-like top-down add).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["TwoHeadDetector", "two_head_detector"]


def _conv_bn_relu(in_ch: int, out_ch: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(in_ch, out_ch, 3, stride=stride, padding=1, bias=False),
        nn.BatchNorm2d(out_ch),
        nn.ReLU(inplace=True),
    )


class TwoHeadDetector(nn.Module):
    """Dense detector returning ``{"boxes": [N, A*4, H/4, W/4], "scores": [N, A*C, H/4, W/4]}``.

    ``A`` is ``num_anchors`` and ``C`` is ``num_classes``; H and W must be multiples of 8.

    Example:
        >>> import torch
        >>> out = TwoHeadDetector(num_classes=3, num_anchors=2, width=8)(torch.zeros(1, 3, 32, 32))
        >>> {k: tuple(v.shape) for k, v in out.items()}
        {'boxes': (1, 8, 8, 8), 'scores': (1, 6, 8, 8)}
    """

    def __init__(self, num_classes: int = 3, num_anchors: int = 3, width: int = 16) -> None:
        super().__init__()
        w = width
        self.stem = _conv_bn_relu(3, w, stride=2)  # stride 2
        self.stage1 = nn.Sequential(_conv_bn_relu(w, 2 * w, stride=2), _conv_bn_relu(2 * w, 2 * w))  # stride 4
        self.stage2 = nn.Sequential(_conv_bn_relu(2 * w, 4 * w, stride=2), _conv_bn_relu(4 * w, 4 * w))  # stride 8
        self.box_tower = _conv_bn_relu(2 * w, 2 * w)
        self.box_out = nn.Conv2d(2 * w, num_anchors * 4, 1)
        self.cls_tower_hi = _conv_bn_relu(2 * w, 2 * w)
        self.cls_out_hi = nn.Conv2d(2 * w, num_anchors * num_classes, 1)
        self.cls_tower_lo = _conv_bn_relu(4 * w, 4 * w)
        self.cls_out_lo = nn.Conv2d(4 * w, num_anchors * num_classes, 1)

    def forward(self, x: Tensor) -> dict[str, Tensor]:
        c4 = self.stage1(self.stem(x))
        c8 = self.stage2(c4)
        boxes = self.box_out(self.box_tower(c4))
        scores_hi = self.cls_out_hi(self.cls_tower_hi(c4))
        scores_lo = self.cls_out_lo(self.cls_tower_lo(c8))
        scores = scores_hi + F.interpolate(scores_lo, scale_factor=2.0, mode="nearest")
        return {"boxes": boxes, "scores": scores}


def two_head_detector(num_classes: int = 3, num_anchors: int = 3) -> TwoHeadDetector:
    """Build a :class:`TwoHeadDetector` (width 16).

    Example:
        >>> import torch
        >>> out = two_head_detector(num_classes=3)(torch.zeros(2, 3, 64, 64))
        >>> out["boxes"].shape, out["scores"].shape
        (torch.Size([2, 12, 16, 16]), torch.Size([2, 9, 16, 16]))
    """
    return TwoHeadDetector(num_classes=num_classes, num_anchors=num_anchors)
