"""Offline data: scikit-learn's bundled digits (1797 8x8 images), split deterministically.

Example:
    >>> from mqbench.data import load_digits_split
    >>> train, test = load_digits_split()
    >>> train.images.shape[1:], len(train.images) + len(test.images)
    (torch.Size([1, 8, 8]), 1797)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["Split", "load_digits_split"]


@dataclass(frozen=True)
class Split:
    images: Tensor  # [N, 1, 8, 8], pixel values scaled to [0, 1]
    labels: Tensor  # [N] int64

    def batches(self, batch_size: int, generator: torch.Generator | None = None):
        """Mini-batches, shuffled when a generator is given."""
        order = torch.randperm(len(self.labels), generator=generator) if generator else torch.arange(len(self.labels))
        for start in range(0, len(order), batch_size):
            index = order[start : start + batch_size]
            yield self.images[index], self.labels[index]


def load_digits_split(test_fraction: float = 0.25, seed: int = 0) -> tuple[Split, Split]:
    """The digits data set as (train, test) tensors; needs scikit-learn (``pip install mqbench[demo]``)."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as error:
        raise ImportError(
            "the digits data set comes with scikit-learn; install it with `pip install 'mqbench[demo]'`"
        ) from error
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    cut = int(len(labels) * (1 - test_fraction))
    train, test = order[:cut], order[cut:]
    return Split(images[train], labels[train]), Split(images[test], labels[test])
