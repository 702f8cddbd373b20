"""How :mod:`mqbench.utils.export_capture` writes the ATen ops torch.export records.

An op the placement rules know is written as the torch function they know (``aten.add.Tensor`` as
``operator.add``, ``aten.conv2d`` as ``F.conv2d`` ...); a copy into a chain of slices as one ``base[index] = value``;
and an op the ONNX exporter cannot write as torch.export recorded it is written with ops ONNX has:

* ``aten.diff`` (ONNX has no diff; transformers 5 takes the difference of consecutive position ids to find packed
  sequences when a decoder is called without an attention mask) as two slices and a subtraction, see :func:`diff`;
* ``aten.cumsum`` of a boolean or small integer tensor (ONNX's CumSum takes neither; transformers counts where a
  packed sequence starts that way) with the cast to int64 that torch does implicitly made explicit, see
  :func:`cumsum`.

Each entry of :data:`ATEN_WRITES` takes the node's arguments and keyword arguments (nodes of the captured graph
already) and returns the ``(function, args, kwargs)`` of the call written in their place.

Example:
    >>> import torch
    >>> x = torch.tensor([[0, 1, 2, 5, 6]])
    >>> diff(x, prepend=x[:, :1] - 1).tolist()
    [[1, 1, 1, 3, 1]]
    >>> cumsum(torch.tensor([True, False, True]), 0)
    tensor([1, 1, 2])
"""

from __future__ import annotations

import operator
import typing
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx

__all__ = ["ATEN_WRITES", "FX_NAMES", "after_write", "assignment_of", "cumsum", "diff"]

aten = torch.ops.aten


def diff(
    x: torch.Tensor,
    n: int = 1,
    dim: int = -1,
    prepend: torch.Tensor | None = None,
    append: torch.Tensor | None = None,
) -> torch.Tensor:
    """``torch.diff(x, n, dim, prepend, append)`` as ops ONNX has: ``prepend`` and ``append`` concatenated along
    ``dim``, then ``n`` times the slice from the second element minus the slice to the last but one (a boolean
    tensor's difference is the exclusive or, ``!=``, as torch computes it). The slices keep a dynamic ``dim``
    dynamic in the exported graph."""
    if x.dim() == 0:
        raise ValueError("diff expects a tensor of at least one dimension, got a scalar")
    if n < 0:
        raise ValueError(f"diff takes a non-negative order n, got {n}")
    axis = dim % x.dim()
    parts = [part for part in (prepend, x, append) if part is not None]
    for part in parts:
        if part.dim() != x.dim():
            raise ValueError(
                f"diff: prepend and append must have the {x.dim()} dimensions of the input, got one of {part.dim()}"
            )
    if len(parts) > 1:
        x = torch.cat(parts, dim=axis)
    before = (slice(None),) * axis
    for _ in range(n):
        later, earlier = x[(*before, slice(1, None))], x[(*before, slice(None, -1))]
        x = later != earlier if x.dtype == torch.bool else later - earlier
    return x


