"""A convolution of the fake-quantized network input gives the quantizer's parameters their
gradients through weight gradients (mqbench.nn.qat.modules.conv.conv_forward), never forming
the gradient to its input: same output, same gradients as the formula and as the plain path."""

import copy

import pytest
import torch
from torch import nn

from mqbench.fake_quantize import LearnableFakeQuantize, QDropFakeQuantize, TqtFakeQuantize
from mqbench.functional import EPS, param_tangents
from mqbench.nn import intrinsic as nni
from mqbench.nn import qat as nnqat
from mqbench.nn.intrinsic import qat as nniqat

WEIGHT = LearnableFakeQuantize.with_args(quant_min=-127, quant_max=127, qscheme=torch.per_channel_symmetric, ch_axis=0)

LAYERS = {
    "stem": (lambda: nnqat.Conv2d.from_float(nn.Conv2d(3, 8, 7, stride=2, padding=3), WEIGHT), (4, 3, 20, 20)),
    "grouped": (lambda: nnqat.Conv2d.from_float(nn.Conv2d(4, 6, 3, groups=2, bias=False), WEIGHT), (3, 4, 9, 9)),
    "conv1d_dilated": (lambda: nnqat.Conv1d.from_float(nn.Conv1d(2, 4, 3, dilation=2, padding=2), WEIGHT), (5, 2, 17)),
    "conv3d": (lambda: nnqat.Conv3d.from_float(nn.Conv3d(2, 4, 2, stride=(1, 2, 1)), WEIGHT), (3, 2, 5, 6, 4)),
}

QUANTIZERS = {
    "lsq_symmetric": lambda: LearnableFakeQuantize(quant_min=-128, quant_max=127, qscheme=torch.per_tensor_symmetric),
    "lsq_affine": lambda: LearnableFakeQuantize(quant_min=0, quant_max=255, qscheme=torch.per_tensor_affine),
    "tqt": lambda: TqtFakeQuantize(quant_min=-128, quant_max=127, qscheme=torch.per_tensor_symmetric),
}


def _calibrated(quantizer: nn.Module, x: torch.Tensor) -> nn.Module:
    quantizer(x * 0.6)  # a range narrower than the data: some elements clip on either side
    quantizer.disable_observer()
    return quantizer


