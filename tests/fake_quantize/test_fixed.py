import numpy as np
import pytest
import torch

from mqbench.fake_quantize import FakeQuantizeDict, FixedFakeQuantize, QuantizeBase, register_fake_quantize
from mqbench.observer import EMAMinMaxObserver, MinMaxObserver, NonFiniteInputError
from onnx_helpers import export_onnx, reload, run_onnx

SCHEMES = {
    "int8_sym_full": dict(quant_min=-128, quant_max=127, qscheme=torch.per_tensor_symmetric),
    "int8_sym_narrow": dict(quant_min=-127, quant_max=127, qscheme=torch.per_tensor_symmetric),
    "uint8_affine": dict(quant_min=0, quant_max=255, qscheme=torch.per_tensor_affine),
    "int4_affine": dict(quant_min=0, quant_max=15, qscheme=torch.per_tensor_affine),
    "int4_sym": dict(quant_min=-8, quant_max=7, qscheme=torch.per_tensor_symmetric),
    "uint8_unsigned_sym": dict(quant_min=0, quant_max=255, qscheme=torch.per_tensor_symmetric),
    "int16_sym": dict(quant_min=-32768, quant_max=32767, qscheme=torch.per_tensor_symmetric),
    "int8_pc_axis1": dict(quant_min=-127, quant_max=127, qscheme=torch.per_channel_symmetric, ch_axis=1),
    "uint4_pc_axis1": dict(quant_min=0, quant_max=15, qscheme=torch.per_channel_affine, ch_axis=1),
}


def calibrated(kwargs, data):
    fq = FixedFakeQuantize(MinMaxObserver, **kwargs)
    fq.disable_fake_quant()
    fq(data)
    fq.enable_fake_quant()
    fq.disable_observer()
    return fq


def activation_batch(batch, seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 6, 5, 5, generator=generator) * torch.linspace(0.2, 3, 6).reshape(1, 6, 1, 1) + 0.3


@pytest.mark.parametrize("name", SCHEMES)
def test_onnx_export_matches_pytorch_bit_for_bit(name, dynamo, tmp_path):
    fq = calibrated(SCHEMES[name], activation_batch(8, 0))
    model = export_onnx(torch.nn.Sequential(fq), activation_batch(2, 1), dynamo, tmp_path)
    ops = {node.op_type for node in model.graph.node}
    if fq.bitwidth <= 8:
        assert {"QuantizeLinear", "DequantizeLinear"} <= ops
    for batch, seed in ((3, 2), (7, 3)):
        x = activation_batch(batch, seed) * 1.3  # some values beyond the calibrated range
        with torch.no_grad():
            expected = fq(x).numpy()
        np.testing.assert_array_equal(run_onnx(model, x), expected)


def test_switches_calibration_and_float():
    x = torch.randn(100)
    fq = FixedFakeQuantize(EMAMinMaxObserver, quant_min=0, quant_max=15)
    fq.disable_fake_quant()
    assert torch.equal(fq(x), x)  # calibration returns the float input
    assert fq.activation_post_process.calibrated
    fq.enable_fake_quant()
    fq.disable_observer()
    before = fq.scale.clone()
    out = fq(x * 10)
    assert torch.equal(fq.scale, before)  # observer off: qparams frozen
    assert len(torch.unique(out)) <= 16
    # the buffers are the source of truth, also when written directly (as MQBench scripts do)
    fq.fake_quant_enabled[0] = 0
    assert torch.equal(fq(x), x)


@pytest.mark.parametrize("kwargs", [SCHEMES["uint8_affine"], SCHEMES["int8_pc_axis1"]])
def test_state_dict_loads_into_fresh_instance(kwargs):
    fq = calibrated(kwargs, activation_batch(4, 0))
    fresh = FixedFakeQuantize(MinMaxObserver, **kwargs)
    fresh.load_state_dict(reload(fq.state_dict()))
    x = activation_batch(5, 9) * 2
    with torch.no_grad():
        assert torch.equal(fresh(x), fq(x))
    assert torch.equal(fresh.activation_post_process.max_val, fq.activation_post_process.max_val)


def test_non_finite_input_names_the_quantizer():
    model = torch.nn.Sequential(torch.nn.Identity(), FixedFakeQuantize(quant_min=0, quant_max=255))
    from mqbench.utils.state import enable_calibration

    enable_calibration(model)
    with pytest.raises(NonFiniteInputError, match=r"MinMaxObserver of quantizer '1' received NaN"):
        model(torch.tensor([1.0, float("nan")]))
    with pytest.raises(ValueError, match="infinite"):
        model(torch.tensor([1.0, float("inf")]))


def test_wrong_rank_per_channel_axis():
    fq = FixedFakeQuantize(quant_min=-128, quant_max=127, qscheme=torch.per_channel_symmetric, ch_axis=2)
    with pytest.raises(ValueError, match="ch_axis=2 is out of range for a 2-D tensor"):
        fq(torch.randn(3, 4))


def test_with_args_and_registry():
    factory = FixedFakeQuantize.with_args(observer=MinMaxObserver, quant_min=0, quant_max=15)
    fq = factory()
    assert isinstance(fq, FixedFakeQuantize) and fq.quant_max == 15
    assert factory(quant_max=7).quant_max == 7
    assert FakeQuantizeDict["FixedFakeQuantize"] is FixedFakeQuantize

    class MyQuantizer(FixedFakeQuantize):
        pass

    assert register_fake_quantize(MyQuantizer) is MyQuantizer
    assert FakeQuantizeDict["MyQuantizer"] is MyQuantizer
    with pytest.raises(ValueError, match="already registered"):
        register_fake_quantize(type("MyQuantizer", (FixedFakeQuantize,), {}))
    with pytest.raises(ValueError, match="QuantizeBase subclass"):
        register_fake_quantize(int)  # type: ignore[arg-type]
    with pytest.raises(KeyError, match="unknown fake quantizer 'Nope'"):
        FakeQuantizeDict["Nope"]
    assert issubclass(MyQuantizer, QuantizeBase)


def test_observer_argument_errors():
    with pytest.raises(ValueError, match="give both quant_min and quant_max"):
        MinMaxObserver(quant_min=0)
    with pytest.raises(ValueError, match="must be below quant_max"):
        MinMaxObserver(quant_min=5, quant_max=5)
    with pytest.raises(ValueError, match="unsupported qscheme"):
        MinMaxObserver(qscheme=torch.per_channel_affine_float_qparams)
