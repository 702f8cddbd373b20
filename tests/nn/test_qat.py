import copy
import io
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mqbench.nn import qat as nnqat

# name: (float builder, QAT class, input builder, weight ch_axis)
CASES = {
    "Conv1d": (lambda: nn.Conv1d(3, 4, 3, stride=2), nnqat.Conv1d, lambda: torch.randn(2, 3, 9), 0),
    "Conv2d_grouped_reflect": (
        lambda: nn.Conv2d(4, 6, 3, padding=1, groups=2, padding_mode="reflect"),
        nnqat.Conv2d,
        lambda: torch.randn(2, 4, 5, 5),
        0,
    ),
    "Conv2d_nobias": (lambda: nn.Conv2d(3, 4, 1, bias=False), nnqat.Conv2d, lambda: torch.randn(2, 3, 4, 4), 0),
    "Conv3d": (lambda: nn.Conv3d(2, 3, 2), nnqat.Conv3d, lambda: torch.randn(1, 2, 3, 3, 3), 0),
    "Linear": (lambda: nn.Linear(5, 3), nnqat.Linear, lambda: torch.randn(4, 2, 5), 0),
    "ConvTranspose2d": (
        lambda: nn.ConvTranspose2d(4, 6, 3, stride=2, groups=2),
        nnqat.ConvTranspose2d,
        lambda: torch.randn(2, 4, 3, 3),
        1,
    ),
    "Embedding": (
        lambda: nn.Embedding(10, 4, padding_idx=0),
        nnqat.Embedding,
        lambda: torch.tensor([[0, 3, 9], [1, 1, 2]]),
        0,
    ),
}


def make(name, reference, enabled=True, seed=0):
    torch.manual_seed(seed)
    build, qat_class, make_input, ch_axis = CASES[name]
    layer = build()
    return layer, qat_class.from_float(layer, reference.weight_factory(ch_axis, enabled=enabled)), make_input()


def float_reference(layer, x, weight):
    """The float layer's computation with an explicit weight (reflect padding done by hand)."""
    if isinstance(layer, nn.Embedding):
        return weight[x]
    if isinstance(layer, nn.Conv2d) and layer.padding_mode == "reflect":
        padded = F.pad(x, [layer.padding[1]] * 2 + [layer.padding[0]] * 2, mode="reflect")
        return F.conv2d(padded, weight, layer.bias, layer.stride, 0, layer.dilation, layer.groups)
    return None


@pytest.mark.parametrize("name", CASES)
def test_qat_layer_with_quantization_disabled_equals_the_float_layer(name, reference):
    layer, qat, x = make(name, reference, enabled=False)
    assert isinstance(qat, type(layer))
    assert torch.equal(qat(x), layer(x))
    assert torch.equal(qat.to_float()(x), layer(x))
    assert type(qat.to_float()) is type(layer)


@pytest.mark.parametrize("name", CASES)
def test_qat_layer_equals_reference_fake_quant_of_its_weight(name, reference):
    layer, qat, x = make(name, reference)
    out = qat(x)
    quantizer = qat.weight_fake_quant
    assert quantizer.scale.numel() == qat.weight.shape[CASES[name][3]]
    weight = reference.fake_quant(layer.weight.detach(), quantizer)
    expected = float_reference(layer, x, weight)
    if expected is None:
        bias = layer.bias.detach() if layer.bias is not None else None
        expected = reference.layer(layer, x, weight, bias)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(out, layer(x), atol=1e-7)


@pytest.mark.parametrize("name", CASES)
def test_gradients_reach_weight_and_bias(name, reference):
    _, qat, x = make(name, reference)
    qat(x).square().sum().backward()
    assert bool(qat.weight.grad.abs().sum() > 0)
    if getattr(qat, "bias", None) is not None:
        assert bool(qat.bias.grad.abs().sum() > 0)


@pytest.mark.parametrize("name", CASES)
def test_from_float_copies_without_sharing(name, reference):
    layer, qat, _ = make(name, reference)
    assert torch.equal(qat.weight, layer.weight)
    if getattr(layer, "bias", None) is not None:
        assert torch.equal(qat.bias, layer.bias)
    assert qat.weight is not layer.weight
    with torch.no_grad():
        qat.weight.mul_(2)
    assert not torch.equal(qat.weight, layer.weight)


@pytest.mark.parametrize("name", CASES)
def test_state_dict_loads_into_a_fresh_from_float_instance(name, reference):
    _, qat, x = make(name, reference)
    expected = qat(x)  # calibration sizes the per-channel buffers
    buffer = io.BytesIO()
    torch.save(qat.state_dict(), buffer)
    buffer.seek(0)
    _, fresh, _ = make(name, reference, seed=1)
    fresh.load_state_dict(torch.load(buffer, weights_only=True))
    assert torch.equal(fresh(x), expected)


def test_from_float_qconfig_fallback_and_errors(reference):
    conv = nn.Conv2d(3, 4, 3)
    with pytest.raises(ValueError, match=r"weight_fake_quant_factory=.*qconfig"):
        nnqat.Conv2d.from_float(conv)
    conv.qconfig = SimpleNamespace(weight=reference.weight_factory())
    qat = nnqat.Conv2d.from_float(conv)
    assert qat.qconfig is conv.qconfig
    explicit = nnqat.Conv2d.from_float(conv, reference.weight_factory(per_channel=False))
    assert not explicit.weight_fake_quant.is_per_channel  # the explicit factory wins
    with pytest.raises(TypeError, match="expects a float Linear"):
        nnqat.Linear.from_float(conv, reference.weight_factory())
    with pytest.raises(TypeError, match="expects a float Conv2d"):
        nnqat.Conv2d.from_float(qat, reference.weight_factory())
    with pytest.raises(TypeError, match="callable"):
        nnqat.Conv2d.from_float(nn.Conv2d(1, 1, 1), "not a factory")
    with pytest.raises(TypeError, match=r"nn\.Module"):
        nnqat.Linear(2, 2, weight_fake_quant_factory=lambda: 3)


def test_from_float_keeps_mode_dtype_and_requires_grad(reference):
    layer = nn.Linear(3, 2).double().eval()
    layer.bias.requires_grad_(False)
    qat = nnqat.Linear.from_float(layer, reference.weight_factory())
    assert not qat.training
    assert qat.weight.dtype == torch.float64
    assert qat.weight.requires_grad and not qat.bias.requires_grad


def test_embedding_quantizes_each_row(reference):
    layer, qat, x = make("Embedding", reference)
    qat(x)
    row_max = layer.weight.detach().abs().amax(dim=1)
    # the padding row is all zeros: its range is taken as [0, 1] (a scale of 1 / 127 on [-127, 127])
    expected = torch.where(row_max == 0, torch.full_like(row_max, 1.0), row_max) / 127
    torch.testing.assert_close(qat.weight_fake_quant.scale, expected)
    assert qat.to_float().padding_idx == 0


def test_conv_transpose_output_size(reference):
    layer, qat, x = make("ConvTranspose2d", reference, enabled=False)
    assert torch.equal(qat(x, output_size=[8, 8]), layer(x, output_size=[8, 8]))
    assert qat(x, output_size=[8, 8]).shape[-2:] == (8, 8)


def test_to_float_is_independent(reference):
    layer, qat, x = make("Conv1d", reference, enabled=False)
    floating = qat.to_float()
    with torch.no_grad():
        floating.weight.zero_()
    assert torch.equal(qat(x), copy.deepcopy(layer)(x))
