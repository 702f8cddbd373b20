"""prepare_by_platform options: is_qat, freeze_bn, extra_fuse_dict."""

import pytest
import torch
from torch import nn

from mqbench.nn import qat as nnqat
from mqbench.nn.intrinsic import FusedModule
from mqbench.prepare_by_platform import prepare_by_platform
from mqbench.utils.state import disable_all, enable_calibration


def conv_bn_relu():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())


def test_qat_keeps_batchnorm_and_freeze_bn_stops_its_statistics():
    prepared = prepare_by_platform(conv_bn_relu().train(), "tensorrt", freeze_bn=True)
    layer = prepared.get_submodule("0")
    assert type(layer).__name__ == "ConvBnReLU2d" and layer.freeze_bn
    before = layer.bn.running_mean.clone()
    enable_calibration(prepared)
    prepared(torch.randn(4, 3, 8, 8) + 3)
    assert torch.equal(layer.bn.running_mean, before)

    unfrozen = prepare_by_platform(conv_bn_relu().train(), "tensorrt")
    enable_calibration(unfrozen)
    unfrozen(torch.randn(4, 3, 8, 8) + 3)
    assert not torch.equal(unfrozen.get_submodule("0").bn.running_mean, before)


def test_is_qat_overrides_the_model_mode():
    ptq = prepare_by_platform(conv_bn_relu().train(), "tensorrt", is_qat=False)
    assert ptq.training  # the mode is kept ...
    assert not any(isinstance(m, nn.BatchNorm2d) for m in ptq.modules())  # ... but BatchNorm is folded
    qat = prepare_by_platform(conv_bn_relu().eval(), "tensorrt", is_qat=True)
    assert not qat.training
    assert hasattr(qat.get_submodule("0"), "bn")


class LinearTanh(FusedModule):
    PARTS = (("Linear", (nn.Linear,)), ("activation", (nn.Tanh,)))


class QATLinearTanh(nnqat.Linear):
    _FLOAT_MODULE = LinearTanh

    def forward(self, x):
        return torch.tanh(super().forward(x))


def _fuse_linear_tanh(linear, tanh):  # MQBench's documented form: one argument per op, no is_qat
    return LinearTanh(linear, tanh)


@pytest.mark.parametrize(
    "fuser", [lambda is_qat, linear, tanh: LinearTanh(linear, tanh), _fuse_linear_tanh], ids=["is_qat", "two_args"]
)
def test_extra_fuse_dict_adds_a_pattern_and_its_qat_module(fuser):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 2)).eval()
    config = {
        "extra_fuse_dict": {
            "additional_fuser_method_mapping": {(nn.Linear, nn.Tanh): fuser},
            "additional_qat_module_mapping": {LinearTanh: QATLinearTanh},
        }
    }
    prepared = prepare_by_platform(model, "tensorrt", config)
    fused = prepared.get_submodule("0")
    assert isinstance(fused, QATLinearTanh) and hasattr(fused, "weight_fake_quant")
    called = [prepared.get_submodule(str(n.target)) for n in prepared.graph.nodes if n.op == "call_module"]
    assert not any(isinstance(m, nn.Tanh) for m in called)  # the Tanh runs inside the fused module
    disable_all(prepared)
    x = torch.randn(3, 6)
    torch.testing.assert_close(prepared(x), model(x))


class _FusedAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)


def test_fused_attention_on_a_matmul_quantizing_backend_is_named_in_a_warning():
    import warnings

    import pytest

    model = _FusedAttention().eval()
    named = r"scaled_dot_product_attention \(1 call\(s\).*attn_implementation=\"eager\""
    for backend in ("tensorrt_nlp", "tensorrt"):
        with pytest.warns(UserWarning, match=named):
            prepare_by_platform(model, backend)
    with warnings.catch_warnings():  # NNIE's placement quantizes no matmul input: nothing to say
        warnings.simplefilter("error")
        prepare_by_platform(model, "nnie")


class _Crnn(nn.Module):
    """A CRNN's shape: a convolutional feature extractor, a bidirectional LSTM over the columns, a classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 16, 3, padding=1)
        self.rnn = nn.LSTM(16, 32, bidirectional=True, batch_first=True)
        self.fc = nn.Linear(64, 10)

    def forward(self, x):
        features = torch.relu(self.conv(x)).mean(2).transpose(1, 2)  # [N, W, C]
        return self.fc(self.rnn(features)[0])


def test_layers_left_in_float_are_named_with_their_share_of_the_weights():
    import warnings

    model = _Crnn().eval()
    lstm = sum(p.numel() for n, p in model.rnn.named_parameters() if "weight" in n)
    total = lstm + model.conv.weight.numel() + model.fc.weight.numel()
    with pytest.warns(UserWarning, match="leaves 1 layer") as caught:
        prepare_by_platform(model, "tensorrt")
    (message,) = [str(w.message) for w in caught if "in float" in str(w.message)]
    assert f"{lstm / total:.1%} of the model's weights: rnn (LSTM, {lstm / total:.1%})" in message, message
    with warnings.catch_warnings():  # a layer the user excluded is not reported as left out
        warnings.simplefilter("error")
        prepare_by_platform(model, "tensorrt", {"extra_quantizer_dict": {"exclude_node_name": ["rnn"]}})


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).eval()


def test_prepared_in_place_the_weights_are_the_models_own():
    """``inplace``: one copy of the weights (the prepared layers hold the model's own tensors); the default keeps
    the model apart: rounding the prepared weights leaves the model's as they were."""
    model = _mlp()
    shared = prepare_by_platform(model, "llm_w4a16", {"inplace": True})
    for name in ("0", "2"):
        assert shared.get_submodule(name).weight is model.get_submodule(name).weight
        assert shared.get_submodule(name).bias is model.get_submodule(name).bias

    model = _mlp()
    before = {name: value.clone() for name, value in model.state_dict().items()}
    apart = prepare_by_platform(model, "llm_w4a16")
    with torch.no_grad():
        apart.get_submodule("0").weight.mul_(2)
    assert apart.get_submodule("0").weight.data_ptr() != model.get_submodule("0").weight.data_ptr()
    assert all(torch.equal(before[name], value) for name, value in model.state_dict().items())


def test_inplace_must_be_a_bool():
    with pytest.raises(ValueError, match=r"prepare_custom_config_dict\['inplace'\] must be True or False, got 'yes'"):
        prepare_by_platform(_mlp(), "llm_w4a16", {"inplace": "yes"})
