import copy
import io
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from mqbench.fake_quantize import FixedFakeQuantize, LearnableFakeQuantize, NNIEFakeQuantize, TqtFakeQuantize
from mqbench.nn import intrinsic as nni
from mqbench.nn import qat as nnqat
from mqbench.nn.intrinsic import qat as nniqat
from mqbench.observer import MinMaxObserver


def _conv1d():
    return nn.Conv1d(3, 4, 3, padding=1)


def _conv2d():
    return nn.Conv2d(3, 4, 3, padding=1)


def _conv3d():
    return nn.Conv3d(2, 4, 2)


def _linear():
    return nn.Linear(5, 4)


def _deconv():
    return nn.ConvTranspose2d(4, 6, 3, stride=2, groups=2, output_padding=1)


# name: (float fused builder, QAT class, input shape, weight ch_axis)
CASES = {
    "ConvBn1d": (lambda: nni.ConvBn1d(_conv1d(), nn.BatchNorm1d(4)), nniqat.ConvBn1d, (6, 3, 9), 0),
    "ConvBn2d": (lambda: nni.ConvBn2d(_conv2d(), nn.BatchNorm2d(4)), nniqat.ConvBn2d, (4, 3, 6, 6), 0),
    "ConvBn2d_nobias_noaffine": (
        lambda: nni.ConvBn2d(nn.Conv2d(3, 4, 3, bias=False), nn.BatchNorm2d(4, affine=False)),
        nniqat.ConvBn2d,
        (4, 3, 6, 6),
        0,
    ),
    "ConvBn3d": (lambda: nni.ConvBn3d(_conv3d(), nn.BatchNorm3d(4)), nniqat.ConvBn3d, (3, 2, 4, 4, 4), 0),
    "ConvBnReLU1d": (
        lambda: nni.ConvBnReLU1d(_conv1d(), nn.BatchNorm1d(4), nn.ReLU()),
        nniqat.ConvBnReLU1d,
        (6, 3, 9),
        0,
    ),
    "ConvBnReLU2d": (
        lambda: nni.ConvBnReLU2d(_conv2d(), nn.BatchNorm2d(4), nn.ReLU()),
        nniqat.ConvBnReLU2d,
        (4, 3, 6, 6),
        0,
    ),
    "ConvBnReLU6_2d": (
        lambda: nni.ConvBnReLU2d(_conv2d(), nn.BatchNorm2d(4, momentum=None), nn.ReLU6(inplace=True)),
        nniqat.ConvBnReLU2d,
        (4, 3, 6, 6),
        0,
    ),
    "ConvBnReLU3d": (
        lambda: nni.ConvBnReLU3d(_conv3d(), nn.BatchNorm3d(4), nn.ReLU()),
        nniqat.ConvBnReLU3d,
        (3, 2, 4, 4, 4),
        0,
    ),
    "ConvReLU1d": (lambda: nni.ConvReLU1d(_conv1d(), nn.ReLU()), nniqat.ConvReLU1d, (2, 3, 9), 0),
    "ConvReLU2d": (lambda: nni.ConvReLU2d(_conv2d(), nn.ReLU6()), nniqat.ConvReLU2d, (2, 3, 6, 6), 0),
    "ConvReLU3d": (lambda: nni.ConvReLU3d(_conv3d(), nn.ReLU()), nniqat.ConvReLU3d, (2, 2, 4, 4, 4), 0),
    "LinearBn1d": (lambda: nni.LinearBn1d(_linear(), nn.BatchNorm1d(4)), nniqat.LinearBn1d, (8, 5), 0),
    "LinearBnReLU1d": (
        lambda: nni.LinearBnReLU1d(_linear(), nn.BatchNorm1d(4), nn.ReLU()),
        nniqat.LinearBnReLU1d,
        (8, 5),
        0,
    ),
    "LinearReLU": (lambda: nni.LinearReLU(_linear(), nn.ReLU()), nniqat.LinearReLU, (8, 5), 0),
    "ConvTransposeBn2d": (
        lambda: nni.ConvTransposeBn2d(_deconv(), nn.BatchNorm2d(6)),
        nniqat.ConvTransposeBn2d,
        (3, 4, 4, 4),
        1,
    ),
    "ConvTransposeBnReLU2d": (
        lambda: nni.ConvTransposeBnReLU2d(_deconv(), nn.BatchNorm2d(6), nn.ReLU()),
        nniqat.ConvTransposeBnReLU2d,
        (3, 4, 4, 4),
        1,
    ),
    "ConvTransposeReLU2d": (
        lambda: nni.ConvTransposeReLU2d(_deconv(), nn.ReLU()),
        nniqat.ConvTransposeReLU2d,
        (3, 4, 4, 4),
        1,
    ),
}
BN_CASES = [name for name in CASES if "Bn" in name]


