"""Pure quantization math shared by every observer and fake quantizer.

Conventions (the same as ONNX QuantizeLinear / DequantizeLinear, so that a
deployed model computes what the simulation computes):

* quantize: ``q = clamp(round(x / scale) + zero_point, quant_min, quant_max)``
  with round-half-to-even and a true division (not a multiplication by
  ``1 / scale``, which differs in about 1.5 of every million inputs);
* dequantize: ``(q - zero_point) * scale``.

Per-tensor and per-channel quantization share one code path: per-tensor
parameters have shape ``[1]`` and per-channel parameters are reshaped to
broadcast along ``ch_axis``.

Example:
    >>> import torch
    >>> from mqbench.functional import qparams_from_range, fake_quantize
    >>> scale, zero_point = qparams_from_range(torch.tensor(-1.0), torch.tensor(1.0), -127, 127, True)
    >>> fake_quantize(torch.tensor([0.5, 2.0]), scale, zero_point, -127, 127).tolist()
    [0.5039370059967041, 1.0]
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from mqbench import kernels

__all__ = [
    "EPS",
    "FP8_FORMATS",
    "ParamTangents",
    "bits_of_range",
    "broadcast_to_axis",
    "ceil_ste",
    "fake_quantize",
    "fake_quantize_for_export",
    "folded_learnable_fake_quantize",
    "fp8_quantize",
    "from_groups",
    "group_shape",
    "learnable_fake_quantize",
    "param_tangents",
    "qparams_from_range",
    "round_pot",
    "round_ste",
    "to_groups",
]

EPS = torch.finfo(torch.float32).eps


def bits_of_range(quant_min: int, quant_max: int) -> int:
    """The number of bits an integer range needs, e.g. 8 for (-128, 127) and (-127, 127)."""
    return max(1, math.ceil(math.log2(quant_max - quant_min + 1)))


def round_pot(scale: Tensor) -> Tensor:
    """Round a positive scale to the nearest power of two in the log domain."""
    return torch.pow(2.0, torch.round(torch.log2(scale)))


def _range_scale(min_neg: Tensor, max_pos: Tensor, quant_min: int, quant_max: int, symmetric: bool) -> Tensor:
    if symmetric:
        if quant_min < 0:
            return torch.maximum(-min_neg, max_pos) / ((quant_max - quant_min) / 2)
        return max_pos / quant_max
    return (max_pos - min_neg) / (quant_max - quant_min)


def qparams_from_range(
    min_val: Tensor,
    max_val: Tensor,
    quant_min: int,
    quant_max: int,
    symmetric: bool,
    pot_scale: bool = False,
    eps: float = EPS,
) -> tuple[Tensor, Tensor]:
    """Scale and zero point that map ``[min_val, max_val]`` onto ``[quant_min, quant_max]``.

    The range is first widened to include zero, so zero is always exactly
    representable. Symmetric grids have zero point 0: a signed grid covers
    ``max(|min|, |max|)`` with ``(quant_max - quant_min) / 2`` steps, an
    unsigned one (``quant_min >= 0``) covers ``[0, max]`` with ``quant_max``
    steps. A range with nothing on the grid's side of zero (an all-zero tensor:
    a ReLU no calibration input opened, a pruned weight channel) is taken as
    ``[0, 1]``: any scale holds its values exactly, and that one keeps a bias
    quantized at ``input_scale * weight_scale`` within int32 (at a floor of
    1.2e-7 a bias of 0.3 needs 2**31 steps) and on a grid fine enough that
    rounding it changes nothing visible (at scale 1 the bias grid is the weight
    scale). Other scales are floored at ``eps`` and, with ``pot_scale``, rounded
    to a power of two in the log domain.

    Works elementwise on any shape (0-d for per-tensor, ``[C]`` per channel);
    returns float32 scales of at least one dimension and int32 zero points.
    """
    min_neg = torch.clamp(min_val.float(), max=0.0)
    max_pos = torch.clamp(max_val.float(), min=0.0)
    scale = _range_scale(min_neg, max_pos, quant_min, quant_max, symmetric)
    unit = _range_scale(torch.zeros_like(min_neg), torch.ones_like(max_pos), quant_min, quant_max, symmetric)
    scale = torch.where(scale == 0, unit, torch.clamp(scale, min=eps))
    if pot_scale:
        scale = round_pot(scale)
    if symmetric:
        zero_point = torch.zeros_like(scale, dtype=torch.int32)
    else:
        zero_point = torch.clamp(quant_min - torch.round(min_neg / scale), quant_min, quant_max).to(torch.int32)
    return scale.reshape(-1) if scale.dim() == 0 else scale, zero_point.reshape(
        -1
    ) if zero_point.dim() == 0 else zero_point


def broadcast_to_axis(param: Tensor, x: Tensor, ch_axis: int | None) -> Tensor:
    """Reshape a per-channel parameter ``[C]`` so it broadcasts along ``ch_axis`` of ``x``.

    With ``ch_axis`` None the parameter is per-tensor and returned unchanged.
    """
    if ch_axis is None:
        return param
    if not -x.dim() <= ch_axis < x.dim():
        raise ValueError(f"ch_axis={ch_axis} is out of range for a {x.dim()}-D tensor of shape {list(x.shape)}")
    axis = ch_axis % x.dim()
    if param.numel() != x.shape[axis]:
        raise ValueError(
            f"per-channel parameters have {param.numel()} channels but axis {axis} of the tensor "
            f"of shape {list(x.shape)} has {x.shape[axis]}"
        )
    shape = [1] * x.dim()
    shape[axis] = -1
    return param.reshape(shape)


def _axis(x: Tensor, param: Tensor, ch_axis: int | None) -> int:
    """``ch_axis`` normalised (after checking it against ``x`` and ``param``); -1 for per-tensor."""
    if ch_axis is None:
        return -1
    broadcast_to_axis(param, x, ch_axis)
    return ch_axis % x.dim()


def _broadcast(param: Tensor, x: Tensor, axis: int) -> Tensor:
    return broadcast_to_axis(param, x, None if axis < 0 else axis)


class _FakeQuantizeSTE(torch.autograd.Function):
    """Fixed fake quantization; straight-through gradient inside the clipping range."""

    @staticmethod
    def forward(ctx, x, scale, zero_point, quant_min, quant_max, axis):  # type: ignore[override]
        if kernels.usable(x):
            out, inside = kernels.module().fake_quant_forward(x, scale, zero_point, quant_min, quant_max, axis)
        else:
            s, z = _broadcast(scale, x, axis), _broadcast(zero_point.to(x.dtype), x, axis)
            q = torch.div(x, s).round_().add_(z)
            inside = (q >= quant_min).logical_and_(q <= quant_max)
            out = q.clamp_(quant_min, quant_max).sub_(z).mul_(s)
        if ctx.needs_input_grad[0]:
            ctx.save_for_backward(inside)
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        (inside,) = ctx.saved_tensors
        return grad * inside, None, None, None, None, None


def fake_quantize(
    x: Tensor, scale: Tensor, zero_point: Tensor, quant_min: int, quant_max: int, ch_axis: int | None = None
) -> Tensor:
    """Quantize and dequantize ``x`` (no gradient to scale or zero point).

    ``scale`` and ``zero_point`` have shape ``[1]`` (per-tensor) or ``[C]`` with ``ch_axis`` set.
    """
    axis = _axis(x, scale, ch_axis)
    return _FakeQuantizeSTE.apply(x, scale.detach(), zero_point.detach(), quant_min, quant_max, axis)


class _LearnableFakeQuantize(torch.autograd.Function):
    """Fake quantization with gradients to scale and zero point (LSQ / LSQ+).

    With ``v = x / s`` and ``q = round(v) + z``:
    inside ``[quant_min, quant_max]``: d/dx = 1, d/ds = round(v) - v, d/dz = 0;
    below: d/dx = 0, d/ds = quant_min - z, d/dz = -s; above: d/ds = quant_max - z, d/dz = -s.
    Scale and zero-point gradients are multiplied by ``grad_factor``.
    With ``drop`` (one random byte per element) an element whose byte is not below
    ``threshold`` passes through as float: output ``x``, d/dx = 1, nothing to scale or zero point.
    """

    @staticmethod
    def forward(ctx, x, scale, zero_point, quant_min, quant_max, axis, grad_factor, scale_floor, drop, threshold):  # type: ignore[override]
        ctx.scale_sign = None
        if scale_floor is not None:  # use max(|scale|, floor); the gradient is that of |scale|
            ctx.scale_sign = torch.sign(scale)
            scale = scale.abs().clamp_min(scale_floor)
        ctx.save_for_backward(x, scale, zero_point, drop)
        ctx.settings = (quant_min, quant_max, axis, grad_factor, threshold)
        if kernels.usable(x):
            fused = kernels.module().learnable_forward
            return fused(x, scale, zero_point, quant_min, quant_max, axis, drop, threshold)[0]
        s, z = _broadcast(scale, x, axis), _broadcast(zero_point, x, axis)
        out = torch.div(x, s).round_().add_(z).clamp_(quant_min, quant_max).sub_(z).mul_(s)
        return out if drop is None else torch.where(drop < threshold, out, x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x, scale, zero_point, drop = ctx.saved_tensors
        quant_min, quant_max, axis, grad_factor, threshold = ctx.settings
        if kernels.usable(x, grad):
            grad_x, grad_scale, grad_zero_point = kernels.module().learnable_backward(
                grad, x, scale, zero_point, quant_min, quant_max, axis, drop, threshold
            )
        else:
            s, z = _broadcast(scale, x, axis), _broadcast(zero_point, x, axis)
            local = _learnable_local_gradients(x, s, z, quant_min, quant_max, drop, threshold)
            outside, local_scale, local_zero = local
            grad_x = grad.masked_fill(outside, 0.0)
            grad_scale = (grad * local_scale).sum_to_size(s.shape).reshape(scale.shape)
            grad_zero_point = (grad * local_zero).sum_to_size(s.shape).reshape(scale.shape)
        grad_scale = grad_scale * grad_factor
        if ctx.scale_sign is not None:
            grad_scale = grad_scale * ctx.scale_sign
        return grad_x, grad_scale, grad_zero_point * grad_factor, None, None, None, None, None, None, None


def learnable_fake_quantize(
    x: Tensor,
    scale: Tensor,
    zero_point: Tensor,
    quant_min: int,
    quant_max: int,
    ch_axis: int | None = None,
    grad_factor: float = 1.0,
    scale_floor: float | None = None,
    drop: Tensor | None = None,
    threshold: int = 256,
) -> Tensor:
    """Fake quantization whose scale (and float zero point) receive the LSQ gradients.

    The zero point is rounded with a straight-through estimator, so a learnable
    float zero point always acts as an integer one. With ``scale_floor`` the scale used is
    ``max(|scale|, scale_floor)`` and its gradient that of ``|scale|`` (a learned scale that
    crosses zero or reaches the floor keeps a gradient). With ``drop``, a uint8 tensor shaped
    like ``x``, only the elements whose byte is below ``threshold`` are quantized; the others
    pass through as float with gradient 1 (QDrop), in the same single pass.
    """
    axis = _axis(x, scale, ch_axis)
    zero_point = zero_point.to(x.dtype)
    zero_point = round_ste(zero_point) if zero_point.requires_grad else torch.round(zero_point)
    out = _LearnableFakeQuantize.apply(
        x, scale, zero_point, quant_min, quant_max, axis, grad_factor, scale_floor, drop, threshold
    )
    if axis < 0 and out.requires_grad and not x.requires_grad and not torch.compiler.is_compiling():
        # A network input: the parameters are all that take a gradient (see ParamTangents).
        tangents = functools.partial(
            _learnable_tangents,
            settings=(quant_min, quant_max, grad_factor, scale_floor, threshold),
            wanted=(scale.requires_grad, zero_point.requires_grad),
        )
        inputs = (x, scale.detach(), zero_point.detach(), drop)
        out._mqbench_param_tangents = ParamTangents((scale, zero_point), inputs, tangents)  # type: ignore[attr-defined]
    return out


def _learnable_local_gradients(
    x: Tensor, s: Tensor, z: Tensor, quant_min: int, quant_max: int, drop: Tensor | None, threshold: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Per element of the learned-scale fake quantization: whether it is clipped, d(out)/d(scale) and
    d(out)/d(zero point), for the scale ``s`` in use (``max(|scale|, floor)``) and the rounded zero point."""
    v = x / s
    q = torch.round(v) + z
    below, above = q < quant_min, q > quant_max
    if drop is not None:
        kept = drop < threshold
        below, above = below & kept, above & kept
    outside = below | above
    local_scale = torch.where(below, quant_min - z, torch.where(above, quant_max - z, q - z - v))
    if drop is not None:
        local_scale = local_scale.masked_fill(~kept, 0.0)
    local_zero = torch.where(outside, -s, torch.zeros_like(v))
    return outside, local_scale, local_zero


