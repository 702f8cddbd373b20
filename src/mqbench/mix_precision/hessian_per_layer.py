"""MQBench's ``hessian_per_layer``: per-layer Hessian eigenvalues and traces of a float model's loss.

Example:
    >>> import torch
    >>> from mqbench.mix_precision.hessian_per_layer import hessian_per_layer
    >>> model = torch.nn.Sequential(torch.nn.Linear(3, 1))
    >>> data = (torch.randn(8, 3), torch.randn(8, 1))
    >>> sorted(hessian_per_layer(model, torch.nn.MSELoss(), data=data, cuda=False).layer_eigenvalues())
    ['0']
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from mqbench.mix_precision import hessian_eigenvalues, hessian_traces

__all__ = ["hessian_per_layer"]


class hessian_per_layer:  # noqa: N801  (MQBench's name)
    """The loss Hessian of ``model`` on ``data = (inputs, targets)``, one diagonal block per conv/linear weight."""

    def __init__(self, model: nn.Module, criterion: Callable[..., Any], data: tuple[Any, Any], cuda: bool = False):
        self.model, self.criterion = model, criterion
        self.inputs, self.targets = data
        if cuda:
            raise ValueError("cuda=True: move the model and data to the GPU yourself and pass cuda=False")

    def layer_eigenvalues(self, maxIter: int = 100, tol: float = 1e-3) -> dict[str, float]:  # noqa: N803
        """The largest eigenvalue per layer (power iteration)."""
        return hessian_eigenvalues(self.model, self.inputs, self.targets, self.criterion, maxIter, tol)

    def layer_trace(self, maxIter: int = 100, tol: float = 1e-3) -> dict[str, float]:  # noqa: N803
        """Hutchinson's trace estimate per layer (``maxIter`` probes; ``tol`` is not used)."""
        return hessian_traces(self.model, self.inputs, self.targets, self.criterion, probes=maxIter)
