import pytest
import torch
from torch import nn

from mqbench.fake_quantize import FixedFakeQuantize
from mqbench.utils import state


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.input_act_fake_quant = FixedFakeQuantize(quant_min=0, quant_max=255)
        self.linear = torch.nn.Linear(4, 3)
        self.weight_fake_quant = FixedFakeQuantize(
            quant_min=-127, quant_max=127, qscheme=torch.per_channel_symmetric, ch_axis=0
        )
        self.block = torch.nn.Sequential(FixedFakeQuantize(quant_min=0, quant_max=15))

    def forward(self, x):
        x = self.input_act_fake_quant(x)
        return self.block(torch.nn.functional.linear(x, self.weight_fake_quant(self.linear.weight)))


def switches(model):
    return {name: (int(q.observer_enabled[0]), int(q.fake_quant_enabled[0])) for name, q in state.quantizers(model)}


@pytest.mark.parametrize(
    ("function", "expected"),
    [
        (state.enable_calibration, (1, 0)),
        (state.enable_quantization, (0, 1)),
        (state.disable_all, (0, 0)),
        (state.enable_all, (1, 1)),
    ],
)
def test_global_switches(function, expected):
    model = Net()
    function(model)
    assert set(switches(model).values()) == {expected}


def test_calibration_and_disable_all_give_float_output():
    torch.manual_seed(0)
    model, x = Net(), torch.randn(8, 4)
    state.disable_all(model)
    reference = model(x)
    state.enable_calibration(model)
    assert torch.equal(model(x), reference)
    state.enable_quantization(model)
    assert not torch.equal(model(x), reference)
    torch.testing.assert_close(model(x), reference, atol=0.1, rtol=0.1)


def test_selective_calibration_by_quantizer_type():
    model = Net()
    state.enable_calibration_woquantization(model, quantizer_type="act_fake_quant")
    assert switches(model) == {"input_act_fake_quant": (1, 0), "weight_fake_quant": (0, 0), "block.0": (0, 0)}
    state.enable_calibration_quantization(model, quantizer_type="weight_fake_quant")
    assert switches(model) == {"input_act_fake_quant": (0, 0), "weight_fake_quant": (1, 1), "block.0": (0, 0)}


def test_quantizers_are_named_after_their_module():
    model = Net()
    state.enable_calibration(model)
    assert [q.name for _, q in state.quantizers(model)] == ["input_act_fake_quant", "weight_fake_quant", "block.0"]


def test_a_kind_is_selected_by_the_role_prepare_wrote_whatever_the_names():
    """MQBench's ``quantizer_type`` strings select a kind of quantizer: by the role on a prepared model's
    quantizers, so that a module whose name contains the other kind's string is still what it is."""
    from mqbench.prepare_by_platform import prepare_by_platform

    class Named(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight_fake_quant_head = nn.Linear(4, 4)  # its output's quantizer's name contains the string
            self.out = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(self.weight_fake_quant_head(x))

    qmodel = prepare_by_platform(Named().eval(), "tensorrt")
    state.enable_calibration_woquantization(qmodel, quantizer_type="act_fake_quant")
    on = {name for name, q in state.quantizers(qmodel) if bool(q.observer_enabled[0])}
    assert on == {"x_post_act_fake_quantizer", "weight_fake_quant_head_post_act_fake_quantizer"}
    state.enable_calibration_woquantization(qmodel, quantizer_type="weight_fake_quant")
    on = {name for name, q in state.quantizers(qmodel) if bool(q.observer_enabled[0])}
    assert on == {"weight_fake_quant_head.weight_fake_quant", "out.weight_fake_quant"}


@pytest.mark.parametrize("is_qat", [False, True], ids=["folded-at-prepare", "folding-module"])
def test_weight_quantizers_observe_what_their_layers_quantize_without_a_pass_of_the_model(is_qat):
    """calibrate's weight step reads each layer's quantized weight (the folded one where BatchNorm is folded): the
    scales are the per-channel ranges computed here, and the first layer runs once (the activation pass) only."""
    from mqbench.advanced_ptq import calibrate
    from mqbench.backends import PTQRecipe
    from mqbench.nn.intrinsic.qat.modules.bn_folding import BnFoldingModule
    from mqbench.prepare_by_platform import prepare_by_platform

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 1), nn.Flatten(), nn.Linear(144, 5)
    )
    norm = model[1]
    with torch.no_grad():
        norm.running_mean.uniform_(-1, 1)
        norm.running_var.uniform_(0.2, 3.0)
        norm.weight.uniform_(-2.0, 2.0)
    model.eval()
    factor = (norm.weight / torch.sqrt(norm.running_var + norm.eps)).detach()
    folded = model[0].weight.detach() * factor.view(-1, 1, 1, 1)
    expected = [folded, model[3].weight.detach().clone(), model[5].weight.detach().clone()]
    qmodel = prepare_by_platform(model, "tensorrt", is_qat=is_qat).eval()
    layers = [m for m in qmodel.modules() if hasattr(m, "weight_fake_quant")]
    assert len(layers) == 3 and isinstance(layers[0], BnFoldingModule) == is_qat
    runs = []
    layers[0].register_forward_pre_hook(lambda *_: runs.append(1))
    calibrate(qmodel, [torch.randn(4, 3, 8, 8)], recipe=PTQRecipe())
    assert len(runs) == 1
    for layer, weight in zip(layers, expected, strict=True):
        quantizer = layer.weight_fake_quant
        assert quantizer.symmetric and quantizer.is_per_channel
        amax = weight.abs().flatten(1).amax(dim=1)
        torch.testing.assert_close(
            quantizer.scale.detach(), amax / ((quantizer.quant_max - quantizer.quant_min) / 2), rtol=1e-6, atol=0
        )


def test_observe_weights_observes_nothing_where_a_quantizer_is_no_layers():
    net = Net()
    state.enable_calibration_woquantization(net, "weight_fake_quant")
    assert state.observe_weights(net) is False
    assert not any(q.activation_post_process.calibrated for _, q in state.quantizers(net))