def _learnable_tangents(
    x: Tensor,
    scale: Tensor,
    zero_point: Tensor,
    drop: Tensor | None,
    *,
    settings: tuple[int, int, float, float | None, int],
    wanted: tuple[bool, bool],
) -> tuple[Tensor | None, Tensor | None]:
    """d(out)/d(scale) and d(out)/d(zero point) per element of :func:`learnable_fake_quantize` (per
    tensor), gradient scaling included: the local gradients of its backward."""
    quant_min, quant_max, grad_factor, scale_floor, threshold = settings
    s = scale if scale_floor is None else scale.abs().clamp_min(scale_floor)
    _, local_scale, local_zero = _learnable_local_gradients(x, s, zero_point, quant_min, quant_max, drop, threshold)
    scale_factor = grad_factor if scale_floor is None else torch.sign(scale) * grad_factor
    return (local_scale * scale_factor if wanted[0] else None, local_zero * grad_factor if wanted[1] else None)


class ParamTangents(NamedTuple):
    """How a fake-quantized tensor depends on its quantizer's parameters when its input takes no gradient.

    The quantizer of a network's input feeds a layer whose input gradient is needed only for the
    quantizer's scale: ``sum(grad_in * t)`` with ``t = d(out)/d(scale)`` per element. For a layer
    linear in its input that equals ``sum(weight * layer_weight_gradient(grad_out, t))``, which
    skips the gradient to the input (for a first convolution's few input channels, a transposed
    convolution several times slower than its weight gradient). A quantizer that can describe
    its output this way attaches one to it (read with :func:`param_tangents`):
    ``compute(*inputs)`` gives, per parameter of ``params`` (the tensors the quantizer used), its
    tangent shaped like the output, or None where that parameter takes no gradient.
    """

    params: tuple[Tensor, ...]
    inputs: tuple[Tensor | None, ...]
    compute: Callable[..., tuple[Tensor | None, ...]]


