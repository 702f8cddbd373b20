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
