"""Cross-layer equalization and bias correction against formulas written here."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mqbench.advanced_ptq import (
    bias_correction,
    cross_layer_equalization,
    fast_bias_correction,
    recording_input_means,
)
from mqbench.prepare_by_platform import prepare_by_platform
from mqbench.utils.state import disable_all, enable_calibration, enable_quantization

W4_PER_TENSOR = {
    "extra_qconfig_dict": {
        "w_qscheme": {"bit": 4, "per_channel": False},
    }
}


class Pair(nn.Module):
    def __init__(self, depthwise: bool, activation: type[nn.Module] = nn.ReLU, second: nn.Module | None = None) -> None:
        super().__init__()
        self.first = nn.Conv2d(3, 8, 3, padding=1)
        self.act = activation()
        self.second = nn.Conv2d(8, 8, 3, padding=1, groups=8) if depthwise else nn.Conv2d(8, 5, 1)
        if second is not None:
            self.second = second
        with torch.no_grad():  # channels of very different ranges
            self.first.weight.mul_(torch.logspace(-1, 1, 8).reshape(8, 1, 1, 1))

    def forward(self, x):
        return self.second(self.act(self.first(x)))


def input_ranges(conv: nn.Conv2d) -> torch.Tensor:
    w = conv.weight.detach()
    if conv.groups == 1:
        return w.abs().amax(dim=(0, 2, 3))
    return w.abs().amax(dim=(1, 2, 3))


@pytest.mark.parametrize("depthwise", [False, True])
def test_equalization_keeps_the_float_function_and_equalizes_the_ranges(depthwise):
    torch.manual_seed(0)
    model = Pair(depthwise).eval()
    qmodel = prepare_by_platform(model, "tensorrt")
    disable_all(qmodel)
    x = torch.randn(4, 3, 8, 8)
    before = qmodel(x)
    first, second = qmodel.get_submodule("first"), qmodel.get_submodule("second")
    r1 = first.weight.detach().abs().amax(dim=(1, 2, 3))
    r2 = input_ranges(second)
    assert cross_layer_equalization(qmodel) == [("first", "second")]
    torch.testing.assert_close(qmodel(x), before, rtol=1e-5, atol=1e-5)
    expected = torch.sqrt(r1 * r2)  # both ranges become sqrt(r1 r2)
    torch.testing.assert_close(first.weight.detach().abs().amax(dim=(1, 2, 3)), expected, rtol=1e-5, atol=0)
    torch.testing.assert_close(input_ranges(second), expected, rtol=1e-5, atol=0)


def test_equalization_skips_activations_that_do_not_commute_with_scaling():
    model = Pair(depthwise=False, activation=nn.ReLU6).eval()
    assert cross_layer_equalization(prepare_by_platform(model, "tensorrt")) == []


def calibrated(model, images):
    qmodel = prepare_by_platform(model, "tensorrt", W4_PER_TENSOR)
    enable_calibration(qmodel)
    with torch.no_grad():
        qmodel(images)
    enable_quantization(qmodel)
    return qmodel


def test_equalization_before_calibration_lowers_the_per_tensor_error():
    torch.manual_seed(0)
    model = Pair(depthwise=False).eval()
    images, held_out = torch.randn(64, 3, 8, 8), torch.randn(64, 3, 8, 8)
    plain = calibrated(model, images)
    equalized = prepare_by_platform(model, "tensorrt", W4_PER_TENSOR)
    cross_layer_equalization(equalized)
    enable_calibration(equalized)
    with torch.no_grad():
        equalized(images)
    enable_quantization(equalized)
    with torch.no_grad():
        reference = model(held_out)
        errors = [float((m(held_out) - reference).pow(2).mean()) for m in (plain, equalized)]
    assert errors[1] < errors[0], errors


SECONDS = {  # the second layer: zero-padded ones are corrected from their input's per-tap sums, the others by a pass
    "1x1": lambda: nn.Conv2d(8, 5, 1),
    "1x1-grouped": lambda: nn.Conv2d(8, 6, 1, groups=2),
    "1x1-stride-2": lambda: nn.Conv2d(8, 5, 1, stride=2),
    "1x1-padded": lambda: nn.Conv2d(8, 5, 1, padding=1),
    "depthwise-3x3": lambda: nn.Conv2d(8, 8, 3, padding=1, groups=8),
    "3x3-stride-2": lambda: nn.Conv2d(8, 5, 3, stride=2, padding=1),
    "3x2-dilated-uneven-padding": lambda: nn.Conv2d(8, 5, (3, 2), padding=(2, 0), dilation=(2, 1)),
    "5x5-stride-3": lambda: nn.Conv2d(8, 6, 5, stride=3, padding=2, groups=2),
    "valid-padding": lambda: nn.Conv2d(8, 5, 3, padding="valid"),
    "same-padding": lambda: nn.Conv2d(8, 5, 4, padding="same"),  # asymmetric: one pass of the layer
    "reflect-padding": lambda: nn.Conv2d(8, 5, 3, padding=1, padding_mode="reflect"),  # one pass too
}


@pytest.mark.parametrize("second", list(SECONDS))
def test_bias_correction_removes_each_layers_mean_error(second):
    torch.manual_seed(0)
    model = Pair(depthwise=False, second=SECONDS[second]()).eval()
    with torch.no_grad():
        model.first.weight.add_(0.02)  # a shared offset the 4-bit grid rounds one way
    images = [torch.randn(32, 3, 8, 8) + 0.5 for _ in range(4)]
    qmodel = calibrated(model, torch.cat(images))
    original = {name: qmodel.get_submodule(name).bias.detach().clone() for name in ("first", "second")}
    corrections = bias_correction(qmodel, images)
    assert set(corrections) == {"first", "second"} and max(corrections.values()) > 0
    # the mean pre-activation error per channel, measured here with the layers' own inputs
    inputs: dict[str, list[torch.Tensor]] = {"first": [], "second": []}
    for name in inputs:
        qmodel.get_submodule(name).register_forward_pre_hook(lambda m, a, name=name: inputs[name].append(a[0]))
    with torch.no_grad():
        for batch in images:
            qmodel(batch)
        for name, xs in inputs.items():
            conv = qmodel.get_submodule(name)
            x = torch.cat(xs)
            quantized = nn.Conv2d._conv_forward(conv, x, conv.weight_fake_quant(conv.weight), conv.bias)
            full = nn.Conv2d._conv_forward(conv, x, conv.weight, original[name])
            mean_error = (quantized - full).mean(dim=(0, 2, 3))
            typical = float((quantized - full).abs().mean())
            assert float(mean_error.abs().max()) < 1e-5 * max(1.0, typical), name  # float32 sums of 2048 values


@pytest.mark.parametrize("second", list(SECONDS))
def test_tap_sums_are_what_each_kernel_tap_reads_over_every_output_position(second):
    """Against PyTorch's convolution with a one-hot kernel per tap (depthwise), summed over the batch and positions;
    None where the padding is not zeros on both sides."""
    from mqbench.advanced_ptq.correction import _tap_sums

    conv = SECONDS[second]()
    x = torch.randn(3, 8, 9, 10, dtype=torch.float64)
    found = _tap_sums(conv, x)
    if second in ("same-padding", "reflect-padding"):
        assert found is None
        return
    assert found is not None
    sums, count = found
    kh, kw = conv.kernel_size
    assert sums.shape == (8, kh, kw)
    for i in range(kh):
        for j in range(kw):
            one_hot = torch.zeros(8, 1, kh, kw, dtype=torch.float64)
            one_hot[:, :, i, j] = 1.0
            read = F.conv2d(x, one_hot, None, conv.stride, conv.padding, conv.dilation, groups=8)
            torch.testing.assert_close(sums[:, i, j], read.sum(dim=(0, 2, 3)), rtol=1e-12, atol=1e-9)
    assert count == read.shape[0] * read.shape[2] * read.shape[3]


def test_bias_correction_of_linear_layers_on_token_inputs():
    """Linear layers on ``[batch, tokens, features]`` inputs: the mean error over every token, measured here."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 5)).eval()
    with torch.no_grad():
        model[0].weight.add_(0.03)
    tokens = [torch.randn(16, 7, 6) + 0.5 for _ in range(3)]
    qmodel = calibrated(model, torch.cat(tokens))
    layers = {name: module for name, module in qmodel.named_modules() if isinstance(module, nn.Linear)}
    original = {name: layer.bias.detach().clone() for name, layer in layers.items()}
    corrections = bias_correction(qmodel, tokens)
    assert len(corrections) == len(layers) == 2 and max(corrections.values()) > 0
    inputs: dict[str, list[torch.Tensor]] = {name: [] for name in layers}
    for name, layer in layers.items():
        layer.register_forward_pre_hook(lambda m, a, name=name: inputs[name].append(a[0]))
    with torch.no_grad():
        for batch in tokens:
            qmodel(batch)
        for name, layer in layers.items():
            x = torch.cat(inputs[name])
            error = F.linear(x, layer.weight_fake_quant(layer.weight), layer.bias) - F.linear(
                x, layer.weight, original[name]
            )
            mean_error = error.mean(dim=(0, 1))
            assert float(mean_error.abs().max()) < 1e-5 * max(1.0, float(error.abs().mean())), name


