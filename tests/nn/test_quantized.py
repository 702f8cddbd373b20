"""Integer reference modules (mqbench.nn.quantized) against formulas written here and the fake-quant simulation."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mqbench.deploy import reference
from mqbench.deploy.table import TensorQParams
from mqbench.functional import fake_quantize
from mqbench.nn import intrinsic as nni
from mqbench.nn import quantized as nnq
from mqbench.nn.quantized import functional as QF
from mqbench.prepare_by_platform import prepare_by_platform
from mqbench.utils.state import enable_calibration, enable_quantization


# -- parameters and independent formulas -----------------------------------------------------------
def grid(low, high, quant_min, quant_max, axis=None, kind="activation"):
    """Asymmetric parameters covering [low, high] (arrays per channel), zero included."""
    low, high = np.minimum(np.asarray(low, np.float64), 0.0), np.maximum(np.asarray(high, np.float64), 0.0)
    scale = np.maximum((high - low) / (quant_max - quant_min), 1e-6).astype(np.float32)
    zero_point = np.clip(quant_min - np.round(low / scale), quant_min, quant_max)
    return TensorQParams(scale.reshape(-1), zero_point.reshape(-1), quant_min, quant_max, axis, kind=kind)


def symmetric(amax, axis=None):
    """int8 narrow symmetric weight parameters (per channel when ``amax`` is an array)."""
    scale = (np.asarray(amax, np.float64) / 127).astype(np.float32).reshape(-1)
    return TensorQParams(scale, np.zeros(scale.size), -127, 127, axis, kind="weight")


def torch_params(qparams):
    """(scale, zero_point) tensors of ``qparams`` for mqbench.functional.fake_quantize."""
    return torch.from_numpy(qparams.scale.copy()), torch.from_numpy(qparams.zero_point.copy())


def fq(x, qparams):
    scale, zero_point = torch_params(qparams)
    return fake_quantize(x, scale, zero_point, qparams.quant_min, qparams.quant_max, qparams.axis)


def shaped(values, axis, ndim):
    shape = [1] * ndim
    shape[axis] = -1
    return torch.as_tensor(values).reshape(shape)


def quantize_ref(x, qparams, axis=None):
    """clamp(round_half_even(x / s) + z) in float32 torch, as int64."""
    scale = torch.from_numpy(qparams.scale.copy())
    zero = torch.from_numpy(qparams.zero_point.copy()).to(torch.int64)
    if axis is not None:
        scale, zero = shaped(scale, axis, x.dim()), shaped(zero, axis, x.dim())
    q = torch.round(x.float() / scale).to(torch.int64) + zero
    return q.clamp(qparams.quant_min, qparams.quant_max)


def fixed_point_ref(ratio):
    """(m0, n) with 2**30 <= m0 < 2**31 and m0 / 2**n the nearest such value to ``ratio`` (exact rationals)."""
    exact = Fraction(float(ratio))
    n = 30 - math.floor(math.log2(exact))
    while exact * 2**n < 2**30:
        n += 1
    while exact * 2**n >= 2**31:
        n -= 1
    m0 = round(exact * 2**n)
    return (2**30, n - 1) if m0 == 2**31 else (m0, n)


def shift_round_ref(value, m0, n, rounding="half_up"):
    """value * m0 / 2**n rounded to an integer (exact rationals); ties by ``rounding``."""
    exact = Fraction(int(value) * m0, 2**n)
    if rounding == "half_even":
        return round(exact)  # Python rounds a Fraction half to even
    if rounding == "half_away":
        return int(math.copysign(math.floor(abs(exact) + Fraction(1, 2)), exact))
    return math.floor(exact + Fraction(1, 2))


def requantize_ref(acc, ratios, zero_point, low, high, rounding="half_up"):
    """Output integers of int64 accumulators ``acc`` with one ratio per channel on axis ``1`` (or one)."""
    out = torch.empty_like(acc)
    flat_acc, flat_out = acc.reshape(acc.shape[0], acc.shape[1], -1), out.reshape(acc.shape[0], acc.shape[1], -1)
    for channel in range(acc.shape[1]):
        m0, n = fixed_point_ref(ratios[channel] if len(ratios) > 1 else ratios[0])
        for i, j in itertools.product(range(acc.shape[0]), range(flat_acc.shape[2])):
            y = shift_round_ref(flat_acc[i, channel, j], m0, n, rounding) + zero_point
            flat_out[i, channel, j] = min(max(y, low), high)
    return flat_out.reshape(acc.shape)


def conv_ref(x, w, stride, padding, dilation, groups):
    """int64 convolution: one einsum per kernel offset and group over the zero-padded input."""
    dims = w.dim() - 2
    x = F.pad(x, [p for pad in reversed(padding) for p in (pad, pad)])
    kernel = w.shape[2:]
    out_size = [(x.shape[2 + i] - dilation[i] * (kernel[i] - 1) - 1) // stride[i] + 1 for i in range(dims)]
    out = torch.zeros(x.shape[0], w.shape[0], *out_size, dtype=torch.int64)
    cin, cout = w.shape[1], w.shape[0] // groups
    letters = "hwd"[:dims]
    for offset in itertools.product(*[range(k) for k in kernel]):
        index = tuple(
            slice(o * d, o * d + s * (n - 1) + 1, s)
            for o, d, s, n in zip(offset, dilation, stride, out_size, strict=True)
        )
        for g in range(groups):
            patch = x[(slice(None), slice(g * cin, (g + 1) * cin), *index)]
            taps = w[(slice(g * cout, (g + 1) * cout), slice(None), *offset)]
            out[:, g * cout : (g + 1) * cout] += torch.einsum(f"nc{letters},oc->no{letters}", patch, taps)
    return out


def conv_transpose2d_ref(x, w, stride, padding, output_padding, dilation, groups):
    """int64 transposed convolution by scattering each kernel tap."""
    n, cin, h, width = x.shape
    kh, kw = w.shape[2:]
    cout = w.shape[1]
    full = [(h - 1) * stride[0] + dilation[0] * (kh - 1) + 1 + output_padding[0]]
    full.append((width - 1) * stride[1] + dilation[1] * (kw - 1) + 1 + output_padding[1])
    buffer = torch.zeros(n, cout * groups, *full, dtype=torch.int64)
    per_group = cin // groups
    for g, i, j in itertools.product(range(groups), range(kh), range(kw)):
        part = torch.einsum(
            "nchw,co->nohw", x[:, g * per_group : (g + 1) * per_group], w[g * per_group : (g + 1) * per_group, :, i, j]
        )
        rows = slice(i * dilation[0], i * dilation[0] + stride[0] * (h - 1) + 1, stride[0])
        cols = slice(j * dilation[1], j * dilation[1] + stride[1] * (width - 1) + 1, stride[1])
        buffer[:, g * cout : (g + 1) * cout, rows, cols] += part
    out_h = (h - 1) * stride[0] - 2 * padding[0] + dilation[0] * (kh - 1) + output_padding[0] + 1
    out_w = (width - 1) * stride[1] - 2 * padding[1] + dilation[1] * (kw - 1) + output_padding[1] + 1
    return buffer[:, :, padding[0] : padding[0] + out_h, padding[1] : padding[1] + out_w]


# -- the layers under test -------------------------------------------------------------------------
# name: (float module builder, quantized class, input shape, per-channel weights)
LAYERS = {
    "Linear": (lambda: nn.Linear(24, 7), nnq.Linear, (64, 24), False),
    "Linear_per_channel": (lambda: nn.Linear(24, 7), nnq.Linear, (8, 8, 24), True),
    "LinearReLU": (lambda: nni.LinearReLU(nn.Linear(16, 6), nn.ReLU()), nnq.LinearReLU, (64, 16), True),
    "Conv2d": (
        lambda: nn.Conv2d(4, 6, 3, stride=2, padding=1, dilation=2, groups=2),
        nnq.Conv2d,
        (3, 4, 11, 9),
        True,
    ),
    "Conv2d_per_tensor_nobias": (lambda: nn.Conv2d(3, 5, (3, 2), bias=False), nnq.Conv2d, (2, 3, 8, 7), False),
    "ConvReLU2d_relu6": (
        lambda: nni.ConvReLU2d(nn.Conv2d(3, 4, 3, padding="same"), nn.ReLU6()),
        nnq.ConvReLU2d,
        (2, 3, 8, 8),
        True,
    ),
    "Conv1d": (lambda: nn.Conv1d(3, 4, 3, stride=2, padding=2), nnq.Conv1d, (4, 3, 21), True),
    "ConvReLU1d": (lambda: nni.ConvReLU1d(nn.Conv1d(2, 4, 2), nn.ReLU()), nnq.ConvReLU1d, (4, 2, 16), False),
    "Conv3d": (lambda: nn.Conv3d(2, 4, 2, stride=(1, 2, 1), padding=1), nnq.Conv3d, (2, 2, 4, 5, 4), True),
    "ConvReLU3d": (lambda: nni.ConvReLU3d(nn.Conv3d(2, 3, 2), nn.ReLU()), nnq.ConvReLU3d, (2, 2, 4, 4, 4), False),
    "ConvTranspose2d": (
        lambda: nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1, groups=2, dilation=1),
        nnq.ConvTranspose2d,
        (2, 4, 5, 6),
        True,
    ),
    "ConvTranspose2d_dilated": (
        lambda: nn.ConvTranspose2d(3, 4, 2, stride=(1, 2), padding=(1, 0), dilation=2),
        nnq.ConvTranspose2d,
        (2, 3, 5, 4),
        False,
    ),
    "ConvTransposeReLU2d": (
        lambda: nni.ConvTransposeReLU2d(nn.ConvTranspose2d(3, 4, 3, stride=2), nn.ReLU()),
        nnq.ConvTransposeReLU2d,
        (2, 3, 4, 4),
        True,
    ),
}


def layer_of(module):
    return module[0] if isinstance(module, nni.FusedModule) else module


def activation_of(module):
    return module[-1] if isinstance(module, nni.FusedModule) else None


def float_op(layer, x, weight, bias):
    """The float layer's operation with an explicit weight and bias."""
    if isinstance(layer, nn.Linear):
        return F.linear(x, weight, bias)
    if isinstance(layer, nn.ConvTranspose2d):
        return F.conv_transpose2d(
            x, weight, bias, layer.stride, layer.padding, layer.output_padding, layer.groups, layer.dilation
        )
    conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[weight.dim() - 2]
    return conv(x, weight, bias, layer.stride, layer.padding, layer.dilation, layer.groups)