def param_tangents(x: Tensor) -> ParamTangents | None:
    """The :class:`ParamTangents` a per-tensor learned-scale fake quantization attached to its output ``x``."""
    return getattr(x, "_mqbench_param_tangents", None)


class _FoldedLearnable(torch.autograd.Function):
    """``learnable_fake_quantize(w * f, ...) * (1 / f)`` with ``f`` per output channel (axis 0), fused."""

    @staticmethod
    def forward(ctx, w, factor, scale, zero_point, quant_min, quant_max, grad_factor, scale_floor):  # type: ignore[override]
        ctx.scale_sign = None
        if scale_floor is not None:  # as in _LearnableFakeQuantize
            ctx.scale_sign = torch.sign(scale)
            scale = scale.abs().clamp_min(scale_floor)
        ctx.save_for_backward(w, factor, scale, zero_point)
        ctx.settings = (quant_min, quant_max, grad_factor)
        return kernels.module().folded_learnable_forward(w, factor, scale, zero_point, quant_min, quant_max)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        w, factor, scale, zero_point = ctx.saved_tensors
        quant_min, quant_max, grad_factor = ctx.settings
        grad_w, grad_scale, grad_zero_point, grad_f = kernels.module().folded_learnable_backward(
            grad, w, factor, scale, zero_point, quant_min, quant_max
        )
        grad_scale = grad_scale.reshape(scale.shape) * grad_factor
        if ctx.scale_sign is not None:
            grad_scale = grad_scale * ctx.scale_sign
        grad_zero_point = grad_zero_point.reshape(scale.shape) * grad_factor
        return grad_w, grad_f.reshape(factor.shape), grad_scale, grad_zero_point, None, None, None, None


