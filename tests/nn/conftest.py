"""Reference formulas for the nn tests, written independently of the code under test."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mqbench.fake_quantize import FixedFakeQuantize
from mqbench.observer import MinMaxObserver


def weight_factory(ch_axis=0, per_channel=True, enabled=True):
    """A weight quantizer factory (int8 narrow symmetric); ``enabled=False`` builds it with fake quant off."""
    qscheme = torch.per_channel_symmetric if per_channel else torch.per_tensor_symmetric
    factory = FixedFakeQuantize.with_args(
        observer=MinMaxObserver, quant_min=-127, quant_max=127, qscheme=qscheme, ch_axis=ch_axis
    )
    if enabled:
        return factory

    def disabled():
        quantizer = factory()
        quantizer.disable_fake_quant()
        return quantizer

    return disabled


def fake_quant_reference(weight, quantizer):
    """q = clamp(round(w / s) + z, qmin, qmax); (q - z) * s with the quantizer's own scale and zero point."""
    scale = quantizer.scale.detach().to(weight.dtype)
    zero_point = quantizer.zero_point.detach().to(weight.dtype)
    if quantizer.is_per_channel:
        shape = [1] * weight.dim()
        shape[quantizer.ch_axis] = -1
        scale, zero_point = scale.reshape(shape), zero_point.reshape(shape)
    q = torch.clamp(torch.round(weight / scale) + zero_point, quantizer.quant_min, quantizer.quant_max)
    return (q - zero_point) * scale


def fold_reference(layer, bn):
    """Folded (weight, bias) by an explicit loop over output channels."""
    factor = (bn.weight if bn.affine else torch.ones_like(bn.running_var)) / torch.sqrt(bn.running_var + bn.eps)
    beta = bn.bias if bn.affine else torch.zeros_like(bn.running_mean)
    weight = layer.weight.detach().clone()
    transposed = isinstance(layer, nn.modules.conv._ConvTransposeNd)
    out_channels = bn.num_features
    for channel in range(out_channels):
        if transposed:
            per_group_out = weight.shape[1]
            per_group_in = weight.shape[0] // layer.groups
            group, j = divmod(channel, per_group_out)
            rows = slice(group * per_group_in, (group + 1) * per_group_in)
            weight[rows, j] = weight[rows, j] * factor[channel]
        else:
            weight[channel] = weight[channel] * factor[channel]
    bias = layer.bias.detach() if layer.bias is not None else torch.zeros_like(bn.running_mean)
    return weight, ((bias - bn.running_mean) * factor + beta).detach()


def layer_reference(layer, x, weight, bias):
    """The layer's operation with an explicit weight and bias (zero padding)."""
    if isinstance(layer, nn.Linear):
        return F.linear(x, weight, bias)
    if isinstance(layer, nn.ConvTranspose2d):
        return F.conv_transpose2d(
            x, weight, bias, layer.stride, layer.padding, layer.output_padding, layer.groups, layer.dilation
        )
    conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[weight.dim() - 2]
    return conv(x, weight, bias, layer.stride, layer.padding, layer.dilation, layer.groups)


def randomize_bn(bn, generator=None):
    """Give a BatchNorm random running statistics and affine parameters (as after training)."""
    with torch.no_grad():
        bn.running_mean.copy_(torch.randn(bn.num_features, generator=generator) * 0.5)
        bn.running_var.copy_(torch.rand(bn.num_features, generator=generator) * 1.5 + 0.25)
        if bn.affine:
            bn.weight.copy_(torch.rand(bn.num_features, generator=generator) + 0.5)
            bn.bias.copy_(torch.randn(bn.num_features, generator=generator) * 0.3)
    return bn


@pytest.fixture(autouse=True)
def _single_thread():
    """These tensors are tiny: one intra-op thread avoids OpenMP thrashing on a loaded 2-core machine."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def reference():
    """The reference helpers as one namespace."""

    class Reference:
        weight_factory = staticmethod(weight_factory)
        fake_quant = staticmethod(fake_quant_reference)
        fold = staticmethod(fold_reference)
        layer = staticmethod(layer_reference)
        randomize_bn = staticmethod(randomize_bn)

    return Reference