@pytest.mark.parametrize("depthwise", [False, True], ids=["1x1", "depthwise-3x3"])
def test_fast_bias_correction_subtracts_the_weight_error_applied_to_each_float_input_mean(depthwise):
    """The correction of each layer is ``(q(W) - W)`` applied to the mean of its float input per channel, each
    kernel tap reading the channel's mean (computed here with einsum from the inputs the layers received)."""
    torch.manual_seed(0)
    model = Pair(depthwise=depthwise).eval()
    with torch.no_grad():
        model.first.weight.add_(0.02)
    images = torch.randn(64, 3, 8, 8) + 0.5
    qmodel = prepare_by_platform(model, "tensorrt", W4_PER_TENSOR)
    enable_calibration(qmodel)
    inputs: dict[str, torch.Tensor] = {}
    hooks = [
        qmodel.get_submodule(name).register_forward_pre_hook(lambda m, a, name=name: inputs.__setitem__(name, a[0]))
        for name in ("first", "second")
    ]
    with torch.no_grad(), recording_input_means(qmodel) as sums:
        qmodel(images)  # the calibration pass: float inputs
    for hook in hooks:
        hook.remove()
    enable_quantization(qmodel)
    original = {name: qmodel.get_submodule(name).bias.detach().clone() for name in ("first", "second")}
    corrections = fast_bias_correction(qmodel, sums)
    assert set(corrections) == {"first", "second"}
    for name, x in inputs.items():
        conv = qmodel.get_submodule(name)
        error = (conv.weight_fake_quant(conv.weight) - conv.weight).detach().double()
        mean = x.double().mean(dim=(0, 2, 3))
        if conv.groups == 1:
            expected = torch.einsum("oikl,i->o", error, mean)
        else:  # one input channel per output channel
            expected = torch.einsum("ojkl,o->o", error, mean)
        torch.testing.assert_close(conv.bias.detach().double(), original[name].double() - expected, rtol=0, atol=1e-6)
        assert float(expected.abs().max()) > 1e-4, name  # a correction that matters on this 4-bit grid
    # on a layer whose inputs have no padded border (the 1x1 second layer), the mean error is then gone
    if not depthwise:
        conv = qmodel.get_submodule("second")
        x = inputs["second"]
        with torch.no_grad():
            quantized = F.conv2d(x, conv.weight_fake_quant(conv.weight), conv.bias)
            full = F.conv2d(x, conv.weight, original["second"])
        assert float((quantized - full).mean(dim=(0, 2, 3)).abs().max()) < 1e-5


