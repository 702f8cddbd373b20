"""SmoothQuant migration: the formula, the float function kept, the residual branch untouched, the
backend's default recipe, and deployment of a smoothed model."""

from __future__ import annotations

import io
import operator

import pytest
import torch
from torch import nn

from mqbench.advanced_ptq import ChannelScale, calibrate, restore_smoothing, smooth_quant
from mqbench.backends import ParamsTable
from mqbench.convert_deploy import convert_deploy
from mqbench.deploy.verify import verify_deploy
from mqbench.models import bert_tiny
from mqbench.prepare_by_platform import prepare_by_platform
from mqbench.utils.state import disable_all

ACADEMIC_W8A8 = {
    "extra_qconfig_dict": {
        "w_qscheme": {"bit": 8, "symmetry": True, "per_channel": True, "pot_scale": False},
        "a_qscheme": {"bit": 8, "symmetry": True, "per_channel": False, "pot_scale": False},
        "w_observer": "MinMaxObserver",
        "a_observer": "MinMaxObserver",
        "w_fakequantize": "FixedFakeQuantize",
        "a_fakequantize": "FixedFakeQuantize",
    }
}


class NormThenTwoLinears(nn.Module):
    """A LayerNorm whose output feeds two linear layers and a residual add (a post-LN transformer's shape)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.q = nn.Linear(16, 16)
        self.k = nn.Linear(16, 16)
        with torch.no_grad():
            self.norm.weight.copy_(torch.linspace(0.2, 1.0, 16))
            self.norm.weight[3] = 40.0  # an outlier channel, as BERT's LayerNorms have
            self.norm.weight[11] = -25.0

    def forward(self, x):
        h = self.norm(x)
        return self.q(h) * self.k(h) + h


def outlier_batches(count: int = 4) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(8, 5, 16, generator=generator) for _ in range(count)]


def test_the_migration_is_the_formula_and_keeps_the_float_function():
    torch.manual_seed(0)
    model = NormThenTwoLinears().eval()
    data = outlier_batches()
    qmodel = prepare_by_platform(model, "academic_nlp", ACADEMIC_W8A8)
    disable_all(qmodel)
    before = [qmodel(x) for x in data]
    chosen = smooth_quant(qmodel, data, alpha=0.5)
    assert list(chosen.values()) == [0.5]
    # s_j = a_j^alpha / w_j^(1 - alpha): a_j the largest |input| of channel j, w_j the largest |weight| of column j
    a = torch.stack([model.norm(x).abs().amax((0, 1)) for x in data]).amax(0)
    w = torch.maximum(model.q.weight.abs().amax(0), model.k.weight.abs().amax(0))
    s = a.sqrt() / w.sqrt()
    (scale,) = [m for m in qmodel.modules() if isinstance(m, ChannelScale)]
    torch.testing.assert_close(scale.scale, 1 / s, rtol=1e-5, atol=0)
    torch.testing.assert_close(qmodel.get_submodule("q").weight, model.q.weight * s, rtol=1e-5, atol=1e-7)
    disable_all(qmodel)
    for x, y in zip(data, before, strict=True):
        torch.testing.assert_close(qmodel(x), y, rtol=1e-5, atol=1e-5)
    # the residual add reads the LayerNorm's float output, not the scaled one
    (add,) = [n for n in qmodel.graph.nodes if n.target is operator.add]
    assert add.args[1].target == "norm"
    (smoothed,) = [n for n in qmodel.graph.nodes if n.op == "call_module" and n.target.endswith("_smoothing")]
    assert smoothed.args[0].target == "norm"


def quantized_error(qmodel: nn.Module, model: nn.Module, data: list[torch.Tensor]) -> float:
    with torch.no_grad():
        return sum(float((qmodel(x) - model(x)).square().sum()) for x in data)


def test_the_searched_migration_lowers_the_error_of_outlier_inputs():
    torch.manual_seed(0)
    model = NormThenTwoLinears().eval()
    data, held_out = outlier_batches(6)[:4], outlier_batches(6)[4:]
    plain = calibrate(prepare_by_platform(model, "academic_nlp", ACADEMIC_W8A8), data, smooth=False)
    smoothed = calibrate(prepare_by_platform(model, "academic_nlp", ACADEMIC_W8A8), data, smooth=True)
    assert any(isinstance(m, ChannelScale) for m in smoothed.modules())
    assert quantized_error(smoothed, model, held_out) < quantized_error(plain, model, held_out)


def bert_with_outliers() -> nn.Module:
    torch.manual_seed(0)
    model = bert_tiny(vocab_size=50, dim=32, depth=1, heads=2, max_len=16).eval()
    with torch.no_grad():
        model.layers[0].norm1.weight[5] = 30.0  # outlier channels in the residual stream's LayerNorm
    return model


def token_batches(count: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        mask = torch.ones(4, 10, dtype=torch.long)
        mask[1, 7:] = 0
        batches.append({"input_ids": torch.randint(0, 50, (4, 10), generator=generator), "attention_mask": mask})
    return batches


def test_the_nlp_backend_s_calibration_smooths_and_the_others_do_not():
    model = bert_with_outliers()
    data = token_batches(3)
    assert ParamsTable["tensorrt_nlp"].smooth_linear_inputs
    for backend, expected in (("tensorrt_nlp", True), ("tensorrt", False)):
        qmodel = calibrate(prepare_by_platform(model, backend), data)
        assert any(isinstance(m, ChannelScale) for m in qmodel.modules()) is expected, backend
    qmodel = calibrate(prepare_by_platform(model, "tensorrt_nlp"), data, smooth=False)
    assert not any(isinstance(m, ChannelScale) for m in qmodel.modules())


@pytest.mark.parametrize("backend", ["tensorrt_nlp", "academic_nlp", "openvino"])
def test_a_smoothed_model_deploys_and_verifies(backend, tmp_path):
    model = bert_with_outliers()
    data = token_batches(3)
    config = ACADEMIC_W8A8 if backend == "academic_nlp" else None
    qmodel = calibrate(prepare_by_platform(model, backend, config), data, smooth=True)
    assert any(isinstance(m, ChannelScale) for m in qmodel.modules())
    result = convert_deploy(qmodel, backend, dummy_input=(token_batches(1, seed=5)[0],), output_path=tmp_path)
    report = verify_deploy(qmodel, result, token_batches(1, seed=7)[0])
    assert report.max_lsb_diff <= ParamsTable[backend].lsb_tolerance, report.summary()


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="takes the model prepare_by_platform returned"):
        smooth_quant(NormThenTwoLinears(), outlier_batches(1))
    qmodel = prepare_by_platform(NormThenTwoLinears().eval(), "academic_nlp", ACADEMIC_W8A8)
    with pytest.raises(ValueError, match=r"alpha must be in \[0, 1\]"):
        smooth_quant(qmodel, outlier_batches(1), alpha=1.5)


def test_a_saved_smoothed_model_reloads_into_a_fresh_prepared_one_bit_for_bit():
    model = bert_with_outliers()
    data = token_batches(3)
    qmodel = calibrate(prepare_by_platform(model, "tensorrt_nlp"), data)
    buffer = io.BytesIO()
    torch.save(qmodel.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    fresh = prepare_by_platform(model, "tensorrt_nlp")
    with pytest.raises(RuntimeError, match=r"_smoothing\.scale"):  # without the scale nodes it cannot load
        fresh.load_state_dict(saved)
    fresh = prepare_by_platform(model, "tensorrt_nlp")
    added = restore_smoothing(fresh, saved)
    assert added and added == sorted(n for n, m in qmodel.named_modules() if isinstance(m, ChannelScale))
    fresh.load_state_dict(saved)
    for module in (qmodel, fresh):
        module.eval()
    batch = token_batches(1, seed=9)[0]
    with torch.no_grad():
        assert torch.equal(fresh(**batch), qmodel(**batch))
    assert restore_smoothing(prepare_by_platform(model, "tensorrt_nlp"), {"other.weight": torch.ones(1)}) == []


def test_restoring_smoothing_for_a_quantizer_the_model_lacks_is_refused():
    qmodel = prepare_by_platform(NormThenTwoLinears().eval(), "academic_nlp", ACADEMIC_W8A8)
    with pytest.raises(ValueError, match="activation quantizer 'no_such_quantizer', which this model does not have"):
        restore_smoothing(qmodel, {"no_such_quantizer_smoothing.scale": torch.ones(16)})


def test_calibrating_again_after_a_change_gives_the_ranges_of_a_fresh_calibration():
    """A calibrated model calibrated again with smoothing (as after a rotation, which calibrates) quantizes with the
    ranges of the smoothed model only, as if it were calibrated once: the first ranges (of the outlier channels
    smoothing removes) are forgotten."""
    model, data = NormThenTwoLinears(), outlier_batches()
    again = calibrate(prepare_by_platform(model, "academic_nlp", ACADEMIC_W8A8), data, smooth=False)
    calibrate(again, data, smooth=True)
    once = calibrate(prepare_by_platform(model, "academic_nlp", ACADEMIC_W8A8), data, smooth=True)
    scales = {name: buffer for name, buffer in once.state_dict().items() if name.endswith(("scale", "zero_point"))}
    assert len(scales) >= 6
    for name, expected in scales.items():
        torch.testing.assert_close(again.state_dict()[name], expected, rtol=0, atol=0, msg=name)
    with torch.no_grad():
        torch.testing.assert_close(again(data[0]), once(data[0]), rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["tensorrt_nlp", "openvino"])
def test_calibrate_smooths_and_calibrates_in_one_pass_as_two_passes_would(backend):
    """Smoothing and calibration share one pass where the smoothed inputs' observers are running min/max ones: the
    first smoothed quantizer's range is the one it observes of the scaled input in a pass of its own, bit for bit
    (its input is the same tensor, and max(x * c) = max(x) * c), every range within float32 rounding (a smoothed
    layer computes its output from scaled operands), and the model runs once per batch instead of twice."""
    model = bert_with_outliers()
    data = token_batches(3)
    one = prepare_by_platform(model, backend)
    calls: list[int] = []
    embedding = next(m for m in one.modules() if isinstance(m, nn.Embedding))
    embedding.register_forward_hook(lambda *_: calls.append(1))
    calibrate(one, data, smooth=True)
    assert len(calls) == len(data)  # one pass (the weights are read from their layers)

    two = prepare_by_platform(model, backend)  # smoothing's pass, then calibration's
    recipe = ParamsTable[backend].transformer_recipe
    smooth_quant(two, data, alpha=recipe.smooth_alpha)
    calibrate(two, data, smooth=False)

    scales = {n for n, m in one.named_modules() if isinstance(m, ChannelScale)}
    smoothed = [str(n.target) for n in one.graph.nodes if n.op == "call_module" and str(n.target) in scales]
    assert smoothed and set(smoothed) == {n for n, m in two.named_modules() if isinstance(m, ChannelScale)}
    observers = {
        name: (m.activation_post_process.min_val, m.activation_post_process.max_val)
        for name, m in two.named_modules()
        if hasattr(m, "activation_post_process")
    }
    for name, quantizer in one.named_modules():
        if not hasattr(quantizer, "activation_post_process"):
            continue
        got = (quantizer.activation_post_process.min_val, quantizer.activation_post_process.max_val)
        want = observers[name]
        if f"{name}_smoothing" == smoothed[0]:  # upstream of it nothing is smoothed
            assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), name
        for g, w in zip(got, want, strict=True):  # float32 sums of a few dozen products, in another order
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6 * float(w.abs().max()), msg=name)
