"""Mixed precision: the integer program against a brute force, the search on a trained model end to end
(deployed and verified), the backends that refuse, and MQBench's profiling calls against formulas."""

import itertools
import math

import pytest
import torch
from torch import nn

from backend_configs import academic_config
from mqbench.advanced_ptq import calibrate
from mqbench.convert_deploy import convert_deploy
from mqbench.custom_quantizer.bits import set_quantizer_bits
from mqbench.custom_quantizer.plan import plan_of
from mqbench.deploy.verify import verify_deploy
from mqbench.fake_quantize.quantize_base import QuantizeBase
from mqbench.functional import bits_of_range
from mqbench.mix_precision import (
    WeightedLayer,
    hessian_traces,
    layer_sensitivity,
    mixprecision_profiling,
    search_mixed_precision,
    solve_bit_allocation,
)
from mqbench.models.zoo import zoo_labels, zoo_model
from mqbench.prepare_by_platform import prepare_by_platform

W_BITS, A_BITS = (8, 4, 2), (8, 4)


def toy_layers():
    """Five layers; two read one activation quantizer; the first and last are held at 8 bits."""
    spec = [
        ("l0", "in", 100, 5000, True),
        ("l1", "a1", 400, 8000, False),
        ("l2", "a2", 900, 9000, False),
        ("l3", "a2", 300, 6000, False),  # shares a2 with l2
        ("l4", "a4", 200, 1000, True),
    ]
    return [WeightedLayer(name, f"{name}.w", act, params, macs, fixed, 8, 8) for name, act, params, macs, fixed in spec]


def brute_force(layers, sensitivity, size_bytes=None, bitops=None):
    weights = [layer.weight for layer in layers if not layer.fixed]
    activations = sorted({layer.activation for layer in layers if not layer.fixed} - {"in", "a4"})
    best = (math.inf, None)
    for w_choice in itertools.product(W_BITS, repeat=len(weights)):
        for a_choice in itertools.product(A_BITS, repeat=len(activations)):
            widths = {**dict(zip(weights, w_choice, strict=True)), **dict(zip(activations, a_choice, strict=True))}
            widths.update({"l0.w": 8, "l4.w": 8, "in": 8, "a4": 8})
            size = sum(layer.params * widths[layer.weight] / 8 for layer in layers)
            ops = sum(layer.macs * widths[layer.weight] * widths[layer.activation] for layer in layers)
            if (size_bytes is not None and size > size_bytes) or (bitops is not None and ops > bitops):
                continue
            cost = sum(sensitivity.get(name, {}).get(bits, 0.0) for name, bits in widths.items())
            if cost < best[0]:
                best = (cost, widths)
    return best


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("kind", ["size_bytes", "bitops", "both"])
def test_the_integer_program_finds_the_brute_force_optimum(seed, kind):
    layers = toy_layers()
    generator = torch.Generator().manual_seed(seed)
    sensitivity = {}
    for name, options in [("l1.w", W_BITS), ("l2.w", W_BITS), ("l3.w", W_BITS), ("a1", A_BITS), ("a2", A_BITS)]:
        values = sorted(torch.rand(len(options), generator=generator).tolist())  # fewer bits, more error
        sensitivity[name] = dict(zip(options, values, strict=True))
    full_size = sum(layer.params for layer in layers)  # 8-bit bytes
    full_ops = sum(layer.macs * 64 for layer in layers)
    fraction = 0.45 + 0.1 * seed
    size = fraction * full_size if kind in ("size_bytes", "both") else None
    ops = fraction * full_ops if kind in ("bitops", "both") else None
    expected_cost, expected = brute_force(layers, sensitivity, size, ops)
    chosen = solve_bit_allocation(layers, sensitivity, W_BITS, A_BITS, size, ops)
    assert expected is not None and chosen is not None
    cost = sum(sensitivity.get(name, {}).get(bits, 0.0) for name, bits in chosen.items())
    assert cost == pytest.approx(expected_cost, abs=1e-9)
    assert chosen["l0.w"] == 8 and chosen["l4.w"] == 8 and chosen["in"] == 8 and chosen["a4"] == 8
    if size is not None:
        assert sum(layer.params * chosen[layer.weight] / 8 for layer in layers) <= size + 1e-6
    if ops is not None:
        assert sum(layer.macs * chosen[layer.weight] * chosen[layer.activation] for layer in layers) <= ops + 1e-6


def test_an_impossible_budget_has_no_solution():
    layers = toy_layers()
    assert solve_bit_allocation(layers, {}, W_BITS, A_BITS, size_bytes=10.0) is None


