"""Quantization-aware training across processes: PyTorch's DistributedDataParallel, set up the quantization way.

Under ``torchrun`` (``WORLD_SIZE`` > 1) :class:`Processes` joins the process group (NCCL on GPUs,
gloo on CPUs). The order that keeps every rank's quantized model identical:

1. prepare the model on every rank (the same graph, the same quantizers);
2. calibrate on rank 0 over the whole calibration set, then broadcast rank 0's parameters and
   buffers (:meth:`Processes.broadcast_state`): every observer kind (min/max, EMA, histograms,
   the MSE search) then holds exactly the single-process statistics, which an all-reduce of
   per-rank statistics gives only for min/max;
3. replace BatchNorm with its synchronised form (the BN inside the folded conv+BN modules too):
   :class:`DistributedBatchNorm` on CPUs, where PyTorch's ``SyncBatchNorm`` does not run, and
   ``SyncBatchNorm`` on GPUs; the batch statistics are those of the global batch;
4. wrap in ``DistributedDataParallel``: every trainable parameter, the learned scales and zero
   points included, gets its gradient averaged over the ranks;
5. each step, rank ``r`` takes its slice of one global batch (:meth:`Processes.shard`), so N
   processes with batch ``b`` compute what one process computes with batch ``N * b``;
6. rank 0 evaluates, writes checkpoints and deploys, from the unwrapped model.

Example:
    >>> Processes.from_env().world_size   # a plain process
    1
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__ = ["DistributedBatchNorm", "Processes", "restore_batch_norm", "synchronise_batch_norm", "unwrap"]


@dataclass(frozen=True)
class Processes:
    """This process's place among the training processes (one process: rank 0 of 1)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @classmethod
    def from_env(cls) -> Processes:
        """Read torchrun's environment; joins the process group when there are several processes."""
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        if world_size <= 1:
            return cls()
        if not dist.is_initialized():
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        return cls(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))

    @property
    def main(self) -> bool:
        """Whether this is rank 0, the process that evaluates and writes."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def shard(self, batch: Tensor) -> Tensor:
        """This rank's equal slice of one global batch (the remainder rows of an uneven batch are dropped)."""
        if not self.distributed:
            return batch
        size = len(batch) // self.world_size
        return batch[self.rank * size : (self.rank + 1) * size]

    def broadcast_state(self, model: nn.Module) -> None:
        """Every parameter and buffer of ``model`` set to rank 0's values (shapes included: calibration can
        turn a quantizer's placeholder scale into a per-channel one)."""
        if not self.distributed:
            return
        payload = [model.state_dict() if self.main else None]
        dist.broadcast_object_list(payload, src=0)
        if not self.main:
            assert payload[0] is not None
            model.load_state_dict(payload[0])

    def mean(self, value: float) -> float:
        """``value`` averaged over the ranks (for logging a loss)."""
        if not self.distributed:
            return value
        tensor = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(tensor)
        return float(tensor[0]) / self.world_size

    def close(self) -> None:
        if self.distributed and dist.is_initialized():
            # a DistributedDataParallel wrapper left in a reference cycle is freed by the garbage collector at
            # any later moment; freed after its process group was destroyed, it can abort the process
            gc.collect()
            dist.destroy_process_group()


class _AllReduceSum(torch.autograd.Function):
    """Sum over the ranks; its gradient is the sum over the ranks of the output gradients."""

    @staticmethod
    def forward(ctx: Any, tensor: Tensor) -> Tensor:  # type: ignore[override]
        total = tensor.clone()
        dist.all_reduce(total)
        return total

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:  # type: ignore[override]
        total = grad.clone()
        dist.all_reduce(total)
        return total


class DistributedBatchNorm(nn.BatchNorm2d):
    """BatchNorm whose training statistics are those of the batch over every process (works on CPUs).

    Per channel, the sum and the sum of squares of the local batch are all-reduced by a differentiable
    sum (its backward all-reduces the gradients), so forward and backward are those of BatchNorm on
    the global batch. Running statistics are updated as BatchNorm does (unbiased variance,
    ``momentum``). Any input rank with channels on dimension 1 (BatchNorm1d/2d/3d).
    """

    original_class: type[nn.modules.batchnorm._BatchNorm] = nn.BatchNorm2d  # what restore_batch_norm puts back

    def forward(self, x: Tensor) -> Tensor:
        if not (self.training and dist.is_available() and dist.is_initialized()):
            return nn.functional.batch_norm(
                x,
                self.running_mean if not self.training or self.track_running_stats else None,
                self.running_var if not self.training or self.track_running_stats else None,
                self.weight,
                self.bias,
                self.training or not self.track_running_stats,
                self.momentum if self.momentum is not None else 0.0,
                self.eps,
            )
        dims = [d for d in range(x.dim()) if d != 1]
        count = torch.tensor([x.numel() / x.shape[1]], dtype=x.dtype, device=x.device)
        stats = torch.cat([x.sum(dims), x.square().sum(dims), count])
        stats = _AllReduceSum.apply(stats)
        channels = x.shape[1]
        total = stats[-1]
        mean = stats[:channels] / total
        var = stats[channels : 2 * channels] / total - mean.square()
        shape = [1, channels] + [1] * (x.dim() - 2)
        y = (x - mean.view(shape)) / torch.sqrt(var.view(shape) + self.eps)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        if self.track_running_stats and self.running_mean is not None and self.running_var is not None:
            with torch.no_grad():
                momentum = self.momentum if self.momentum is not None else 0.1
                unbiased = var.detach() * total / (total - 1).clamp(min=1)
                self.running_mean.mul_(1 - momentum).add_(mean.detach(), alpha=momentum)
                self.running_var.mul_(1 - momentum).add_(unbiased, alpha=momentum)
                if self.num_batches_tracked is not None:
                    self.num_batches_tracked.add_(1)
        return y


def synchronise_batch_norm(model: nn.Module) -> nn.Module:
    """Every BatchNorm in ``model`` (fused modules' included) replaced by its synchronised form, in place."""
    if torch.cuda.is_available() and any(p.is_cuda for p in model.parameters()):
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.modules.batchnorm._BatchNorm) and not isinstance(child, DistributedBatchNorm):
                replacement = DistributedBatchNorm(
                    child.num_features, child.eps, child.momentum, child.affine, child.track_running_stats
                )
                replacement.load_state_dict(child.state_dict())
                replacement.original_class = type(child)
                replacement.train(child.training)
                setattr(parent, name, replacement)
    return model


def restore_batch_norm(model: nn.Module) -> nn.Module:
    """The inverse of :func:`synchronise_batch_norm` on CPUs: the original BatchNorm class, same state, in place."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, DistributedBatchNorm):
                settings = (child.num_features, child.eps, child.momentum, child.affine, child.track_running_stats)
                plain = child.original_class(*settings)
                plain.load_state_dict(child.state_dict())
                plain.train(child.training)
                setattr(parent, name, plain)
    return model


def unwrap(model: Any) -> nn.Module:
    """The model inside a DistributedDataParallel wrapper (the model itself otherwise)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