def test_fast_bias_correction_names_the_layers_it_has_no_input_for(caplog):
    torch.manual_seed(0)
    qmodel = calibrated(Pair(depthwise=False).eval(), torch.randn(8, 3, 8, 8))
    before = {name: qmodel.get_submodule(name).bias.detach().clone() for name in ("first", "second")}
    with caplog.at_level(logging.WARNING, logger="mqbench"):
        assert fast_bias_correction(qmodel, {}) == {}
    assert "2 layer(s) saw no input while recording (first, second): not corrected" in caplog.text
    for name, bias in before.items():
        assert torch.equal(qmodel.get_submodule(name).bias, bias)


def test_fast_bias_correction_needs_bias_correction():
    from mqbench.backends import PTQRecipe

    with pytest.raises(ValueError, match="set bias_correction too"):
        PTQRecipe(fast_bias_correction=True)


def test_bias_correction_over_batches_of_different_shapes():
    """Batches that cannot be joined run one after another: the first layer (whose input no correction
    changes) gets exactly the mean error over all batches; the second one's error shrinks."""
    torch.manual_seed(0)
    model = Pair(depthwise=False).eval()
    with torch.no_grad():
        model.first.weight.add_(0.02)
    images = [torch.randn(16, 3, size, size) + 0.5 for size in (6, 8, 10)]
    qmodel = calibrated(model, images[1])
    convs = {name: qmodel.get_submodule(name) for name in ("first", "second")}
    original = {name: conv.bias.detach().clone() for name, conv in convs.items()}
    inputs: dict[str, list[torch.Tensor]] = {"first": [], "second": []}
    for name, conv in convs.items():
        conv.register_forward_pre_hook(lambda m, a, name=name: inputs[name].append(a[0]))

    def mean_error(name: str, bias: torch.Tensor) -> torch.Tensor:
        conv = convs[name]
        args = (conv.stride, conv.padding, conv.dilation, conv.groups)
        errors = []
        for x in inputs[name]:
            quantized = F.conv2d(x, conv.weight_fake_quant(conv.weight), bias, *args)
            errors.append((quantized - F.conv2d(x, conv.weight, original[name], *args)).flatten(2))
        return torch.cat([e.transpose(0, 1).reshape(e.shape[1], -1) for e in errors], dim=1).mean(1)

    with torch.no_grad():
        for batch in images:
            qmodel(batch)
        before = {name: mean_error(name, original[name]) for name in convs}
    bias_correction(qmodel, images)
    inputs = {"first": [], "second": []}
    with torch.no_grad():
        for batch in images:
            qmodel(batch)
        after = {name: mean_error(name, convs[name].bias.detach()) for name in convs}
    assert float(before["first"].abs().max()) > 1e-3
    assert float(after["first"].abs().max()) < 1e-5 * max(1.0, float(before["first"].abs().max()))
    assert float(after["second"].abs().max()) < 0.5 * float(before["second"].abs().max())


