import copy

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from mqbench.fake_quantize import FixedFakeQuantize
from mqbench.nn import qat as nnqat
from mqbench.utils.fusion import (
    fold_bn_into,
    fuse_conv_bn_weights,
    fuse_linear_bn_weights,
    layer_init_kwargs,
    scale_output_channels,
)

# (layer builder, BatchNorm builder, input shape)
LAYERS = {
    "conv1d": (lambda: nn.Conv1d(4, 6, 3, stride=2), nn.BatchNorm1d, (3, 4, 11)),
    "conv2d_grouped_nobias": (
        lambda: nn.Conv2d(4, 6, 3, padding=1, groups=2, bias=False),
        nn.BatchNorm2d,
        (2, 4, 7, 7),
    ),
    "conv2d_reflect": (lambda: nn.Conv2d(3, 5, 3, padding=1, padding_mode="reflect"), nn.BatchNorm2d, (2, 3, 6, 6)),
    "conv3d": (lambda: nn.Conv3d(2, 4, 2), nn.BatchNorm3d, (2, 2, 4, 4, 4)),
    "deconv1d_stride2": (lambda: nn.ConvTranspose1d(4, 6, 3, stride=2), nn.BatchNorm1d, (2, 4, 5)),
    "deconv2d_stride2_groups2": (
        lambda: nn.ConvTranspose2d(4, 6, 3, stride=2, groups=2, output_padding=1),
        nn.BatchNorm2d,
        (2, 4, 5, 5),
    ),
    "deconv2d_groups3_nobias": (
        lambda: nn.ConvTranspose2d(6, 9, 2, groups=3, bias=False),
        nn.BatchNorm2d,
        (2, 6, 4, 4),
    ),
    "deconv3d": (lambda: nn.ConvTranspose3d(2, 4, 2, stride=2), nn.BatchNorm3d, (1, 2, 3, 3, 3)),
    "linear": (lambda: nn.Linear(5, 3), nn.BatchNorm1d, (8, 5)),
}


def build(name, reference, affine=True):
    torch.manual_seed(0)
    make_layer, make_bn, shape = LAYERS[name]
    layer = make_layer().double()
    channels = layer.out_features if isinstance(layer, nn.Linear) else layer.out_channels
    bn = reference.randomize_bn(make_bn(channels, affine=affine).double()).eval()
    return layer, bn, torch.randn(*shape, dtype=torch.float64)


@pytest.mark.parametrize("affine", [True, False], ids=["affine", "no_affine"])
@pytest.mark.parametrize("name", LAYERS)
def test_folded_module_equals_layer_then_bn(name, affine, reference):
    layer, bn, x = build(name, reference, affine)
    expected = bn(layer(x))
    before = copy.deepcopy((layer.state_dict(), bn.state_dict()))
    folded = fold_bn_into(layer, bn)
    assert type(folded) is type(layer)
    assert folded.bias is not None
    torch.testing.assert_close(folded(x), expected, rtol=1e-5, atol=1e-10)
    for key, value in layer.state_dict().items():  # inputs untouched
        assert torch.equal(value, before[0][key])
    for key, value in bn.state_dict().items():
        assert torch.equal(value, before[1][key])


@pytest.mark.parametrize("name", LAYERS)
def test_fuse_weights_match_per_channel_loop(name, reference):
    layer, bn, _ = build(name, reference)
    expected_weight, expected_bias = reference.fold(layer, bn)
    transposed = isinstance(layer, nn.modules.conv._ConvTransposeNd)
    weight, bias = fuse_conv_bn_weights(
        layer.weight, layer.bias, bn.running_mean, bn.running_var, bn.eps, bn.weight, bn.bias, transpose=transposed
    )
    torch.testing.assert_close(weight, expected_weight, rtol=1e-12, atol=0)
    torch.testing.assert_close(bias, expected_bias, rtol=1e-12, atol=1e-15)