def test_search_on_a_trained_model_meets_the_budget_deploys_and_verifies(tmp_path):
    zoo = zoo_model("resnet18")
    data = [zoo.calibration[i : i + 16] for i in range(0, 64, 16)]
    labels = zoo_labels("resnet18")

    def accuracy(qmodel):
        with torch.no_grad():
            return float((qmodel(zoo.calibration).argmax(1) == labels).float().mean())

    config = academic_config(8)
    full = sum(m.weight.numel() for m in zoo.model.modules() if isinstance(m, (nn.Conv2d, nn.Linear)))
    budget = {"size_bytes": 0.6 * full}
    result = search_mixed_precision(
        zoo.model, "academic", data, accuracy, {"weight": (8, 4, 2), "activation": (8, 4)}, budget, config
    )
    assert result.size_bytes <= budget["size_bytes"]
    assert min(w for w, _ in result.bits.values()) < 8  # the budget forces lower widths somewhere
    first, last = result.layers[0], result.layers[-1]
    assert result.bits[first.name][0] == 8 and result.bits[last.name][0] == 8  # the backend's first/last rule
    # the config prepares exactly those widths
    qmodel = calibrate(prepare_by_platform(zoo.model, "academic", result.config), data)
    named = dict(qmodel.named_modules())
    for layer in result.layers:
        w = named[layer.weight]
        assert bits_of_range(w.quant_min, w.quant_max) == result.bits[layer.name][0], layer.name
        if layer.activation is not None:
            a = named[layer.activation]
            assert bits_of_range(a.quant_min, a.quant_max) == result.bits[layer.name][1], layer.name
    assert result.accuracy == pytest.approx(accuracy(qmodel))
    x = zoo.evaluation[:2]
    deployed = convert_deploy(qmodel, "academic", {"x": list(x.shape)}, output_path=tmp_path, model_name="mixed")
    report = verify_deploy(qmodel, deployed, x)
    assert report.passed, report.failures()


def test_backends_with_one_width_refuse():
    zoo = zoo_model("resnet18")
    with pytest.raises(ValueError, match="academic"):
        search_mixed_precision(zoo.model, "tensorrt", [zoo.calibration[:8]], candidates={"weight": (8, 4)})
    with pytest.raises(ValueError, match="academic"):
        prepare_by_platform(zoo.model, "tensorrt", {"quantizer_bits": {"conv1.weight_fake_quant": 4}})
    with pytest.raises(ValueError, match=r"did you mean conv1\.weight_fake_quant"):
        prepare_by_platform(zoo.model, "academic", {**academic_config(8), "quantizer_bits": {"conv1.weight_fq": 4}})
    qmodel = prepare_by_platform(zoo.model, "nnie")
    with pytest.raises(ValueError, match="fixed log grid"):
        set_quantizer_bits(dict(qmodel.named_modules())["conv1.weight_fake_quant"], 4)


def test_the_plan_states_the_widths_quantizer_bits_set():
    """The plan records every quantizer's width as the quantizer has it (read back from its integer range here),
    and the weight grids it describes are those widths."""
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 2)).eval()
    config = {**academic_config(8), "quantizer_bits": {"2.weight_fake_quant": 4, "_2_post_act_fake_quantizer": 6}}
    qmodel = prepare_by_platform(model, "academic", config)
    plan = plan_of(qmodel)
    quantizers = {n: m for n, m in qmodel.named_modules() if isinstance(m, QuantizeBase)}
    assert plan.widths == {n: bits_of_range(int(m.quant_min), int(m.quant_max)) for n, m in quantizers.items()}
    assert plan.widths["2.weight_fake_quant"] == 4 and plan.widths["_2_post_act_fake_quantizer"] == 6
    assert "[-8, 7]" in plan.weights["_2"] and "[-128, 127]" in plan.weights["_0"]