def folded_learnable_fake_quantize(
    weight: Tensor,
    factor: Tensor,
    scale: Tensor,
    zero_point: Tensor,
    quant_min: int,
    quant_max: int,
    ch_axis: int | None,
    grad_factor: float,
    scale_floor: float | None,
) -> Tensor:
    """``fq(weight * factor) / factor`` per output channel (axis 0) with the learned-scale ``fq`` of
    :func:`learnable_fake_quantize`: the weight of a layer whose BatchNorm is folded while training.
    A scale or zero point that does not require grad makes it :func:`fake_quantize`'s fixed form
    (same values, same straight-through gradient to the weight).

    One pass forward and one backward with the fused kernels (float32 CPU, scale per tensor or on
    axis 0); elsewhere the three ops. The output is the three ops' to the bit (the division is the
    multiplication by ``1 / factor``); gradients agree to float rounding.
    """
    shape = [-1] + [1] * (weight.dim() - 1)
    zero = zero_point.to(weight.dtype)
    zero = round_ste(zero) if zero.requires_grad else torch.round(zero)
    fusable = ch_axis in (None, 0) and weight.dim() >= 1 and factor.dim() == 1 and factor.numel() == weight.shape[0]
    if fusable and kernels.usable(weight, factor, scale):
        return _FoldedLearnable.apply(weight, factor, scale, zero, quant_min, quant_max, grad_factor, scale_floor)
    folded = weight * factor.reshape(shape)
    quantized = learnable_fake_quantize(
        folded, scale, zero_point, quant_min, quant_max, ch_axis, grad_factor, scale_floor=scale_floor
    )
    return quantized * (1.0 / factor).reshape(shape)