def has_bn(module):
    return any(isinstance(part, nn.modules.batchnorm._BatchNorm) for part in module)


def make_float(name, reference, seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    build, _, shape, _ = CASES[name]
    fused = build().to(dtype)
    if has_bn(fused):
        reference.randomize_bn(fused[1])
    return fused, torch.randn(*shape, dtype=dtype)


def make_qat(name, reference, enabled=True, seed=0, dtype=torch.float32):
    fused, x = make_float(name, reference, seed, dtype)
    _, qat_class, _, ch_axis = CASES[name]
    return fused, qat_class.from_float(fused, reference.weight_factory(ch_axis, enabled=enabled)), x


def eval_reference(fused, qat, x, reference, quantize=True):
    """conv(x, fq(folded weight)) + folded bias, then the activation; all in the test."""
    layer = fused[0]
    if has_bn(fused):
        weight, bias = reference.fold(layer, fused[1])
    else:
        weight, bias = layer.weight.detach(), (layer.bias.detach() if layer.bias is not None else None)
    if quantize:
        weight = reference.fake_quant(weight, qat.weight_fake_quant)
    out = reference.layer(layer, x, weight, bias)
    activation = fused[-1]
    return activation(out) if isinstance(activation, (nn.ReLU, nn.ReLU6)) else out


# -- float fused modules -------------------------------------------------------------------------
@pytest.mark.parametrize("name", CASES)
def test_fused_float_module_equals_its_parts_in_sequence(name, reference):
    fused, x = make_float(name, reference)
    parts = copy.deepcopy(list(fused))
    expected = x
    for part in parts:
        expected = part(expected)
    assert torch.equal(fused(x), expected)  # training mode: BatchNorm uses and updates batch statistics
    expected_state = nn.Sequential(*parts).state_dict()
    assert all(torch.equal(value, expected_state[key]) for key, value in fused.state_dict().items())
    fused.eval()
    for part in parts:
        part.eval()
    expected = x
    for part in parts:
        expected = part(expected)
    assert torch.equal(fused(x), expected)


def test_fused_float_module_checks_its_parts():
    with pytest.raises(TypeError, match="activation must be ReLU or ReLU6"):
        nni.ConvReLU2d(nn.Conv2d(1, 1, 1), nn.Sigmoid())
    with pytest.raises(TypeError, match="takes 3 modules"):
        nni.ConvBnReLU2d(nn.Conv2d(1, 2, 1), nn.BatchNorm2d(2))
    with pytest.raises(TypeError, match="Conv2d must be Conv2d"):
        nni.ConvBn2d(nn.Conv1d(1, 2, 1), nn.BatchNorm2d(2))
    with pytest.raises(ValueError, match="3 features"):
        nni.LinearBn1d(nn.Linear(2, 4), nn.BatchNorm1d(3))


# -- QAT: eval mode --------------------------------------------------------------------------------
@pytest.mark.parametrize("name", CASES)
def test_qat_with_quantization_disabled_equals_the_float_module_in_eval(name, reference):
    fused, qat, x = make_qat(name, reference, enabled=False)
    fused.eval()
    qat.eval()
    torch.testing.assert_close(qat(x), fused(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(qat.to_float()(x), fused(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", CASES)
def test_qat_eval_equals_reference_fake_quant_of_the_folded_weight(name, reference):
    fused, qat, x = make_qat(name, reference)
    fused.eval()
    qat.eval()
    out = qat(x)  # the observer sees the folded weight and sets the scale
    quantizer = qat.weight_fake_quant
    assert quantizer.scale.numel() == qat.weight.shape[CASES[name][3]]
    expected = eval_reference(fused, qat, x, reference)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    unquantized = eval_reference(fused, qat, x, reference, quantize=False)
    assert not torch.allclose(out, unquantized, atol=1e-6)  # quantization really happened


@pytest.mark.parametrize("name", BN_CASES)
def test_merge_bn_and_to_float_give_the_deployed_module(name, reference):
    _, qat, x = make_qat(name, reference)
    qat.eval()
    out = qat(x)
    merged = qat.merge_bn().eval()
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in merged.modules())
    assert isinstance(merged, nnqat.QATModule)
    torch.testing.assert_close(merged(x), out, rtol=1e-6, atol=1e-6)
    floating = qat.to_float()
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in floating.modules())
    qat.weight_fake_quant.disable_fake_quant()
    torch.testing.assert_close(floating.eval()(x), qat(x), rtol=1e-5, atol=1e-5)


def test_to_float_and_merge_bn_types(reference):
    weight_factory = reference.weight_factory
    conv_bn = nniqat.ConvBn2d(3, 4, 3, weight_fake_quant_factory=weight_factory())
    assert type(conv_bn.to_float()) is nn.Conv2d
    assert type(conv_bn.merge_bn()) is nnqat.Conv2d
    conv_bn_relu = nniqat.ConvBnReLU2d(3, 4, 3, weight_fake_quant_factory=weight_factory(), relu=nn.ReLU6())
    floating = conv_bn_relu.to_float()
    assert type(floating) is nni.ConvReLU2d
    assert type(floating[1]) is nn.ReLU6
    assert type(conv_bn_relu.merge_bn()) is nniqat.ConvReLU2d
    linear = nniqat.LinearBnReLU1d(3, 4, weight_fake_quant_factory=weight_factory())
    assert type(linear.to_float()) is nni.LinearReLU
    assert type(linear.merge_bn()) is nniqat.LinearReLU
    deconv = nniqat.ConvTransposeBn2d(4, 6, 2, groups=2, weight_fake_quant_factory=weight_factory(1))
    assert type(deconv.to_float()) is nn.ConvTranspose2d
    assert type(deconv.merge_bn()) is nnqat.ConvTranspose2d
    assert type(nniqat.ConvReLU3d(1, 2, 1, weight_fake_quant_factory=weight_factory()).to_float()) is nni.ConvReLU3d


def test_direct_construction_and_class_relations(reference):
    qat = nniqat.ConvBn2d(3, 4, 3, weight_fake_quant_factory=reference.weight_factory(), eps=1e-3, momentum=0.2)
    assert isinstance(qat, nn.Conv2d)
    assert not isinstance(qat, nnqat.Conv2d)
    assert type(qat.bn) is nn.BatchNorm2d
    assert (qat.bn.num_features, qat.bn.eps, qat.bn.momentum, qat.freeze_bn) == (4, 1e-3, 0.2, False)
    assert isinstance(nniqat.ConvReLU2d(1, 1, 1, weight_fake_quant_factory=reference.weight_factory()), nnqat.Conv2d)
    assert type(nniqat.LinearReLU(2, 2, weight_fake_quant_factory=reference.weight_factory()).relu) is nn.ReLU
    assert "freeze_bn=True" in repr(qat.freeze_bn_stats())


# -- QAT: training mode ----------------------------------------------------------------------------
@pytest.mark.parametrize("name", BN_CASES)
def test_training_updates_bn_statistics_like_the_float_module(name, reference):
    fused, qat, x = make_qat(name, reference, enabled=False, dtype=torch.float64)
    fused.train()
    qat.train()
    for step in range(3):
        batch = x * (1 + step) + step
        torch.testing.assert_close(qat(batch), fused(batch), rtol=1e-9, atol=1e-9)
    for key in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(qat.bn, key), getattr(fused[1], key), rtol=1e-10, atol=1e-12)


AFFINE_BN_CASES = [name for name in BN_CASES if "noaffine" not in name]


@pytest.mark.parametrize("name", AFFINE_BN_CASES)
def test_a_zero_gamma_channel_trains_like_the_float_module(name, reference):
    """gamma 0 (zero-initialised residual BN) folds to zero weights; training must not divide by it."""
    fused, qat, x = make_qat(name, reference, enabled=False, dtype=torch.float64)
    with torch.no_grad():
        for norm in (fused[1], qat.bn):
            norm.weight[0], norm.bias[0] = 0.0, 0.5  # beta > 0: the channel passes a ReLU
    fused.train()
    qat.train()
    out, expected = qat(x), fused(x)
    assert bool(torch.isfinite(out).all())
    torch.testing.assert_close(out, expected, rtol=1e-9, atol=1e-9)
    target = torch.randn_like(expected)
    ((out - target) ** 2).sum().backward()
    ((expected - target) ** 2).sum().backward()
    # gamma 0 still learns: its gradient is that of bn(layer(x)), not 0 or NaN
    torch.testing.assert_close(qat.bn.weight.grad, fused[1].weight.grad, rtol=1e-9, atol=1e-9)
    assert float(qat.bn.weight.grad[0].abs()) > 0
    torch.testing.assert_close(qat.weight.grad, fused[0].weight.grad, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("name", BN_CASES)
def test_frozen_bn_stops_updating_statistics_and_computes_the_deployed_layer(name, reference):
    _, qat, x = make_qat(name, reference)
    qat.train()
    qat(x)
    frozen = copy.deepcopy(qat.bn.state_dict())
    assert qat.freeze_bn_stats() is qat
    out = qat(x + 1)
    for key, value in qat.bn.state_dict().items():
        assert torch.equal(value, frozen[key]), key
    torch.testing.assert_close(out, copy.deepcopy(qat).eval()(x + 1))
    qat.update_bn_stats()
    qat(x + 1)
    assert not torch.equal(qat.bn.running_mean, frozen["running_mean"])


def test_freeze_and_update_functions_work_with_apply(reference):
    model = nn.Sequential(
        nniqat.ConvBnReLU2d(3, 4, 3, weight_fake_quant_factory=reference.weight_factory()),
        nniqat.ConvReLU2d(4, 4, 1, weight_fake_quant_factory=reference.weight_factory()),
        nniqat.LinearBn1d(4, 2, weight_fake_quant_factory=reference.weight_factory()),
    )
    model.apply(nniqat.freeze_bn_stats)
    assert model[0].freeze_bn and model[2].freeze_bn
    model.apply(nniqat.update_bn_stats)
    assert not model[0].freeze_bn and not model[2].freeze_bn


@pytest.mark.parametrize("name", BN_CASES)
def test_gradients_reach_weight_bias_and_bn_affine(name, reference):
    _, qat, x = make_qat(name, reference)
    qat.train()
    target = torch.randn_like(qat(x))
    ((qat(x) - target) ** 2).mean().backward()
    assert bool(qat.weight.grad.abs().sum() > 0)
    if qat.bn.affine:
        assert bool(qat.bn.weight.grad.abs().sum() > 0)
        assert bool(qat.bn.bias.grad.abs().sum() > 0)
    if qat.bias is not None:
        # With batch statistics the bias cancels in the normalisation (gradient ~0); frozen, it matters.
        assert qat.bias.grad is not None and bool(torch.isfinite(qat.bias.grad).all())
        qat.zero_grad()
        qat.freeze_bn_stats()
        ((qat(x) - target) ** 2).mean().backward()
        assert bool(qat.bias.grad.abs().sum() > 0)


def test_sgd_on_a_tiny_conv_bn_relu_model_reduces_the_loss(reference):
    torch.manual_seed(0)
    float_module = nni.ConvBnReLU2d(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
    model = nn.Sequential(
        nniqat.ConvBnReLU2d.from_float(float_module, reference.weight_factory()),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 2),
    )
    x = torch.randn(32, 3, 6, 6)
    target = torch.stack([x.mean(dim=(1, 2, 3)), x[:, 0].abs().mean(dim=(1, 2))], dim=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for _ in range(40):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5


# -- from_float, state_dict -------------------------------------------------------------------------
@pytest.mark.parametrize("name", CASES)
def test_from_float_copies_weights_bn_state_and_activation(name, reference):
    fused, qat, _ = make_qat(name, reference)
    layer = fused[0]
    assert torch.equal(qat.weight, layer.weight)
    assert (qat.bias is None) == (layer.bias is None)
    if layer.bias is not None:
        assert torch.equal(qat.bias, layer.bias)
    if has_bn(fused):
        bn = fused[1]
        for key, value in bn.state_dict().items():
            assert torch.equal(qat.bn.state_dict()[key], value), key
        assert (qat.bn.eps, qat.bn.momentum, qat.bn.affine) == (bn.eps, bn.momentum, bn.affine)
        assert qat.bn is not bn
    activation = fused[-1]
    if isinstance(activation, (nn.ReLU, nn.ReLU6)):
        assert type(qat.relu) is type(activation) and qat.relu.inplace == activation.inplace
    with torch.no_grad():  # nothing is shared with the float module
        qat.weight.add_(1.0)
    assert not torch.equal(qat.weight, layer.weight)


@pytest.mark.parametrize("name", ["ConvBnReLU2d", "LinearReLU"])
def test_from_float_falls_back_to_qconfig_and_explains_a_missing_factory(name, reference):
    fused, _ = make_float(name, reference)
    qat_class, ch_axis = CASES[name][1], CASES[name][3]
    with pytest.raises(ValueError, match=r"weight_fake_quant_factory=.*qconfig"):
        qat_class.from_float(fused)
    fused.qconfig = SimpleNamespace(weight=reference.weight_factory(ch_axis))
    qat = qat_class.from_float(fused)
    assert qat.qconfig is fused.qconfig
    assert qat.weight_fake_quant.is_per_channel
    with pytest.raises(TypeError, match="expects a float"):
        qat_class.from_float(nn.Conv2d(1, 1, 1), reference.weight_factory())
    with pytest.raises(TypeError, match="expects a float"):
        qat_class.from_float(qat, reference.weight_factory())


@pytest.mark.parametrize("name", CASES)
def test_state_dict_loads_into_a_fresh_from_float_instance(name, reference):
    _, qat, x = make_qat(name, reference)
    qat.train()
    qat(x)  # calibration: per-channel quantizer buffers get their size
    qat.eval()
    expected = qat(x)
    buffer = io.BytesIO()
    torch.save(qat.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    _, fresh, _ = make_qat(name, reference, seed=1)
    fresh.load_state_dict(state)
    fresh.eval()
    assert torch.equal(fresh(x), expected)
    assert fresh.weight_fake_quant.scale.shape == qat.weight_fake_quant.scale.shape


def test_conv_transpose_accepts_output_size(reference):
    fused, qat, x = make_qat("ConvTransposeBnReLU2d", reference, enabled=False)
    fused.eval()
    qat.eval()
    out = qat(x, output_size=[9, 9])  # stride 2, kernel 3, 4x4 input: 9x9 or 10x10 (the default)
    assert out.shape[-2:] == (9, 9)
    layer, bn = fused[0], fused[1]
    expected = fused[2](bn(layer(x, output_size=[9, 9])))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


FOLDED_QUANTIZERS = [
    (LearnableFakeQuantize, True, {"scale"}),
    (LearnableFakeQuantize, False, {"scale"}),
    (TqtFakeQuantize, True, {"log2_threshold"}),
    (TqtFakeQuantize, False, {"log2_threshold"}),
    (FixedFakeQuantize, True, set()),
    (FixedFakeQuantize, False, set()),
    (NNIEFakeQuantize, False, set()),
]


@pytest.mark.parametrize(("quantizer", "per_channel", "learned"), FOLDED_QUANTIZERS)
def test_weights_fold_in_fused_passes_as_in_three_ops(quantizer, per_channel, learned, monkeypatch):
    """Every default weight quantizer scales, quantizes and unscales a training ConvBn's weight in fused
    passes: the output is the three separate ops' to the bit, every gradient theirs to float rounding."""
    qscheme = torch.per_channel_symmetric if per_channel else torch.per_tensor_symmetric
    factory = quantizer.with_args(observer=MinMaxObserver, quant_min=-128, quant_max=127, qscheme=qscheme, ch_axis=0)
    torch.manual_seed(0)
    conv = nniqat.ConvBnReLU2d(4, 6, 3, weight_fake_quant_factory=factory)
    with torch.no_grad():
        conv.bn.weight.uniform_(0.5, 2.0)
        conv.bn.running_var.uniform_(0.5, 2.0)
    conv.weight_fake_quant(conv.weight.detach() * 1.5)  # calibrate
    conv.weight_fake_quant.disable_observer()
    x = torch.randn(8, 4, 10, 10)
    target = torch.randn(8, 6, 8, 8)
    results, fused_calls = [], []
    for fused in (True, False):
        model = copy.deepcopy(conv).train()
        kind = type(model.weight_fake_quant)
        if fused:
            original = kind._quantize_folded

            def counted(self, *args, original=original):
                fused_calls.append(1)
                return original(self, *args)

            monkeypatch.setattr(kind, "_quantize_folded", counted)
        else:
            monkeypatch.setattr(kind, "quantize_folded", lambda *args: None)
        out = model(x)
        ((out - target) ** 2).mean().backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        results.append((out.detach(), grads))
        monkeypatch.undo()
    assert fused_calls == [1]
    (out_fused, grads_fused), (out_plain, grads_plain) = results
    assert torch.equal(out_fused, out_plain)
    assert set(grads_fused) == set(grads_plain)
    assert {"weight", "bn.weight"} | {f"weight_fake_quant.{name}" for name in learned} <= set(grads_plain)
    for name, grad in grads_plain.items():
        torch.testing.assert_close(grads_fused[name], grad, rtol=1e-4, atol=1e-6 * float(grad.abs().max() + 1e-12))