def test_fuse_linear_bn_weights_formula(reference):
    layer, bn, _ = build("linear", reference)
    weight, bias = fuse_linear_bn_weights(
        layer.weight, layer.bias, bn.running_mean, bn.running_var, bn.eps, bn.weight, bn.bias
    )
    factor = bn.weight / torch.sqrt(bn.running_var + bn.eps)
    torch.testing.assert_close(weight, layer.weight * factor[:, None])
    torch.testing.assert_close(bias, (layer.bias - bn.running_mean) * factor + bn.bias)


def test_fusion_is_differentiable():
    weight = torch.randn(4, 3, 3, 3, requires_grad=True)
    gamma = torch.rand(4, requires_grad=True)
    beta = torch.randn(4, requires_grad=True)
    folded_weight, folded_bias = fuse_conv_bn_weights(weight, None, torch.zeros(4), torch.ones(4), 1e-5, gamma, beta)
    (folded_weight.sum() + folded_bias.sum()).backward()
    assert all(t.grad is not None and bool(t.grad.abs().sum() > 0) for t in (weight, gamma, beta))


@given(
    groups=st.integers(1, 4),
    in_per_group=st.integers(1, 3),
    out_per_group=st.integers(1, 3),
    kernel=st.integers(1, 3),
)
def test_scale_output_channels_transposed_matches_loop(groups, in_per_group, out_per_group, kernel):
    weight = torch.randn(groups * in_per_group, out_per_group, kernel, kernel, dtype=torch.float64)
    factor = torch.rand(groups * out_per_group, dtype=torch.float64) + 0.5
    expected = weight.clone()
    for channel in range(groups * out_per_group):
        group, j = divmod(channel, out_per_group)
        rows = slice(group * in_per_group, (group + 1) * in_per_group)
        expected[rows, j] *= factor[channel]
    assert torch.equal(scale_output_channels(weight, factor, transpose=True), expected)


def test_scale_output_channels_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="output channels"):
        scale_output_channels(torch.randn(4, 3, 1, 1), torch.ones(5))
    with pytest.raises(ValueError, match="groups"):
        scale_output_channels(torch.randn(5, 2, 1, 1), torch.ones(6), transpose=True)
    with pytest.raises(ValueError, match="1-D"):
        scale_output_channels(torch.randn(4, 3), torch.ones(4, 1))


def test_fold_bn_into_validates_its_inputs():
    conv = nn.Conv2d(3, 4, 1)
    with pytest.raises(ValueError, match="track_running_stats"):
        fold_bn_into(conv, nn.BatchNorm2d(4, track_running_stats=False))
    with pytest.raises(ValueError, match="8 features"):
        fold_bn_into(conv, nn.BatchNorm2d(8))
    with pytest.raises(TypeError, match="supported layers"):
        fold_bn_into(nn.ReLU(), nn.BatchNorm2d(4))
    with pytest.raises(TypeError, match="BatchNorm"):
        fold_bn_into(conv, nn.LayerNorm(4))


def test_fold_bn_into_a_qat_layer_returns_the_plain_float_layer(reference):
    conv, bn, x = build("conv2d_grouped_nobias", reference)
    factory = FixedFakeQuantize.with_args(quant_min=-127, quant_max=127, qscheme=torch.per_tensor_symmetric)
    qat = nnqat.Conv2d.from_float(conv, factory)
    folded = fold_bn_into(qat, bn)
    assert type(folded) is nn.Conv2d
    torch.testing.assert_close(folded(x), bn(conv(x)), rtol=1e-5, atol=1e-10)


def test_layer_init_kwargs_rebuild_the_layer():
    deconv = nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1, groups=2, dilation=1, bias=False)
    rebuilt = nn.ConvTranspose2d(**layer_init_kwargs(deconv))
    assert repr(rebuilt) == repr(deconv)
    linear = nn.Linear(3, 2).double()
    assert nn.Linear(**layer_init_kwargs(linear)).weight.dtype == torch.float64