def round_ste(x: Tensor) -> Tensor:
    """round() in the forward pass, identity gradient."""
    return x + (torch.round(x) - x).detach()


def ceil_ste(x: Tensor) -> Tensor:
    """ceil() in the forward pass, identity gradient."""
    return x + (torch.ceil(x) - x).detach()


_INT8_CONTAINERS = ((-128, 127), (0, 255))


@functools.cache
def _register_export_shape_functions() -> None:
    """Give PyTorch's fake-quant kernels the shape functions ``torch.export`` needs.

    ``torch.onnx.export(dynamo=True)`` traces with fake tensors; PyTorch ships no
    shape function for these two kernels. Registered once, on the first export, and
    only where PyTorch does not provide one itself.
    """

    def shapes(x: Tensor, *args: object) -> tuple[Tensor, Tensor]:
        return torch.empty_like(x), torch.empty_like(x, dtype=torch.bool)

    for name in (
        "aten::_fake_quantize_per_tensor_affine_cachemask_tensor_qparams",
        "aten::fake_quantize_per_channel_affine_cachemask",
    ):
        with contextlib.suppress(RuntimeError):  # RuntimeError: it has one already (a newer PyTorch)
            torch.library.register_fake(name)(shapes)


def fake_quantize_for_export(
    x: Tensor, scale: Tensor, zero_point: Tensor, quant_min: int, quant_max: int, ch_axis: int | None = None
) -> Tensor:
    """The ONNX form of :func:`fake_quantize`, traced by both ``torch.onnx.export`` paths.

    Up to 8 bits this becomes QuantizeLinear/DequantizeLinear on an int8 or
    uint8 tensor; a narrower integer range (e.g. [-127, 127] or 4 bits) is
    enforced by clipping the input to the float image of that range first,
    which gives exactly the same integers. Wider grids export as the float
    arithmetic itself (Div, Round, Add, Clip, Sub, Mul), also exact.
    """
    scale = scale.detach().float()
    zero_point = torch.round(zero_point.detach().float())
    if bits_of_range(quant_min, quant_max) > 8:
        s = broadcast_to_axis(scale, x, ch_axis)
        z = broadcast_to_axis(zero_point, x, ch_axis)
        return (torch.clamp(torch.round(x / s) + z, quant_min, quant_max) - z) * s
    container = _INT8_CONTAINERS[0] if quant_min < 0 else _INT8_CONTAINERS[1]
    if (quant_min, quant_max) != container:
        low = broadcast_to_axis((quant_min - zero_point) * scale, x, ch_axis)
        high = broadcast_to_axis((quant_max - zero_point) * scale, x, ch_axis)
        # torch.where rather than clamp/minimum/maximum: onnxscript's optimizer (dynamo=True) fuses
        # Min/Max into a Clip whose bound names collide when two quantizers read the same tensor.
        x = torch.where(x < low, low, torch.where(x > high, high, x))
    zero_point = zero_point.to(torch.int32)
    _register_export_shape_functions()
    if ch_axis is None:
        return torch.fake_quantize_per_tensor_affine(x, scale.reshape(()), zero_point.reshape(()), *container)
    return torch.fake_quantize_per_channel_affine(x, scale, zero_point, ch_axis % x.dim(), *container)