def _graph_has(output: torch.Tensor, name: str) -> bool:
    seen, stack = set(), [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == name:
            return True
        stack.extend(parent for parent, _ in node.next_functions)
    return False


def _run(layer, quantizer, x, upstream, adjoint: bool):
    layer, quantizer = copy.deepcopy(layer), copy.deepcopy(quantizer)
    q = quantizer(x)
    assert (param_tangents(q) is not None) is True
    if not adjoint:
        del q._mqbench_param_tangents  # the plain path: autograd through the gradient to q
    out = layer(q)
    assert _graph_has(out, "_ConvOfQuantizedInputBackward") is adjoint
    (out * upstream).sum().backward()
    return out.detach(), quantizer, layer


def _reference_parameter_gradients(quantizer, layer, x, upstream):
    """LSQ's gradients written out, with the gradient to the quantized input from float64 autograd."""
    scale = quantizer.scale.detach()
    s = scale.abs().clamp_min(EPS)
    z = quantizer.zero_point.detach().clamp(quantizer.quant_min, quantizer.quant_max).round()
    v = x / s  # float32 division, as quantized
    r = torch.round(v)
    below, above = r + z < quantizer.quant_min, r + z > quantizer.quant_max
    q = ((r + z).clamp(quantizer.quant_min, quantizer.quant_max) - z) * s
    q64 = q.double().requires_grad_()
    weight = layer.weight_fake_quant(layer.weight).detach().double()
    bias = None if layer.bias is None else layer.bias.detach().double()
    out = layer._conv_forward(q64, weight, bias)
    (grad_q,) = torch.autograd.grad(out, q64, upstream.double())
    local_scale = torch.where(below, quantizer.quant_min - z, torch.where(above, quantizer.quant_max - z, r - v))
    local_zero = torch.where(below | above, -s, torch.zeros_like(s))
    factor = quantizer.grad_factor(x)
    grad_scale = factor * torch.sign(scale).double() * (grad_q * local_scale.double()).sum()
    return grad_scale.reshape(1), (factor * (grad_q * local_zero.double()).sum()).reshape(1)


@pytest.mark.parametrize("layer_name", sorted(LAYERS))
@pytest.mark.parametrize("quantizer_name", ["lsq_symmetric", "lsq_affine"])
def test_parameter_gradients_match_the_lsq_formula(layer_name, quantizer_name):
    torch.manual_seed(0)
    build, shape = LAYERS[layer_name]
    layer = build()
    x = torch.randn(shape)
    layer(x)
    layer.weight_fake_quant.disable_observer()
    quantizer = _calibrated(QUANTIZERS[quantizer_name](), x)
    upstream = torch.randn_like(layer(quantizer(x)))
    out, fused_quantizer, fused_layer = _run(layer, quantizer, x, upstream, adjoint=True)
    plain_out, _, plain_layer = _run(layer, quantizer, x, upstream, adjoint=False)
    assert torch.equal(out, plain_out)
    grad_scale, grad_zero = _reference_parameter_gradients(quantizer, layer, x, upstream)
    assert grad_scale.abs() > 0
    torch.testing.assert_close(fused_quantizer.scale.grad.double(), grad_scale, rtol=1e-4, atol=1e-7)
    if quantizer_name == "lsq_affine":
        assert grad_zero.abs() > 0
        torch.testing.assert_close(fused_quantizer.zero_point.grad.double(), grad_zero, rtol=1e-4, atol=1e-7)
    else:
        assert fused_quantizer.zero_point.grad is None
    # The layer's own gradients are the convolution's weight and bias gradients either way.
    for name, parameter in fused_layer.named_parameters():
        torch.testing.assert_close(parameter.grad, dict(plain_layer.named_parameters())[name].grad)


@pytest.mark.parametrize("quantizer_name", sorted(QUANTIZERS))
def test_folded_conv_bn_relu_with_inplace_relu(quantizer_name):
    """The first layer of a prepared CNN: Conv + BN (folded, batch statistics) + in-place ReLU."""
    torch.manual_seed(1)
    float_module = nni.ConvBnReLU2d(nn.Conv2d(3, 8, 7, stride=2, padding=3), nn.BatchNorm2d(8), nn.ReLU(inplace=True))
    layer = nniqat.ConvBnReLU2d.from_float(float_module, WEIGHT)
    x = torch.randn(6, 3, 16, 16)
    layer(x)
    layer.weight_fake_quant.disable_observer()
    quantizer = _calibrated(QUANTIZERS[quantizer_name](), x)
    upstream = torch.randn(6, 8, 8, 8)
    out, fused_quantizer, fused_layer = _run(layer, quantizer, x, upstream, adjoint=True)
    plain_out, plain_quantizer, plain_layer = _run(layer, quantizer, x, upstream, adjoint=False)
    assert torch.equal(out, plain_out)
    for fused, plain in zip(fused_quantizer.parameters(), plain_quantizer.parameters(), strict=True):
        if plain.grad is None:
            assert fused.grad is None
        else:
            assert plain.grad.abs().sum() > 0
            torch.testing.assert_close(fused.grad, plain.grad, rtol=1e-4, atol=1e-7)
    for name, parameter in fused_layer.named_parameters():
        torch.testing.assert_close(parameter.grad, dict(plain_layer.named_parameters())[name].grad)
    for name, buffer in fused_layer.named_buffers():
        torch.testing.assert_close(buffer, dict(plain_layer.named_buffers())[name])


def test_dropping_quantizer_matches_the_plain_path():
    torch.manual_seed(2)
    build, shape = LAYERS["stem"]
    layer = build()
    x = torch.randn(shape)
    layer(x)
    layer.weight_fake_quant.disable_observer()
    quantizer = _calibrated(QDropFakeQuantize(quant_min=0, quant_max=255, qscheme=torch.per_tensor_affine), x)
    quantizer.prob = 0.5
    upstream = torch.randn(4, 8, 10, 10)
    torch.manual_seed(3)
    out, fused_quantizer, _ = _run(layer, quantizer, x, upstream, adjoint=True)
    torch.manual_seed(3)
    plain_out, plain_quantizer, _ = _run(layer, quantizer, x, upstream, adjoint=False)
    assert torch.equal(out, plain_out)
    assert not torch.equal(out, layer(x))  # dropping happened and quantization happened
    for name in ("scale", "zero_point"):
        plain = getattr(plain_quantizer, name).grad
        assert plain.abs().sum() > 0
        torch.testing.assert_close(getattr(fused_quantizer, name).grad, plain, rtol=1e-4, atol=1e-7)


def test_plain_path_where_the_weight_gradient_route_does_not_apply():
    torch.manual_seed(4)
    x = torch.randn(2, 3, 8, 8)
    quantizer = _calibrated(QUANTIZERS["lsq_affine"](), x)
    # The input takes a gradient: nothing is attached.
    assert param_tangents(quantizer(x.clone().requires_grad_())) is None
    # Per-channel input quantization: nothing is attached.
    per_channel = LearnableFakeQuantize(quant_min=-128, quant_max=127, qscheme=torch.per_channel_symmetric, ch_axis=1)
    assert param_tangents(_calibrated(per_channel, x)(x)) is None
    # Padding other than zeros, and two parameters with many input channels, take the plain path.
    reflect = nnqat.Conv2d.from_float(nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect"), WEIGHT)
    wide = nnqat.Conv2d.from_float(nn.Conv2d(8, 4, 3), WEIGHT)
    for layer, inputs in ((reflect, x), (wide, torch.randn(2, 8, 8, 8))):
        q = _calibrated(QUANTIZERS["lsq_affine"](), inputs)(inputs)
        assert param_tangents(q) is not None
        out = layer(q)
        assert not _graph_has(out, "_ConvOfQuantizedInputBackward")
    # Without gradients the layer runs as it is.
    with torch.no_grad():
        assert param_tangents(quantizer(x)) is None