def build(name, seed=0):
    """(float module, quantized module, float input, input/weight/output qparams) of a case."""
    torch.manual_seed(seed)
    make, cls, shape, per_channel = LAYERS[name]
    module = make().eval()
    layer = layer_of(module)
    with torch.no_grad():
        if layer.bias is not None:
            layer.bias.uniform_(-0.3, 0.3)
    x = torch.randn(*shape) * 1.5 + 0.3
    x_q = grid(x.min().item(), x.max().item(), 0, 255)
    weight = layer.weight.detach()
    axis = 1 if isinstance(layer, nn.ConvTranspose2d) else 0
    if per_channel:
        dims = [d for d in range(weight.dim()) if d != axis]
        w_q = symmetric(weight.abs().amax(dim=dims).numpy(), axis=axis)
    else:
        w_q = grid(weight.min().item(), weight.max().item(), 0, 255, kind="weight")
    with torch.no_grad():
        y = module(x)
    y_q = grid(y.min().item(), y.max().item(), -128, 127)
    return module, cls.from_float(module, x_q, w_q, y_q), x, (x_q, w_q, y_q)


@pytest.mark.parametrize("name", LAYERS)
def test_layer_integers_match_independent_formulas(name):
    module, q, x, (x_q, w_q, y_q) = build(name)
    layer = layer_of(module)
    transposed = isinstance(layer, nn.ConvTranspose2d)
    w_int = quantize_ref(layer.weight.detach(), w_q, None if w_q.axis is None else (1 if transposed else 0))
    assert torch.equal(q.weight_int.to(torch.int64), w_int)
    assert q.weight_int.dtype == (torch.int8 if w_q.quant_min < 0 else torch.uint8)
    # the accumulator scale per output channel (a per-channel transposed weight repeats per group)
    w_scale = w_q.scale.astype(np.float64)
    if w_scale.size > 1 and w_scale.size != q.out_channels:
        w_scale = np.tile(w_scale, q.out_channels // w_scale.size)
    acc_scale = float(x_q.scale[0]) * w_scale
    if layer.bias is not None:
        bias = layer.bias.detach().double().numpy()
        expected_bias = [
            round(Fraction(float(b)) / Fraction(float(s)))
            for b, s in zip(bias, np.broadcast_to(acc_scale, bias.shape), strict=True)
        ]
        assert q.bias_int.dtype == torch.int32 and q.bias_int.tolist() == expected_bias
    else:
        assert q.bias_int is None

    x_int = torch.randint(x_q.quant_min, x_q.quant_max + 1, x.shape)
    xc = x_int - int(x_q.zero_point[0])
    wc = w_int - (
        shaped(torch.from_numpy(w_q.zero_point.astype(np.int64)), 1 if transposed else 0, w_int.dim())
        if w_q.axis is not None
        else int(w_q.zero_point[0])
    )
    if isinstance(layer, nn.Linear):
        acc = torch.einsum("...i,oi->...o", xc, wc).reshape(-1, q.out_channels, 1)
    elif transposed:
        acc = conv_transpose2d_ref(
            xc, wc, layer.stride, layer.padding, layer.output_padding, layer.dilation, layer.groups
        )
    else:
        padding = layer.padding
        if padding == "same":
            padding = tuple(d * (k - 1) // 2 for k, d in zip(layer.kernel_size, layer.dilation, strict=True))
        acc = conv_ref(xc, wc, layer.stride, padding, layer.dilation, layer.groups)
    if layer.bias is not None:
        acc = acc + shaped(torch.tensor(expected_bias), 1, acc.dim())
    ratios = acc_scale / float(y_q.scale[0])
    low, high = y_q.quant_min, y_q.quant_max
    zero = int(y_q.zero_point[0])
    activation = activation_of(module)
    if activation is not None:
        low = zero
        if isinstance(activation, nn.ReLU6):
            high = min(high, round(float(np.float32(6.0) / y_q.scale[0])) + zero)  # float32 division
    expected = requantize_ref(acc, np.atleast_1d(ratios), zero, low, high)
    got, got_acc = q.forward_integer(x_int), q.accumulate(x_int)
    if isinstance(layer, nn.Linear):
        got, got_acc = got.reshape(-1, q.out_channels, 1), got_acc.reshape(-1, q.out_channels, 1)
    assert got.dtype == got_acc.dtype == torch.int64
    assert torch.equal(got_acc, acc)
    assert torch.equal(got, expected)
    # the stored fixed-point multipliers approximate the real ratios within 2**-31
    real = np.broadcast_to(ratios, q.multiplier.shape)
    approx = q.multiplier.double().numpy() * 2.0 ** -q.shift.double().numpy()
    assert np.all(np.abs(approx / real - 1) <= 2.0**-31)


def lsb_errors(module, q, x, qparams):
    """|module output - fake-quant simulation| in output LSB, elementwise."""
    x_q, w_q, y_q = qparams
    layer = layer_of(module)
    with torch.no_grad():
        weight = fq(layer.weight, w_q)
        y = float_op(layer, fq(x, x_q), weight, layer.bias)
        if activation_of(module) is not None:
            y = activation_of(module)(y)
        simulated = fq(y, y_q)
    return ((q(x) - simulated).abs() / float(y_q.scale[0])).round().flatten()


def report(name, lsb):
    """Print and check the parity: at most 1 LSB apart, at least 99 % identical."""
    exact = float((lsb == 0).double().mean())
    print(f"{name}: {lsb.numel()} values, max {float(lsb.max()):.0f} LSB, {100 * exact:.3f} % exact")
    assert lsb.max() <= 1, name
    assert exact >= 0.99, name


@pytest.mark.parametrize("name", LAYERS)
def test_layer_output_equals_the_fake_quant_simulation_within_one_lsb(name):
    report(name, torch.cat([lsb_errors(*build(name, seed)) for seed in range(3)]))


def conv_relu_model():
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5)).eval(), False