# -- group-wise (block) quantization ---------------------------------------------------------------------------
# A weight [O, I, *k] quantized in groups of G input channels has one scale per (output channel, group, kernel
# position): the scale tensor [O, ceil(I / G), *k] of ONNX's blocked DequantizeLinear (axis 1, block_size G). The
# quantizers see the weight as rows [O * ceil(I / G) * prod(k), G], one row per group, in the order of that scale
# tensor, and quantize them per row (per channel on axis 0).


def group_shape(shape: tuple[int, ...] | torch.Size, group_size: int) -> list[int]:
    """The shape of the group-wise scales of a weight of ``shape``: axis 1 divided into groups (the last may be
    partial)."""
    if len(shape) < 2:
        raise ValueError(f"group-wise quantization needs a weight of 2 or more dimensions, got shape {list(shape)}")
    # (I + G - 1) // G rather than -(-I // G): ONNX export writes floor division as Div, which truncates negatives
    return [shape[0], (shape[1] + group_size - 1) // group_size, *shape[2:]]


def to_groups(x: Tensor, group_size: int) -> Tensor:
    """``x`` ``[O, I, *k]`` as rows ``[O * ceil(I / G) * prod(k), G]``, one per group of ``G`` input channels.

    A partial last group is filled up with copies of its last input channel, which changes neither its range
    nor, once quantized, its values.

    Example:
        >>> import torch
        >>> to_groups(torch.arange(6.0).reshape(2, 3), 2).tolist()
        [[0.0, 1.0], [2.0, 2.0], [3.0, 4.0], [5.0, 5.0]]
    """
    shape = group_shape(x.shape, group_size)
    padded = shape[1] * group_size
    if padded != x.shape[1]:
        last = x.narrow(1, x.shape[1] - 1, 1)
        x = torch.cat([x, last.expand(x.shape[0], padded - x.shape[1], *x.shape[2:])], dim=1)
    x = x.reshape(shape[0], shape[1], group_size, *x.shape[2:])
    return x.movedim(2, -1).reshape(-1, group_size)


def from_groups(rows: Tensor, shape: tuple[int, ...] | torch.Size, group_size: int) -> Tensor:
    """The inverse of :func:`to_groups`: rows back to a tensor of ``shape`` (filling of the last group dropped)."""
    blocks = group_shape(shape, group_size)
    x = rows.reshape(*blocks, group_size).movedim(-1, 2)
    x = x.reshape(blocks[0], blocks[1] * group_size, *blocks[2:])
    return x.narrow(1, 0, shape[1]) if x.shape[1] != shape[1] else x


# -- FP8 --------------------------------------------------------------------------------------------------------
# E4M3 (the "FN" variant: no infinities, largest 448) and E5M2 (largest 57344), as ONNX's FLOAT8E4M3FN / FLOAT8E5M2
FP8_FORMATS: dict[str, torch.dtype] = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


class _FP8STE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale, largest, dtype):  # type: ignore[override]
        y = x / scale
        inside = y.abs() <= largest
        ctx.save_for_backward(inside)
        return torch.clamp(y, -largest, largest).to(dtype).to(x.dtype) * scale

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        (inside,) = ctx.saved_tensors
        return grad * inside, None, None, None


def fp8_quantize(x: Tensor, scale: Tensor, fmt: str = "e4m3", ch_axis: int | None = None) -> Tensor:
    """``cast_fp8(clamp(x / scale, -M, M)) * scale``: saturating FP8 fake quantization, rounding to nearest even
    (ONNX QuantizeLinear with ``saturate=1``); ``M`` the format's largest value; straight-through gradient
    inside the range.

    Example:
        >>> import torch
        >>> fp8_quantize(torch.tensor([0.3, 1000.0]), torch.tensor([1.0])).tolist()  # E4M3: 3 mantissa bits
        [0.3125, 448.0]
    """
    dtype = FP8_FORMATS[fmt]
    largest = float(torch.finfo(dtype).max)
    s = broadcast_to_axis(scale.to(x.dtype), x, ch_axis)
    if torch.onnx.is_in_onnx_export():  # its exported form is replaced by Q/DQ nodes (mqbench.grids.FP8Grid)
        return torch.clamp(x / s, -largest, largest) * s
    return _FP8STE.apply(x, s, largest, dtype)