class _Twins(nn.Module):
    """Two convolutions holding one weight and one bias (tied), each on its own input and after it its own BatchNorm
    (or none) and its own follower."""

    def __init__(self, batchnorm: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(3, 8, 3, padding=1)
        self.b.weight, self.b.bias = self.a.weight, self.a.bias
        self.norm_a, self.norm_b = nn.BatchNorm2d(8), nn.BatchNorm2d(8)
        for norm in (self.norm_a, self.norm_b):
            norm.running_mean.uniform_(-1, 1)
            norm.running_var.uniform_(0.5, 2)
            nn.init.uniform_(norm.weight, 0.5, 1.5)
        with torch.no_grad():
            self.a.weight[0] *= 8  # an output channel of a wide range: equalization would scale it
        self.act_a, self.act_b = nn.ReLU(), nn.ReLU()
        self.next_a, self.next_b = nn.Conv2d(8, 4, 1), nn.Conv2d(8, 4, 1)
        self.batchnorm = batchnorm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.a(x), self.b(x * 0.5 + 1)
        if self.batchnorm:
            a, b = self.norm_a(a), self.norm_b(b)
        return self.next_a(self.act_a(a)) + self.next_b(self.act_b(b))


@pytest.mark.parametrize("batchnorm", [True, False], ids=["bn-folded", "no-bn"])
def test_tied_layers_keep_the_float_function_through_folding_equalization_and_bias_correction(batchnorm):
    """BN folding gives each holder of a tied weight its own folded copy; equalization leaves a pair with a tied
    weight alone and bias correction a tied bias (each saying so): with every quantizer off, the model computes
    the float model's function (1e-5 of its largest output)."""
    model = _Twins(batchnorm).eval()
    x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = model(x)
    qmodel = prepare_by_platform(model, "tensorrt")
    pairs = cross_layer_equalization(qmodel)
    if not batchnorm:  # the tied pairs are left alone; untied, both would be equalized
        untied = _Twins(False).eval()
        untied.b.weight = nn.Parameter(untied.a.weight.detach().clone())
        assert pairs == [] and len(cross_layer_equalization(prepare_by_platform(untied, "tensorrt"))) == 2
    enable_calibration(qmodel)
    qmodel(x)
    enable_quantization(qmodel)
    corrected = bias_correction(qmodel, [x])
    tol = 1e-5 * float(reference.abs().max())
    disable_all(qmodel)
    if batchnorm:
        # folded: each convolution holds its own weight now; correction then moved the biases (as it should)
        assert qmodel.a.weight is not qmodel.b.weight and {"a", "b"} <= set(corrected)
    else:
        assert qmodel.a.weight is qmodel.b.weight and qmodel.a.bias is qmodel.b.bias
        assert not {"a", "b"} & set(corrected) and {"next_a", "next_b"} <= set(corrected)
        torch.testing.assert_close(qmodel.a.bias, model.a.bias, rtol=0, atol=0)
        for conv in ("next_a", "next_b"):  # only the followers' biases moved: the rest is the float function
            getattr(qmodel, conv).bias.data.copy_(getattr(model, conv).bias)
        with torch.no_grad():
            torch.testing.assert_close(qmodel(x), reference, rtol=0, atol=tol)
    if batchnorm:
        folded = prepare_by_platform(_Twins(True).eval(), "tensorrt")
        disable_all(folded)
        with torch.no_grad():
            torch.testing.assert_close(folded(x), reference, rtol=0, atol=tol)
