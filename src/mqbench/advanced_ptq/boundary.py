"""The values a calibration batch holds at a segment boundary of the calibration pipeline
(:class:`~mqbench.advanced_ptq.pipeline.Pipeline`): in memory, or spilled to a memory-mapped file past the
pipeline's cache budget."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

__all__ = ["Boundary", "nbytes_of"]


class Boundary:
    """One batch's values live at a segment boundary (node name -> value), in memory or in a memory-mapped file."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.values: dict[str, Any] | None = values
        self.file: Path | None = None

    def nbytes(self) -> int:
        return sum(nbytes_of(v) for v in (self.values or {}).values())

    def spill(self, folder: Path, key: str) -> None:
        self.file = folder / f"{key}.pt"
        torch.save(self.values, self.file)
        self.values = None

    def drop(self) -> None:
        if self.file is not None:
            self.file.unlink(missing_ok=True)
        self.values, self.file = None, None

    def load(self) -> dict[str, Any]:
        if self.values is not None:
            return dict(self.values)
        assert self.file is not None
        return dict(torch.load(self.file, mmap=True, weights_only=True))


def nbytes_of(value: Any) -> int:
    if isinstance(value, Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(nbytes_of(v) for v in value)
    return 0
