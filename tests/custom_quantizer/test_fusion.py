"""Fusion and module swapping at prepare: which chains fuse, into what, and what is left alone."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.nn.modules.batchnorm import _BatchNorm

from mqbench.fake_quantize.quantize_base import QuantizeBase
from mqbench.nn.intrinsic import qat as nniqat
from mqbench.prepare_by_platform import prepare_by_platform
from mqbench.utils.state import disable_all, enable_calibration, enable_quantization

WEIGHTED = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear, nn.ConvTranspose2d)


def randomize_bn(model: nn.Module) -> nn.Module:
    """BatchNorm with non-trivial statistics and affine parameters, so folding is visible."""
    g = torch.Generator().manual_seed(0)
    for module in model.modules():
        if isinstance(module, _BatchNorm):
            n = module.num_features
            module.running_mean.copy_(torch.rand(n, generator=g) * 2 - 1)
            module.running_var.copy_(torch.rand(n, generator=g) + 0.5)
            module.weight.data.copy_(torch.rand(n, generator=g) + 0.5)
            module.bias.data.copy_(torch.rand(n, generator=g) - 0.5)
    return model


def call_nodes(gm: fx.GraphModule) -> list[str]:
    """The ops of the graph other than quantizers: module targets, function / method names."""
    modules = dict(gm.named_modules())
    names = []
    for node in gm.graph.nodes:
        if node.op == "call_module" and not isinstance(modules[str(node.target)], QuantizeBase):
            names.append(str(node.target))
        elif node.op in ("call_function", "call_method"):
            names.append(getattr(node.target, "__name__", str(node.target)))
    return names


def float_output(gm: fx.GraphModule, *inputs: torch.Tensor) -> torch.Tensor:
    disable_all(gm)
    with torch.no_grad():
        return gm(*inputs)


# -- fusion patterns ------------------------------------------------------------------------------
# (layers, input shape, PTQ type, QAT type)
PATTERNS = {
    "conv1d_bn_relu": (
        lambda: [nn.Conv1d(3, 4, 3), nn.BatchNorm1d(4), nn.ReLU()],
        (2, 3, 8),
        "ConvReLU1d",
        "ConvBnReLU1d",
    ),
    "conv1d_bn": (lambda: [nn.Conv1d(3, 4, 3), nn.BatchNorm1d(4)], (2, 3, 8), "Conv1d", "ConvBn1d"),
    "conv1d_relu": (lambda: [nn.Conv1d(3, 4, 3), nn.ReLU()], (2, 3, 8), "ConvReLU1d", "ConvReLU1d"),
    "conv2d_bn_relu": (
        lambda: [nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()],
        (2, 3, 6, 6),
        "ConvReLU2d",
        "ConvBnReLU2d",
    ),
    "conv2d_bn": (lambda: [nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)], (2, 3, 6, 6), "Conv2d", "ConvBn2d"),
    "conv2d_relu": (lambda: [nn.Conv2d(3, 4, 3), nn.ReLU()], (2, 3, 6, 6), "ConvReLU2d", "ConvReLU2d"),
    "conv3d_bn_relu6": (
        lambda: [nn.Conv3d(3, 4, 3), nn.BatchNorm3d(4), nn.ReLU6()],
        (2, 3, 5, 5, 5),
        "ConvReLU3d",
        "ConvBnReLU3d",
    ),
    "conv3d_bn": (lambda: [nn.Conv3d(3, 4, 3), nn.BatchNorm3d(4)], (2, 3, 5, 5, 5), "Conv3d", "ConvBn3d"),
    "conv3d_relu": (lambda: [nn.Conv3d(3, 4, 3), nn.ReLU()], (2, 3, 5, 5, 5), "ConvReLU3d", "ConvReLU3d"),
    "linear_bn_relu": (
        lambda: [nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU()],
        (6, 3),
        "LinearReLU",
        "LinearBnReLU1d",
    ),
    "linear_bn": (lambda: [nn.Linear(3, 4), nn.BatchNorm1d(4)], (6, 3), "Linear", "LinearBn1d"),
    "linear_relu": (lambda: [nn.Linear(3, 4), nn.ReLU()], (6, 3), "LinearReLU", "LinearReLU"),
    "deconv_bn_relu": (
        lambda: [nn.ConvTranspose2d(3, 4, 2), nn.BatchNorm2d(4), nn.ReLU()],
        (2, 3, 5, 5),
        "ConvTransposeReLU2d",
        "ConvTransposeBnReLU2d",
    ),
    "deconv_bn": (
        lambda: [nn.ConvTranspose2d(3, 4, 2), nn.BatchNorm2d(4)],
        (2, 3, 5, 5),
        "ConvTranspose2d",
        "ConvTransposeBn2d",
    ),
    "deconv_relu": (
        lambda: [nn.ConvTranspose2d(3, 4, 2), nn.ReLU()],
        (2, 3, 5, 5),
        "ConvTransposeReLU2d",
        "ConvTransposeReLU2d",
    ),
}


@pytest.mark.parametrize("name", PATTERNS)
@pytest.mark.parametrize("mode", ["ptq_eval", "ptq_explicit", "qat"])
def test_fusion_patterns(name, mode):
    layers, shape, ptq_type, qat_type = PATTERNS[name]
    model = randomize_bn(nn.Sequential(*layers()))
    has_bn = any(isinstance(m, _BatchNorm) for m in model)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    if mode == "ptq_eval":  # is_qat follows the model: eval -> PTQ
        gm = prepare_by_platform(model.eval(), "tensorrt")
    elif mode == "ptq_explicit":  # a training-mode model prepared for PTQ
        gm = prepare_by_platform(model.train(), "tensorrt", is_qat=False)
    else:
        gm = prepare_by_platform(model.train(), "tensorrt")
    qat = mode == "qat"
    # one fused module where the chain was, nothing else left of it
    assert call_nodes(gm) == ["0"]
    fused = gm.get_submodule("0")
    assert type(fused).__name__ == (qat_type if qat else ptq_type)
    assert type(fused).__module__.startswith("mqbench.nn.")
    assert hasattr(fused, "weight_fake_quant")
    assert isinstance(fused.weight_fake_quant, QuantizeBase)
    bns = [n for n, m in gm.named_modules() if isinstance(m, _BatchNorm)]
    if qat and has_bn:
        assert bns == ["0.bn"]
        assert isinstance(fused, nniqat.BnFoldingModule)
    else:
        assert bns == []  # PTQ: folded into the weights at prepare
    if len(model) == 3 or (len(model) == 2 and not has_bn):
        assert isinstance(fused.relu, type(model[-1]))
    # the simulation with quantizers off computes what the float model computes
    gm.eval()
    model.eval()
    with torch.no_grad():
        expected = model(x)
    torch.testing.assert_close(float_output(gm, x), expected, rtol=1e-4, atol=1e-5)


def test_qat_bn_fold_trains_with_batch_statistics():
    model = randomize_bn(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())).train()
    gm = prepare_by_platform(model, "tensorrt")
    assert gm.training
    assert isinstance(gm.get_submodule("0"), nniqat.ConvBnReLU2d)
    x = torch.randn(8, 3, 6, 6)
    reference = copy.deepcopy(model).train()
    with torch.no_grad():
        expected = reference(x)
    disable_all(gm)
    with torch.no_grad():
        got = gm(x)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    # running statistics were updated like the float BatchNorm's
    torch.testing.assert_close(gm.get_submodule("0").bn.running_mean, reference[1].running_mean)


# -- activation spellings -------------------------------------------------------------------------
class ConvAct(nn.Module):
    def __init__(self, spelling: str) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)
        self.spelling = spelling
        self.act = {"ReLU_inplace": nn.ReLU(inplace=True), "ReLU6": nn.ReLU6(), "ReLU6_inplace": nn.ReLU6(True)}.get(
            spelling
        )

    def forward(self, x):
        y = self.conv(x)
        if self.act is not None:
            return self.act(y)
        if self.spelling == "F.relu":
            return F.relu(y)
        if self.spelling == "F.relu_inplace":
            return F.relu(y, inplace=True)
        if self.spelling == "F.relu6":
            return F.relu6(y)
        if self.spelling == "torch.relu":
            return torch.relu(y)
        if self.spelling == "method":
            return y.relu()
        return y.relu_()


SPELLINGS = {
    "F.relu": nn.ReLU,
    "F.relu_inplace": nn.ReLU,
    "F.relu6": nn.ReLU6,
    "torch.relu": nn.ReLU,
    "method": nn.ReLU,
    "method_inplace": nn.ReLU,
    "ReLU_inplace": nn.ReLU,
    "ReLU6": nn.ReLU6,
    "ReLU6_inplace": nn.ReLU6,
}


@pytest.mark.parametrize("capture", ["fx", "export"])
@pytest.mark.parametrize("spelling", SPELLINGS)
def test_every_relu_spelling_fuses(spelling, capture):
    model = ConvAct(spelling).eval()
    gm = prepare_by_platform(model, "tensorrt", {"capture": capture, "example_inputs": (torch.randn(2, 3, 4, 4),)})
    assert call_nodes(gm) == ["conv"]
    assert isinstance(gm.conv, nniqat.ConvReLU2d)
    assert type(gm.conv.relu) is SPELLINGS[spelling]
    x = torch.randn(2, 3, 4, 4) * 4
    with torch.no_grad():
        expected = model(x.clone())
    torch.testing.assert_close(float_output(gm, x.clone()), expected)


# -- single user, shared modules --------------------------------------------------------------
def test_no_fusion_when_the_intermediate_has_two_users():
    class TwoUsers(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 1)
            self.bn = nn.BatchNorm2d(4)
            self.conv2 = nn.Conv2d(4, 4, 1)

        def forward(self, x):
            a = self.conv(x)
            c = self.conv2(self.bn(a) + a)  # conv output read twice: conv + bn must not fuse
            return F.relu(c) + c  # conv2 output read twice: conv2 + relu must not fuse

    model = randomize_bn(TwoUsers()).eval()
    gm = prepare_by_platform(model, "tensorrt")
    assert call_nodes(gm) == ["conv", "bn", "add", "conv2", "relu", "add"]
    assert type(gm.conv).__name__ == "Conv2d"
    assert type(gm.conv2).__name__ == "Conv2d"
    assert isinstance(gm.bn, nn.BatchNorm2d)
    x = torch.randn(2, 3, 4, 4)
    with torch.no_grad():
        expected = model(x)
    torch.testing.assert_close(float_output(gm, x), expected)


def test_conv_output_read_by_bn_and_returned_is_not_fused():
    class Both(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 1)
            self.bn = nn.BatchNorm2d(4)

        def forward(self, x):
            a = self.conv(x)
            return self.bn(a), a

    gm = prepare_by_platform(randomize_bn(Both()).eval(), "tensorrt")
    assert call_nodes(gm) == ["conv", "bn"]


def test_shared_modules_are_not_fused_and_still_work():
    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 1)
            self.bn = nn.BatchNorm2d(4)
            self.relu = nn.ReLU()

        def forward(self, x):
            y = self.relu(self.bn(self.conv(x)))  # conv and bn are called again below
            return self.bn(self.conv(y))

    model = randomize_bn(Shared()).eval()
    gm = prepare_by_platform(model, "tensorrt")
    assert call_nodes(gm) == ["conv", "bn", "relu", "conv", "bn"]
    assert type(gm.conv).__name__ == "Conv2d"
    assert hasattr(gm.conv, "weight_fake_quant")
    assert isinstance(gm.bn, nn.BatchNorm2d)
    x = torch.randn(2, 4, 3, 3)
    with torch.no_grad():
        expected = model(x)
    torch.testing.assert_close(float_output(gm, x), expected)
    enable_calibration(gm)
    gm(x)
    enable_quantization(gm)
    assert gm(x).shape == expected.shape


# -- the user's model, weight quantizers ----------------------------------------------------------
class Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv1d(2, 3, 1)
        self.block = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
        self.c3 = nn.Conv3d(1, 2, 1)
        self.up = nn.ConvTranspose2d(4, 6, 2, stride=2)
        self.bn_up = nn.BatchNorm2d(6)
        self.fc = nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.Linear(5, 2))

    def forward(self, seq, img, vol):
        s = self.c1(seq).mean()
        h = self.bn_up(self.up(self.block(img))) + s + self.c3(vol).mean()
        return self.fc(h.mean((2, 3)))

    @staticmethod
    def inputs():
        return torch.randn(2, 2, 5), torch.randn(2, 3, 4, 4), torch.randn(2, 1, 2, 2, 2)


@pytest.mark.parametrize("is_qat", [False, True])
@pytest.mark.parametrize("backend", ["tensorrt", "snpe", "vitis", "openvino", "tengine_u8"])
def test_prepare_leaves_the_user_model_alone_and_quantizes_every_weight(backend, is_qat):
    model = randomize_bn(Mixed()).train(is_qat)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    types = {name: type(m) for name, m in model.named_modules()}
    gm = prepare_by_platform(model, backend)
    assert model.training is is_qat
    assert {name: type(m) for name, m in model.named_modules()} == types
    after = model.state_dict()
    assert after.keys() == before.keys()
    for key, value in before.items():
        assert torch.equal(after[key], value), key
    assert not any(isinstance(m, QuantizeBase) for m in model.modules())

    weighted = {name: m for name, m in gm.named_modules() if isinstance(m, WEIGHTED)}
    assert len(weighted) == 6  # c1, block.0, c3, up, fc.0, fc.2
    for name, module in weighted.items():
        assert isinstance(module.weight_fake_quant, QuantizeBase), name
    gm(*Mixed.inputs())


@pytest.mark.parametrize(
    ("layer", "shape"),
    [(nn.ConvTranspose1d(2, 3, 2, stride=2), (2, 2, 5)), (nn.ConvTranspose3d(2, 3, 2, stride=2), (2, 2, 3, 3, 3))],
    ids=["1d", "3d"],
)
def test_other_deconvs_get_weight_quantizers(layer, shape):
    torch.manual_seed(0)
    model = nn.Sequential(layer).eval()
    gm = prepare_by_platform(model, "tensorrt")
    quantizer = gm.get_submodule("0").weight_fake_quant
    assert quantizer.is_per_channel and quantizer.ch_axis == 1  # output channels of [in, out, *kernel]
    x = torch.randn(shape)
    enable_calibration(gm)
    with torch.no_grad():
        torch.testing.assert_close(gm(x), model(x))  # calibration: float
        enable_quantization(gm)
        quantized = gm(x)
    assert not torch.equal(quantized, model(x))
    torch.testing.assert_close(quantized, model(x), atol=0.05, rtol=0.05)


@pytest.mark.parametrize(
    ("layers", "shape"),
    [
        ([nn.ConvTranspose2d(3, 5, 2)], (2, 3, 4, 4)),
        ([nn.ConvTranspose2d(3, 5, 2), nn.ReLU()], (2, 3, 4, 4)),
        ([nn.ConvTranspose2d(3, 5, 2), nn.BatchNorm2d(5), nn.ReLU()], (2, 3, 4, 4)),
    ],
    ids=["deconv", "deconv_relu", "deconv_bn_relu"],
)
@pytest.mark.parametrize("is_qat", [False, True])
def test_deconv_per_channel_weights_use_axis_1(layers, shape, is_qat):
    model = randomize_bn(nn.Sequential(*layers)).train(is_qat)
    gm = prepare_by_platform(model, "tensorrt")  # per-channel weights
    quantizer = gm.get_submodule("0").weight_fake_quant
    assert quantizer.is_per_channel
    assert quantizer.ch_axis == 1  # weight is [in, out, kh, kw]
    enable_calibration(gm)
    gm(torch.randn(shape))
    enable_quantization(gm)
    scale, _ = quantizer.export_qparams()
    assert scale.numel() == 5  # one scale per output channel, not per input channel
    weight = model[0].weight.detach()
    if len(layers) < 3:  # no BatchNorm folded into the weight
        expected = weight.abs().amax(dim=(0, 2, 3)) / 127
        torch.testing.assert_close(scale.detach(), expected, rtol=1e-3, atol=1e-6)


def test_conv_per_channel_weights_use_axis_0():
    gm = prepare_by_platform(nn.Sequential(nn.Conv2d(3, 5, 2)).eval(), "tensorrt")
    assert gm.get_submodule("0").weight_fake_quant.ch_axis == 0