def test_hawq_trace_is_the_hessian_trace_written_out():
    """For a linear layer under mean squared error on orthogonal inputs the Hessian is diagonal, so every
    Rademacher probe gives its trace exactly: 2 / N * sum ||x_n||^2."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 3))
    inputs = torch.diag(torch.tensor([1.0, 2.0, 0.5, 3.0, 1.5, 0.25]))  # N = 6 orthogonal rows
    targets = torch.randn(6, 3)
    traces = hessian_traces(model, inputs, targets, nn.MSELoss())
    expected = 2.0 / 6 * float(inputs.pow(2).sum())
    assert traces["0"] == pytest.approx(expected, rel=1e-5)
    assert mixprecision_profiling(model, None, (inputs, targets), nn.MSELoss(), "hawq_trace")["0"] == pytest.approx(
        expected
    )
    # the diagonal's largest entry, 2 / (N * outputs) * max_i x_ii^2, is the largest eigenvalue (MQBench's hawq)
    largest = mixprecision_profiling(model, None, (inputs, targets), nn.MSELoss(), "hawq")["0"]
    assert largest == pytest.approx(2.0 / (6 * 3) * 9.0, rel=1e-5)


def test_naive_profiling_is_the_loss_with_one_layer_quantized():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    inputs, targets = torch.randn(32, 8), torch.randn(32, 4)
    qmodel = calibrate(prepare_by_platform(model, "academic", academic_config(4)), [inputs])
    scores = mixprecision_profiling(model, qmodel, (inputs, targets), nn.MSELoss(), "naive")
    assert set(scores) == {"0", "2"}
    named = dict(qmodel.named_modules())
    for name, layer in (("0", model[0]), ("2", model[2])):
        q = named[f"{name}.weight_fake_quant"]
        scale, zero = q.export_qparams()
        s, z = scale[:, None], zero[:, None].float()
        w = (torch.clamp(torch.round(layer.weight / s) + z, q.quant_min, q.quant_max) - z) * s
        with torch.no_grad():
            hidden = torch.relu(nn.functional.linear(inputs, w if name == "0" else model[0].weight, model[0].bias))
            out = nn.functional.linear(hidden, w if name == "2" else model[2].weight, model[2].bias)
        assert scores[name] == pytest.approx(float(nn.MSELoss()(out, targets)), rel=1e-5)


@pytest.mark.parametrize("method", ["loss", "hessian", "fisher", "taylor"])
def test_layer_sensitivity_scores_are_their_formulas(method):
    """One linear layer under mean squared error on orthogonal inputs (a diagonal Hessian, so Hutchinson's
    trace is exact); each score recomputed from the float gradient and the quantization error written here."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 3)).eval()
    inputs = torch.diag(torch.tensor([1.0, 2.0, 0.5, 3.0, 1.5, 0.25]))
    targets = torch.randn(6, 3)
    qmodel = calibrate(prepare_by_platform(model, "academic", academic_config(8)), [inputs])
    scores = layer_sensitivity(qmodel, [(inputs, targets)], nn.MSELoss(), method, bits=3)
    q = dict(qmodel.named_modules())["0.weight_fake_quant"]
    assert bits_of_range(q.quant_min, q.quant_max) == 8  # the width is restored
    set_quantizer_bits(q, 3)
    scale, zero = q.export_qparams()
    set_quantizer_bits(q, 8)
    w, b = model[0].weight.detach(), model[0].bias.detach()
    s, z = scale[:, None], zero[:, None].float()
    quantized = (torch.clamp(torch.round(w / s) + z, -4, 3) - z) * s
    d = quantized - w
    weight = w.clone().requires_grad_()
    loss = nn.MSELoss()(nn.functional.linear(inputs, weight, b), targets)
    (g,) = torch.autograd.grad(loss, weight)
    expected = {
        "loss": float(nn.MSELoss()(nn.functional.linear(inputs, quantized, b), targets) - loss.detach()),
        "hessian": 2.0 / 6 * float(inputs.pow(2).sum()) / w.numel() * float(d.pow(2).sum()),
        "fisher": float((g.pow(2) * d.pow(2)).sum()),
        "taylor": abs(float((g * d).sum())),
    }[method]
    assert scores["0"] == pytest.approx(expected, rel=1e-4)


@pytest.mark.parametrize(
    ("candidates", "error", "message"),
    [
        ([(8, 8), (4, 8)], TypeError, r"candidates must be a mapping .* got list \[\(8, 8\), \(4, 8\)\]"),
        ({8: 8, 4: 8}, ValueError, r"takes the keys 'weight' and 'activation', not 8, 4"),
        ({"weight": (8, 1)}, ValueError, r"candidates\['weight'\] must be a non-empty list of bit widths from 2 to 8"),
        ({"activation": []}, ValueError, r"candidates\['activation'\] must be a non-empty list"),
    ],
)
def test_candidates_of_another_form_are_refused_with_the_form_to_write(candidates, error, message):
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()).eval()
    with pytest.raises(error, match=message):
        search_mixed_precision(model, "academic", [torch.randn(2, 3, 8, 8)], candidates=candidates)


@pytest.mark.parametrize(
    ("budget", "message"),
    [
        (12345, r"budget is a mapping such as \{'size_bytes': 12345\} or \{'bitops': N\}, not int 12345"),
        ({"bytes": 10}, r"budget takes 'size_bytes' and/or 'bitops', not bytes"),
        ({"size_bytes": -1}, r"budget 'size_bytes' must be a positive number, got -1"),
        ({"bitops": "1e9"}, r"budget 'bitops' must be a positive number, got '1e9'"),
    ],
)
def test_a_budget_of_another_form_is_refused_with_the_form_to_write(budget, message):
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()).eval()
    with pytest.raises(ValueError, match=message):
        search_mixed_precision(model, "academic", [torch.randn(2, 3, 8, 8)], budget=budget)