def conv_bn_relu6_model():
    """Prepared in training mode (so the BatchNorm is folded by the QAT module), then evaluated."""
    bn = nn.BatchNorm2d(4)
    with torch.no_grad():
        bn.running_mean.uniform_(-0.5, 0.5), bn.running_var.uniform_(0.5, 2.0)
        bn.weight.uniform_(0.5, 1.5), bn.bias.uniform_(-0.2, 0.2)
    return nn.Sequential(nn.Conv2d(3, 4, 3), bn, nn.ReLU6(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5)).train(), True


@pytest.mark.parametrize("make_model", [conv_relu_model, conv_bn_relu6_model])
def test_from_observed_matches_a_prepared_model(make_model):
    torch.manual_seed(0)
    model, folds_bn = make_model()
    prepared = prepare_by_platform(model, "snpe").eval()
    enable_calibration(prepared)
    with torch.no_grad():
        for _ in range(4):
            prepared(torch.randn(8, 3, 8, 8))
    enable_quantization(prepared)
    layers = [m for m in prepared.children() if hasattr(m, "weight_fake_quant")]
    conv, linear = layers
    assert hasattr(conv, "bn") == folds_bn
    quantizers = [m for n, m in prepared.named_children() if n.endswith("post_act_fake_quantizer")]
    assert len(quantizers) == 3  # input, after conv + relu (+ flatten), after linear
    q_conv = nnq.ConvReLU2d.from_observed(conv, quantizers[0], quantizers[1])
    q_linear = nnq.Linear.from_observed(linear, quantizers[1], quantizers[2])
    assert (q_conv.relu_max == 6.0) == folds_bn
    captured = {}
    hooks = [q.register_forward_hook(lambda m, i, o, k=k: captured.__setitem__(k, o)) for k, q in enumerate(quantizers)]
    x = torch.randn(64, 3, 8, 8)
    with torch.no_grad():
        simulated = prepared(x)
    for hook in hooks:
        hook.remove()
    for name, q, given, expected in (("conv", q_conv, x, captured[1]), ("linear", q_linear, captured[1], captured[2])):
        out = q(given).reshape(expected.shape)
        report(f"{make_model.__name__} {name}", ((out - expected).abs() / q.scale).round().flatten())
    if not folds_bn:
        scale, zero_point = conv.weight_fake_quant.export_qparams()
        w_q = TensorQParams(scale.detach().numpy(), zero_point.numpy(), 0, 255, kind="weight")
        assert torch.equal(q_conv.weight_int.to(torch.int64), quantize_ref(conv.weight.detach(), w_q))
    with torch.no_grad():  # chained, the integer model stays close to the simulation end to end
        chained = q_linear(q_conv(x).flatten(1))
    assert ((chained - simulated).abs() / q_linear.scale).max() <= 2