def cumsum(x: torch.Tensor, dim: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch.cumsum(x, dim, dtype=dtype)`` with the input cast first: to ``dtype``, or where it is None and ``x``
    is a boolean or integer tensor, to int64 (the type torch sums those in). The TorchScript exporter writes
    CumSum of the input as it is, and ONNX's CumSum takes no boolean, 8- or 16-bit tensor."""
    if dtype is None and not (x.is_floating_point() or x.is_complex()):
        dtype = torch.int64
    return torch.cumsum(x if dtype is None else x.to(dtype), dim)


def _same(function: Callable[..., Any]) -> Callable[[tuple[Any, ...], dict[str, Any]], Any]:
    return lambda args, kwargs: (function, args, kwargs)


def _binary(function: Callable[..., Any], functional: Callable[..., Any]) -> Callable[..., Any]:
    """``a + b`` as ``operator.add`` (an ``alpha`` keyword keeps the torch function)."""

    def write(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return (functional, args, kwargs) if kwargs or len(args) != 2 else (function, args, {})

    return write


def _inplace(function: Callable[..., Any]) -> Callable[..., Any]:
    return lambda args, kwargs: (function, args, {**kwargs, "inplace": True})


def _hardtanh(inplace: bool) -> Callable[..., Any]:
    def write(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        low, high = (list(args[1:3]) + [-1.0, 1.0][len(args) - 1 :])[:2]
        extra = {"inplace": True} if inplace else {}
        if (low, high) == (0.0, 6.0) and not kwargs:
            return (F.relu6, (args[0],), extra)
        return (F.hardtanh, (args[0], low, high), extra)

    return write


def _batch_norm(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x, weight, bias, mean, var, training, momentum, eps = args[:8]
    return (F.batch_norm, (x, mean, var, weight, bias, training, momentum, eps), {})


def _layer_norm(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return (F.layer_norm, tuple(args[:5]), {})


def _softmax(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if len(args) > 2 and args[2] is not None:
        return (torch.softmax, (args[0], args[1]), {"dtype": args[2]})
    return (torch.softmax, (args[0], args[1]), {})


def _embedding(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    weight, indices = args[:2]
    padding = args[2] if len(args) > 2 and args[2] != -1 else None
    return (F.embedding, (indices, weight, padding), {})


def _interpolate(mode: str) -> Callable[..., Any]:
    def write(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        x, size = args[0], args[1]
        if mode == "nearest":
            scales = args[2] if len(args) > 2 else kwargs.get("scale_factors")
            corners = None
        else:
            corners = args[2] if len(args) > 2 else kwargs.get("align_corners")
            scales = args[3] if len(args) > 3 else kwargs.get("scale_factors")
        keywords = {"size": size, "scale_factor": scales, "mode": mode, "align_corners": corners}
        return (F.interpolate, (x,), keywords)

    return write


def _slice(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x, dim, start, end, step = (list(args) + [0, None, None, 1][len(args) - 1 :])[:5]
    return (operator.getitem, (x, (slice(None),) * int(dim) + (slice(start, end, step),)), {})


def _select(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x, dim, index = args[:3]
    return (operator.getitem, (x, (slice(None),) * int(dim) + (index,)), {})


def after_write(tensor: torch.Tensor, write: Any) -> torch.Tensor:
    """``tensor`` itself, read after ``write`` (the ``tensor[index] = value`` node of the graph): what reads the
    tensor after a write reads this node, so a quantizer placed on its value, and the placement rules that look
    at what a value is computed from, see the write."""
    return tensor


def _full(part: Any) -> bool:
    """Whether a slice takes a whole dimension."""
    return (
        isinstance(part, slice)
        and part.start in (None, 0)
        and (part.stop is None or (isinstance(part.stop, int) and part.stop >= _WHOLE))
        and part.step in (None, 1)
    )


_WHOLE = 2**62  # a slice end at least this large is export's "to the end"


def assignment_of(node: fx.Node) -> tuple[fx.Node, tuple[Any, ...], Any] | None:
    """``(base, index, value)`` when ``node`` copies ``value`` into a chain of slices and selections of ``base``.

    Written as one ``base[index] = value``: torch.onnx.export (TorchScript) drops a copy into a view taken by
    several indexing steps, or by an ATen call, and the exported graph then computes without the write (a
    padding mask built this way vanished). None where the chain cannot be written as one index (two slices of
    one dimension, or another view op); such a node is kept as export wrote it."""
    if node.target is not aten.copy_.default or len(node.args) < 2:
        return None
    view = node.args[0]
    chain = []
    while isinstance(view, fx.Node) and view.target in (aten.slice.Tensor, aten.select.int):
        chain.append(view)
        view = view.args[0]
    value = view.meta.get("val") if isinstance(view, fx.Node) else None
    if not chain or not isinstance(value, torch.Tensor):
        return None
    index: list[Any] = [slice(None)] * value.dim()
    dims = list(range(value.dim()))  # the base dimension of each dimension of the current view
    for step in reversed(chain):
        dim = int(typing.cast(int, step.args[1])) if len(step.args) > 1 else 0
        dim = dim + len(dims) if dim < 0 else dim
        if not 0 <= dim < len(dims) or not _full(index[dims[dim]]):
            return None
        if step.target is aten.select.int:
            index[dims.pop(dim)] = step.args[2]
            continue
        start, end, stride = (list(step.args[2:]) + [None, None, 1][len(step.args) - 2 :])[:3]
        part = slice(start, end, stride)
        if not _full(part):
            index[dims[dim]] = part
    return typing.cast(fx.Node, view), tuple(index), node.args[1]


ATEN_WRITES: dict[Any, Callable[[tuple[Any, ...], dict[str, Any]], Any]] = {
    aten.add.Tensor: _binary(operator.add, torch.add),
    aten.add_.Tensor: _binary(operator.iadd, torch.Tensor.add_),
    aten.sub.Tensor: _binary(operator.sub, torch.sub),
    aten.mul.Tensor: _binary(operator.mul, torch.mul),
    aten.mul_.Tensor: _binary(operator.imul, torch.Tensor.mul_),
    aten.div.Tensor: _binary(operator.truediv, torch.div),
    aten.matmul.default: _same(torch.matmul),
    aten.bmm.default: _same(torch.bmm),
    aten.cat.default: _same(torch.cat),
    aten.relu.default: _same(torch.relu),
    aten.relu_.default: _inplace(F.relu),
    aten.relu6.default: _same(F.relu6),
    aten.hardtanh.default: _hardtanh(False),
    aten.hardtanh_.default: _hardtanh(True),
    aten.sigmoid.default: _same(torch.sigmoid),
    aten.tanh.default: _same(torch.tanh),
    aten.hardswish.default: _same(F.hardswish),
    aten.hardsigmoid.default: _same(F.hardsigmoid),
    aten.gelu.default: _same(F.gelu),
    aten.softmax.int: _softmax,
    aten.conv1d.default: _same(F.conv1d),
    aten.conv2d.default: _same(F.conv2d),
    aten.conv3d.default: _same(F.conv3d),
    aten.conv_transpose2d.input: _same(F.conv_transpose2d),
    aten.linear.default: _same(F.linear),
    aten.batch_norm.default: _batch_norm,
    aten.layer_norm.default: _layer_norm,
    aten.embedding.default: _embedding,
    aten.adaptive_avg_pool2d.default: _same(F.adaptive_avg_pool2d),
    aten.avg_pool2d.default: _same(F.avg_pool2d),
    aten.max_pool2d.default: _same(F.max_pool2d),
    aten.flatten.using_ints: _same(torch.flatten),
    aten.mean.dim: _same(torch.mean),
    aten.sum.default: _same(torch.sum),
    aten.sum.dim_IntList: _same(torch.sum),
    aten.reshape.default: _same(torch.reshape),
    aten.view.default: _same(torch.reshape),
    aten.scaled_dot_product_attention.default: _same(F.scaled_dot_product_attention),
    aten.sym_size.int: _same(torch.Tensor.size),  # the ONNX exporter keeps tensor.size(d) dynamic
    aten.slice.Tensor: _slice,
    aten.select.int: _select,
    aten.lift_fresh_copy.default: _same(torch.clone),  # a tensor constant made in forward
    aten.detach_.default: _same(torch.detach),
    aten.detach.default: _same(torch.detach),
    aten.upsample_nearest2d.vec: _interpolate("nearest"),
    aten.upsample_bilinear2d.vec: _interpolate("bilinear"),
    aten.diff.default: _same(diff),  # ONNX has no diff
    aten.cumsum.default: _same(cumsum),  # ONNX's CumSum takes no boolean
}

# The names torch.fx gives these ops (quantizers are named after the nodes they follow).
FX_NAMES = {aten.select.int: "getitem", aten.slice.Tensor: "getitem", aten.sym_size.int: "size"}
