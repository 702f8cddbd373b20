"""QAT convolutions: the float conv with its weight fake-quantized on every forward.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from mqbench.fake_quantize import FixedFakeQuantize
    >>> from mqbench.nn.qat import Conv2d
    >>> factory = FixedFakeQuantize.with_args(quant_min=-127, quant_max=127, qscheme=torch.per_tensor_symmetric)
    >>> qat = Conv2d.from_float(nn.Conv2d(3, 4, 3), factory)
    >>> isinstance(qat, nn.Conv2d), qat(torch.randn(1, 3, 5, 5)).shape
    (True, torch.Size([1, 4, 3, 3]))
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from mqbench.functional import ParamTangents, param_tangents
from mqbench.nn.qat.modules.base import QATModule, WeightFakeQuantFactory, build_weight_fake_quant

__all__ = ["Conv1d", "Conv2d", "Conv3d", "conv_forward"]

# Input channels per group up to which a convolution of a quantized network input gives the
# quantizer's parameters their gradients through weight gradients even when there are two of them
# (scale and zero point): there the gradient to the input, a transposed convolution to few
# channels, costs several weight gradients. With one parameter it always does (equal arithmetic).
_FEW_INPUT_CHANNELS = 4


class _ConvOfQuantizedInput(torch.autograd.Function):
    """``layer._conv_forward(q, weight, bias)`` for ``q`` fake-quantized from a tensor that takes no gradient.

    Gradients: to weight and bias as the convolution's; to each quantizer parameter ``p``
    ``sum(weight * dW(t_p))``, with ``dW(t)`` the convolution's weight gradient for input ``t``
    and ``t_p = d(q)/d(p)`` per element (see :class:`mqbench.functional.ParamTangents`). The
    gradient to ``q`` is never formed.
    """

    @staticmethod
    def forward(ctx, q, weight, bias, layer, tangents, *params):  # type: ignore[override]
        ctx.layer, ctx.compute = layer, tangents.compute
        ctx.bias_shape = None if bias is None else list(bias.shape)
        ctx.param_shapes = [param.shape for param in params]
        ctx.save_for_backward(q, weight, *tangents.inputs)
        return layer._conv_forward(q, weight, bias)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        q, weight, *inputs = ctx.saved_tensors
        layer = ctx.layer
        output_padding = [0] * len(layer.stride)
        settings = (list(layer.stride), list(layer.padding), list(layer.dilation), False, output_padding, layer.groups)

        def weight_gradient(x: Tensor, with_bias: bool = False) -> tuple[Tensor, Tensor | None]:
            mask = [False, True, with_bias]
            _, grad_weight, grad_bias = torch.ops.aten.convolution_backward(
                grad, x, weight, ctx.bias_shape if with_bias else None, *settings, mask
            )
            return grad_weight, grad_bias

        grad_weight = grad_bias = None
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            grad_weight, grad_bias = weight_gradient(q, ctx.needs_input_grad[2])
            grad_weight = grad_weight if ctx.needs_input_grad[1] else None
        grads: list[Tensor | None] = []
        for index, tangent in enumerate(ctx.compute(*inputs)):
            if tangent is None or not ctx.needs_input_grad[5 + index]:
                grads.append(None)
                continue
            grads.append((weight * weight_gradient(tangent)[0]).sum().reshape(ctx.param_shapes[index]))
        return (None, grad_weight, grad_bias, None, None, *grads)


def conv_forward(layer: nn.Conv1d | nn.Conv2d | nn.Conv3d, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``layer._conv_forward(x, weight, bias)``; for ``x`` the fake-quantized network input, with the
    quantizer's parameter gradients computed through the weight gradient (:class:`_ConvOfQuantizedInput`).
    """
    conv = layer._conv_forward
    tangents: ParamTangents | None = param_tangents(x)
    if (
        tangents is None
        or not torch.is_grad_enabled()
        or layer.padding_mode != "zeros"
        or isinstance(layer.padding, str)
    ):
        return conv(x, weight, bias)
    wanted = sum(p.requires_grad for p in tangents.params)
    if wanted > 1 and layer.in_channels // layer.groups > _FEW_INPUT_CHANNELS:
        return conv(x, weight, bias)
    return _ConvOfQuantizedInput.apply(x.detach(), weight, bias, layer, tangents, *tangents.params)


class Conv1d(QATModule, nn.Conv1d):
    """QAT Conv1d: ``conv1d(x, weight_fake_quant(weight), bias)``; arguments as nn.Conv1d."""

    _FLOAT_MODULE: ClassVar[type[nn.Module]] = nn.Conv1d
    _FLOAT_LAYER = nn.Conv1d

    def __init__(self, *args: Any, weight_fake_quant_factory: WeightFakeQuantFactory, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.weight_fake_quant = build_weight_fake_quant(weight_fake_quant_factory, self.weight)

    def forward(self, input: Tensor) -> Tensor:
        return conv_forward(self, input, self.weight_fake_quant(self.weight), self.bias)


class Conv2d(QATModule, nn.Conv2d):
    """QAT Conv2d: ``conv2d(x, weight_fake_quant(weight), bias)``; arguments as nn.Conv2d.

    Example:
        >>> import torch
        >>> from mqbench.fake_quantize import FixedFakeQuantize
        >>> factory = FixedFakeQuantize.with_args(quant_min=0, quant_max=255)
        >>> conv = Conv2d(2, 2, 1, bias=False, weight_fake_quant_factory=factory)
        >>> conv.weight_fake_quant.disable_fake_quant()
        >>> x = torch.randn(1, 2, 3, 3)
        >>> torch.equal(conv(x), torch.nn.functional.conv2d(x, conv.weight))
        True
    """

    _FLOAT_MODULE: ClassVar[type[nn.Module]] = nn.Conv2d
    _FLOAT_LAYER = nn.Conv2d

    def __init__(self, *args: Any, weight_fake_quant_factory: WeightFakeQuantFactory, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.weight_fake_quant = build_weight_fake_quant(weight_fake_quant_factory, self.weight)

    def forward(self, input: Tensor) -> Tensor:
        return conv_forward(self, input, self.weight_fake_quant(self.weight), self.bias)


class Conv3d(QATModule, nn.Conv3d):
    """QAT Conv3d: ``conv3d(x, weight_fake_quant(weight), bias)``; arguments as nn.Conv3d."""

    _FLOAT_MODULE: ClassVar[type[nn.Module]] = nn.Conv3d
    _FLOAT_LAYER = nn.Conv3d

    def __init__(self, *args: Any, weight_fake_quant_factory: WeightFakeQuantFactory, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.weight_fake_quant = build_weight_fake_quant(weight_fake_quant_factory, self.weight)

    def forward(self, input: Tensor) -> Tensor:
        return conv_forward(self, input, self.weight_fake_quant(self.weight), self.bias)