# -- Add / Mul / Cat -------------------------------------------------------------------------------
A_Q = TensorQParams(np.array([0.037]), np.array([121]), 0, 255)
B_Q = TensorQParams(np.array([0.0213]), np.array([-7]), -128, 127)
OUT_Q = TensorQParams(np.array([0.051]), np.array([90]), 0, 255)


def integers(qparams, shape, seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(qparams.quant_min, qparams.quant_max + 1, shape, generator=generator)


def clamp(value, low, high):
    return min(max(value, low), high)


@pytest.mark.parametrize("relu", [False, True])
def test_add_integers_match_the_fixed_point_formula(relu):
    add = nnq.Add(A_Q, B_Q, OUT_Q, relu=relu)
    a, b = integers(A_Q, (40, 5), 1), integers(B_Q, (5,), 2)  # broadcasting
    got = add.forward_integer(a, b)
    sa, sb, so = (float(p.scale[0]) for p in (A_Q, B_Q, OUT_Q))
    base = 2 * max(sa, sb)
    (ma, na), (mb, nb) = fixed_point_ref(sa / base), fixed_point_ref(sb / base)
    mo, no = fixed_point_ref(base * 2.0**-20 / so)
    low = 90 if relu else 0
    for (i, j), value in np.ndenumerate(got.numpy()):
        ta = shift_round_ref((int(a[i, j]) - 121) << 20, ma, na)
        tb = shift_round_ref((int(b[j]) + 7) << 20, mb, nb)
        assert value == clamp(shift_round_ref(ta + tb, mo, no) + 90, low, 255)
        # and within half an LSB (plus the fixed point's tiny error) of the exact sum
        exact = ((int(a[i, j]) - 121) * Fraction(sa) + (int(b[j]) + 7) * Fraction(sb)) / Fraction(so) + 90
        assert abs(value - clamp(exact, low, 255)) <= 0.5 + 1e-4


def test_mul_integers_match_the_fixed_point_formula():
    mul = nnq.Mul(A_Q, B_Q, OUT_Q)
    a, b = integers(A_Q, (300,), 3), integers(B_Q, (300,), 4)
    m0, n = fixed_point_ref(float(A_Q.scale[0]) * float(B_Q.scale[0]) / float(OUT_Q.scale[0]))
    expected = [
        clamp(shift_round_ref((int(x) - 121) * (int(y) + 7), m0, n) + 90, 0, 255) for x, y in zip(a, b, strict=True)
    ]
    assert mul.forward_integer(a, b).tolist() == expected


def test_cat_integers_match_the_rescale_formula():
    same = TensorQParams(OUT_Q.scale, OUT_Q.zero_point, 0, 255)
    cat = nnq.Cat([A_Q, same, B_Q], OUT_Q, dim=1)
    parts = [integers(A_Q, (3, 4), 5), integers(same, (3, 2), 6), integers(B_Q, (3, 5), 7)]
    got = cat.forward_integer(parts)
    assert got.shape == (3, 11)
    assert torch.equal(got[:, 4:6], parts[1])  # the output's own grid passes unchanged
    for part, qparams, columns in ((parts[0], A_Q, slice(0, 4)), (parts[2], B_Q, slice(6, 11))):
        m0, n = fixed_point_ref(float(qparams.scale[0]) / float(OUT_Q.scale[0]))
        zero = int(qparams.zero_point[0])
        expected = [[clamp(shift_round_ref(int(v) - zero, m0, n) + 90, 0, 255) for v in row] for row in part]
        assert got[:, columns].tolist() == expected


def test_elementwise_outputs_equal_the_fake_quant_simulation_within_one_lsb():
    torch.manual_seed(0)
    a, b = torch.randn(64, 50) * 2 + 1, torch.randn(64, 50) * 1.3
    a_q, b_q = grid(a.min().item(), a.max().item(), 0, 255), grid(b.min().item(), b.max().item(), -128, 127)
    cases = {
        "Add": (nnq.Add(a_q, b_q, grid(-4, 9, 0, 255)), lambda x, y: x + y, (a, b)),
        "AddReLU": (nnq.Add(a_q, b_q, grid(0, 9, 0, 255), relu=True), lambda x, y: torch.relu(x + y), (a, b)),
        "Mul": (nnq.Mul(a_q, b_q, grid(-12, 12, -128, 127)), lambda x, y: x * y, (a, b)),
        "Cat": (nnq.Cat([a_q, b_q], grid(-5, 8, 0, 255), dim=1), lambda x, y: torch.cat([x, y], 1), ([a, b],)),
    }
    for name, (module, op, args) in cases.items():
        simulated = fq(op(fq(a, a_q), fq(b, b_q)), module.output_qparams)
        report(name, ((module(*args) - simulated).abs() / module.scale).round().flatten())


# -- repr, sharing, errors -------------------------------------------------------------------------
def test_repr_shows_the_layer_and_the_output_grid():
    _, q, _, (_, _, y_q) = build("Conv2d")
    text = repr(q)
    assert text.startswith("Conv2d(4, 6, kernel_size=(3, 3), stride=(2, 2), padding=(1, 1), dilation=(2, 2)")
    assert f"scale={float(y_q.scale[0])}" in text and f"zero_point={int(y_q.zero_point[0])}" in text
    linear = repr(build("Linear")[1])
    assert linear.startswith("Linear(in_features=24, out_features=7, bias=True, scale=") and "zero_point=" in linear
    assert "scale=0.05" in repr(nnq.Cat([A_Q], OUT_Q)) and "zero_point=90" in repr(nnq.Add(A_Q, B_Q, OUT_Q))


def test_reference_executor_uses_the_shared_kernels():
    assert reference.requantize is QF.requantize
    assert reference.requantize_multiplier is QF.requantize_multiplier
    assert reference.ROUNDINGS == QF.ROUNDINGS and reference.ADD_FRACTION_BITS == QF.ADD_FRACTION_BITS


@pytest.mark.parametrize("rounding", QF.ROUNDINGS)
def test_rounding_is_a_parameter(rounding):
    """Power-of-two scales make exact ties common: each rule settles them its own way."""
    one, two = (TensorQParams(np.array([s]), np.array([0]), -128, 127) for s in (1.0, 2.0))
    cat = nnq.Cat([one], two, rounding=rounding)
    got = cat.forward_integer([torch.tensor([-3, -1, 1, 3])]).tolist()
    assert got == {"half_up": [-1, 0, 1, 2], "half_even": [-2, 0, 0, 2], "half_away": [-2, -1, 1, 2]}[rounding]
    # Linear: accumulator scale 2**-8, output scale 2**-5, so the shift drops 3 exact bits
    x_q = TensorQParams(np.array([2.0**-4]), np.array([3]), 0, 255)
    w_q = TensorQParams(np.array([2.0**-4]), np.array([0]), -127, 127, kind="weight")
    y_q = TensorQParams(np.array([2.0**-5]), np.array([-2]), -128, 127)
    torch.manual_seed(0)
    layer = nn.Linear(6, 5)
    q = nnq.Linear.from_float(layer, x_q, w_q, y_q, rounding=rounding)
    x_int = torch.randint(0, 256, (40, 6))
    acc = q.accumulate(x_int)
    expected = requantize_ref(acc.reshape(40, 5, 1), [2.0**-3], -2, -128, 127, rounding).reshape(40, 5)
    assert torch.equal(q.forward_integer(x_int), expected)
    ties = int((acc % 8 == 4).sum())
    assert ties > 10  # the case exercises the rule
    # Add: scales 2**-2 and 2**-1 to 2**-1: a / 2 + b, a tie for every odd a
    add_a, add_b = (TensorQParams(np.array([s]), np.array([0]), -128, 127) for s in (0.25, 0.5))
    add = nnq.Add(add_a, add_b, add_b, rounding=rounding)
    a, b = torch.arange(-9, 10), torch.arange(19) - 9
    exact = [Fraction(int(u), 2) + int(v) for u, v in zip(a, b, strict=True)]
    want = [shift_round_ref(int(e * 2), 1, 1, rounding) for e in exact]  # e * 2 / 2, rounded by the rule
    assert add.forward_integer(a, b).tolist() == want


def test_unbatched_conv_input_and_float_dtype():
    _, q, x, _ = build("Conv2d_per_tensor_nobias")
    assert torch.equal(q(x[0]), q(x)[0])
    assert q(x.double()).dtype == torch.float64


def test_clear_errors():
    x_q = TensorQParams(np.array([0.1]), np.array([0]), -128, 127)
    w_q = TensorQParams(np.full(4, 0.01), np.zeros(4), -127, 127, axis=0, kind="weight")
    per_channel_out = TensorQParams(np.full(4, 0.1), np.zeros(4), -128, 127, axis=1)
    with pytest.raises(ValueError, match="per tensor"):
        nnq.Conv2d.from_float(nn.Conv2d(3, 4, 3), x_q, w_q, per_channel_out)
    with pytest.raises(ValueError, match="per tensor"):
        nnq.Add(per_channel_out, x_q, x_q)
    with pytest.raises(ValueError, match="channels"):
        nnq.Conv2d.from_float(nn.Conv2d(3, 5, 3), x_q, w_q, x_q)
    with pytest.raises(ValueError, match="axis 0"):
        nnq.Linear.from_float(nn.Linear(4, 4), x_q, w_q.with_changes(axis=1), x_q)
    with pytest.raises(ValueError, match="weight_fake_quant"):
        nnq.Conv2d.from_observed(nn.Conv2d(3, 4, 3), nn.Identity(), nn.Identity())
    with pytest.raises(ValueError, match="rounding"):
        nnq.Add(x_q, x_q, x_q, rounding="nearest")
    big = nn.Linear(2, 4)
    nn.init.constant_(big.bias, 1e6)
    with pytest.raises(ValueError, match="int32"):
        nnq.Linear.from_float(big, TensorQParams(np.array([1e-4]), np.array([0]), -128, 127), w_q, x_q)
    with pytest.raises(TypeError, match="ReLU"):
        nnq.ConvReLU2d.from_float(nn.Conv2d(3, 4, 3), x_q, w_q, x_q)
    with pytest.raises(TypeError, match="ReLU variant"):
        nnq.Conv2d.from_float(nni.ConvReLU2d(nn.Conv2d(3, 4, 3), nn.ReLU()), x_q, w_q, x_q)
    q = nnq.Linear.from_float(nn.Linear(3, 4), x_q, w_q, x_q)
    with pytest.raises(ValueError, match="integer tensors"):
        q.forward_integer(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="outside"):
        q.forward_integer(torch.full((2, 3), 200))
    with pytest.raises(ValueError, match="export_qparams"):
        nnq.Add.from_observed(nn.Identity(), nn.Identity(), nn.Identity())


def test_one_lookup_gives_the_integer_layer_of_float_fused_and_qat_layers():
    """convert_fx and the BackendConfig read-back both lower through nnq.integer_module_for."""
    from torch import nn as tnn

    from mqbench.nn import intrinsic as nni
    from mqbench.nn import quantized as nnq
    from mqbench.nn.intrinsic import qat as nniqat
    from mqbench.nn.qat import modules as nnqat

    expected = {
        tnn.Conv2d: nnq.Conv2d,
        tnn.Linear: nnq.Linear,
        tnn.ConvTranspose2d: nnq.ConvTranspose2d,
        nni.ConvBnReLU2d: nnq.ConvReLU2d,
        nni.LinearReLU: nnq.LinearReLU,
        nnqat.Conv1d: nnq.Conv1d,
        nnqat.ConvTranspose2d: nnq.ConvTranspose2d,
        nniqat.ConvReLU3d: nnq.ConvReLU3d,
        nniqat.LinearReLU: nnq.LinearReLU,
        nniqat.ConvTransposeReLU2d: nnq.ConvTransposeReLU2d,
        nniqat.ConvBnReLU2d: None,  # BatchNorm is merged first
        tnn.ConvTranspose1d: None,  # no integer layer
    }
    assert {cls: nnq.integer_module_for(cls) for cls in expected} == expected
