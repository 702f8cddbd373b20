"""OpenVINO on a transformer, as NNCF's transformer preset treats one: the residual adds and the attention weights x
values stay float, each activation has its own zero point, and calibration first migrates the outliers of linear
inputs into the weights (strength 0.9).

Each part is checked on small pre- and post-norm blocks against a CNN's residual block (whose adds stay
quantized), the migration against its formula computed here from the float model's activations, and the
deployed file against the simulation on this host's OpenVINO. The measured effect on all-MiniLM-L6-v2 against
NNCF is benchmarks/peers/run.py's.
"""

from __future__ import annotations

import dataclasses
import operator

import pytest
import torch
from torch import fx, nn

from backend_configs import host_config
from mqbench.advanced_ptq import calibrate
from mqbench.advanced_ptq import calibration as calibration_module
from mqbench.advanced_ptq.calibration import recipe_of
from mqbench.backends import ParamsTable, PTQRecipe, register_backend
from mqbench.convert_deploy import convert_deploy
from mqbench.deploy.verify import verify_deploy
from mqbench.fake_quantize.quantize_base import QuantizeBase
from mqbench.prepare_by_platform import prepare_by_platform

D, HIDDEN = 8, 16


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.out = (nn.Linear(D, D) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).transpose(-2, -1) * D**-0.5
        return self.out(torch.softmax(scores, dim=-1) @ self.v(x))


class HeadsAttention(nn.Module):
    """Attention over 2 heads: queries, keys and values reshaped and transposed into heads, as BERT's are."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.out = (nn.Linear(D, D) for _ in range(4))

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(x.shape[0], x.shape[1], 2, D // 2).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.heads(self.q(x)), self.heads(self.k(x)), self.heads(self.v(x))
        weights = torch.softmax(q @ k.transpose(-2, -1) * (D // 2) ** -0.5, dim=-1)
        return self.out((weights @ v).transpose(1, 2).reshape(x.shape[0], x.shape[1], D))


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, HIDDEN), nn.Linear(HIDDEN, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(nn.functional.gelu(self.fc1(x)))


class Block(nn.Module):
    """An embedding of the input, then attention and an MLP, each with its residual add and its norm."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.norm1, self.norm2 = nn.Linear(D, D), nn.LayerNorm(D), nn.LayerNorm(D)
        self.attention, self.mlp = Attention(), Mlp()


class PreNorm(Block):
    """x + attention(norm(x)), then + mlp(norm(.)): a ViT / GPT block."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class PostNorm(Block):
    """norm(x + attention(x)), then norm(. + mlp(.)): a BERT block."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        x = self.norm1(x + self.attention(x))
        return self.norm2(x + self.mlp(x))


class HeadsBlock(PostNorm):
    """A BERT block with its attention over heads."""

    def __init__(self) -> None:
        super().__init__()
        self.attention = HeadsAttention()


class Residual(nn.Module):
    """A CNN's residual block: conv -> ReLU -> conv, plus the input."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(4, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv2(torch.relu(self.conv1(x))) + x)


def tokens(seed: int, batches: int = 3) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    # one outlier channel, as a transformer's residual stream carries
    scale = torch.ones(D)
    scale[3] = 4.0
    return [torch.randn(2, 5, D, generator=generator) * scale for _ in range(batches)]


def prepared(block: type[nn.Module], config: dict | None = None) -> fx.GraphModule:
    torch.manual_seed(0)
    return prepare_by_platform(block().eval(), "openvino", config)


MOVING = {"transpose", "reshape", "view", "permute"}


def quantizer_of(model: fx.GraphModule, value: fx.Node) -> fx.Node | None:
    """The activation quantizer that computes ``value``, directly or through transposes and reshapes alone."""
    modules = dict(model.named_modules())
    while (value.target if value.op == "call_method" else getattr(value.target, "__name__", "")) in MOVING:
        value = value.args[0]
    quantizing = value.op == "call_module" and isinstance(modules.get(str(value.target)), QuantizeBase)
    return value if quantizing else None


def quantized_inputs(model: fx.GraphModule, node: fx.Node) -> list[bool]:
    """For each tensor input of ``node``: whether an activation quantizer computes it (a transpose of its output
    too: the keys of ``q @ k.transpose(-2, -1)``)."""
    return [quantizer_of(model, value) is not None for value in node.all_input_nodes]


def ops(model: fx.GraphModule, *targets: object) -> list[fx.Node]:
    return [node for node in model.graph.nodes if node.op == "call_function" and node.target in targets]


def test_the_backend_declares_the_transformer_defaults():
    spec = ParamsTable["openvino"]
    assert spec.placement.float_residual_adds and spec.placement.float_attention_values
    recipe = spec.transformer_recipe
    assert (recipe.smooth, recipe.smooth_alpha, recipe.guard_pair_saturation) == (True, 0.9, True)
    assert recipe.activation_observer is None and not recipe.bias_correction  # no clipping of outlier channels
    assert spec.transformer_activation is not None and spec.activation is not None
    assert not spec.transformer_activation.scheme.symmetric and spec.activation.scheme.symmetric
    assert spec.transformer_activation.observer == spec.activation.observer


def activation_grids(model: fx.GraphModule) -> set[tuple[int, int, bool]]:
    """(quant_min, quant_max, symmetric) of every activation quantizer."""
    return {
        (int(m.quant_min), int(m.quant_max), m.qscheme in (torch.per_tensor_symmetric, torch.per_channel_symmetric))
        for name, m in model.named_modules()
        if name.endswith("_post_act_fake_quantizer")
    }


@pytest.mark.parametrize("block", [PreNorm, PostNorm])
def test_a_transformer_s_activations_get_their_own_zero_points(block):
    """Each activation of a model with LayerNorm on [0, 255] with a zero point calibration places, as NNCF's
    transformer preset quantizes them, but the queries and keys: OpenVINO's CPU plugin runs their product in int8
    on signed symmetric inputs (as NNCF writes them), in bf16 otherwise. A CNN keeps the symmetric grid; an
    a_qscheme the user gives applies."""
    model = prepared(block)
    scores = scores_of(model)
    modules = dict(model.named_modules())
    product = {quantizer_of(model, value) for value in scores.all_input_nodes}
    for node in product:
        assert node is not None
        quantizer = modules[str(node.target)]
        assert (int(quantizer.quant_min), int(quantizer.quant_max)) == (-128, 127)
        assert quantizer.qscheme == torch.per_tensor_symmetric
    others = {
        q
        for n, q in modules.items()
        if n.endswith("_post_act_fake_quantizer")
        and n not in {str(node.target) for node in product if node is not None}
    }
    # the inputs of the embedding, of q / k / v (one norm), of out, fc1 and fc2
    assert len(others) == 5 and {(int(q.quant_min), int(q.quant_max), q.qscheme) for q in others} == {
        (0, 255, torch.per_tensor_affine)
    }
    calibrate(model, tokens(1, batches=1), recipe=PTQRecipe())  # no migration: each range is the data's own
    # the first layer's input: the tokens' own range, each end on the grid (zero point from min and max)
    quantizer = dict(model.named_modules())["x_post_act_fake_quantizer"]
    data = tokens(1, batches=1)[0]
    scale = (data.max() - data.min()) / 255
    torch.testing.assert_close(quantizer.scale.reshape(()), scale, rtol=1e-5, atol=0)
    assert int(quantizer.zero_point) == round(float(-data.min() / scale))
    assert activation_grids(prepared(Residual)) == {(-128, 127, True), (0, 255, True)}
    symmetric = prepared(block, {"extra_qconfig_dict": {"a_qscheme": {"symmetry": True}}})
    assert activation_grids(symmetric) == {(-128, 127, True)}


@pytest.mark.parametrize("saturates", [True, False])
def test_the_7_bit_guard_reads_an_asymmetric_input_as_a_signed_one(monkeypatch, saturates):
    """A CPU kernel without VNNI runs an asymmetric activation as u8 values filling the grid from its zero point
    (near 128 where the values are centred, up to 255 wherever the data reaches): pairs of 8-bit weights saturate
    as after a signed input. Every layer reading one gets 7-bit weights there, also where the zero point is 0 (the
    non-negative input of the first layer, as image pixels are), as on the symmetric signed grid it replaces; a CNN
    layer reading a ReLU's unsigned symmetric grid keeps 8 bits (test_openvino_recipe)."""
    monkeypatch.setattr(calibration_module, "int8_pairs_saturate", lambda: saturates)
    model = prepared(PreNorm)
    calibrate(model, [batch.abs() for batch in tokens(1)])  # non-negative tokens: the first layer's zero point is 0
    modules = dict(model.named_modules())
    assert int(modules["x_post_act_fake_quantizer"].zero_point) == 0
    grids = {
        name: (int(module.weight_fake_quant.quant_min), int(module.weight_fake_quant.quant_max))
        for name, module in modules.items()
        if hasattr(module, "weight_fake_quant")
    }
    assert set(grids) == {"embed", "attention.q", "attention.k", "attention.v", "attention.out", "mlp.fc1", "mlp.fc2"}
    assert set(grids.values()) == ({(-64, 63)} if saturates else {(-128, 127)})


@pytest.mark.parametrize("block", [PreNorm, PostNorm])
def test_residual_adds_and_attention_values_stay_float_in_a_transformer(block):
    model = prepared(block)
    adds = ops(model, operator.add, torch.add)
    assert len(adds) == 2
    for add in adds:
        assert quantized_inputs(model, add) == [False, False], add.format_node()
    scores, weighted = ops(model, operator.matmul, torch.matmul)
    assert quantized_inputs(model, scores) == [True, True]  # queries x keys: int8
    assert quantized_inputs(model, weighted) == [False, False]  # softmax x values: float
    for name in ("embed", "q", "k", "v", "out", "fc1", "fc2"):
        layer = next(n for n in model.graph.nodes if n.op == "call_module" and str(n.target).endswith(name))
        assert quantized_inputs(model, layer) == [True], name
    assert recipe_of(model) == ParamsTable["openvino"].transformer_recipe


def test_a_cnn_keeps_its_quantized_residual_add_and_its_recipe():
    model = prepared(Residual)
    (add,) = ops(model, operator.add, torch.add)
    assert quantized_inputs(model, add) == [True, True]
    assert recipe_of(model) == ParamsTable["openvino"].ptq_recipe


def test_calibration_migrates_linear_input_outliers_at_the_recipe_s_strength():
    float_model = PreNorm().eval()
    torch.manual_seed(0)
    float_model.load_state_dict(PreNorm().state_dict())
    model = prepared(PreNorm)
    data = tokens(1)
    seen: list[torch.Tensor] = []
    hook = float_model.mlp.fc2.register_forward_pre_hook(lambda _, args: seen.append(args[0].flatten(0, -2)))
    with torch.no_grad():
        for batch in data:
            float_model(batch)
    hook.remove()
    activation = torch.cat(seen).abs().amax(0)
    weight = float_model.mlp.fc2.weight.detach()
    # SmoothQuant's per-channel scale: max|x_j| ** alpha / max|W_:j| ** (1 - alpha), alpha 0.9
    scale = activation.clamp(min=1e-5) ** 0.9 / weight.abs().amax(0).clamp(min=1e-5) ** 0.1
    calibrate(model, data)
    smoothed = dict(model.named_modules())["mlp.fc2"].weight.detach()
    torch.testing.assert_close(smoothed, weight * scale, rtol=1e-5, atol=1e-7)


def test_recipe_rejects_a_strength_outside_0_1():
    with pytest.raises(ValueError, match="smooth_alpha must be in"):
        PTQRecipe(smooth=True, smooth_alpha=1.5)


@pytest.mark.filterwarnings("ignore:the quantized simulation is far")  # random blocks; the file is the property
@pytest.mark.parametrize("block", [PreNorm, PostNorm])
def test_the_file_serves_the_simulation(tmp_path, block):
    pytest.importorskip("openvino")
    model = prepared(block, host_config("openvino"))
    calibrate(model, tokens(1))
    result = convert_deploy(model, "openvino", {"x": [2, 5, D]}, output_path=tmp_path, model_name="m")
    report = verify_deploy(model, result, tokens(2, batches=1)[0])
    assert report.passed, report.failures()
    host = report.artifacts["openvino_onnx"].host
    assert host is not None and host.max_lsb_diff <= 1, host.diverging(1)


def scores_of(model: fx.GraphModule) -> fx.Node:
    """The matmul of queries and keys (both inputs quantized)."""
    return next(n for n in ops(model, operator.matmul, torch.matmul) if quantized_inputs(model, n) == [True, True])


def test_the_scores_inputs_are_quantized_at_the_query_and_key_layers():
    """The queries' and keys' quantizers read the q and k layers' outputs, and the heads' reshapes and transposes
    read the quantized values: OpenVINO's CPU plugin folds such a FakeQuantize into the FullyConnected before it
    (one after the reshape runs on its own). On a per-tensor grid the values are those of quantizing the scores'
    inputs themselves: the simulation is the same to the bit as with the quantizers there."""
    model = prepared(HeadsBlock)
    scores = scores_of(model)
    for value, layer in zip(scores.all_input_nodes, ("q", "k"), strict=True):
        quantizer = quantizer_of(model, value)
        assert quantizer is not None and quantizer is not value, value.format_node()
        (source,) = quantizer.all_input_nodes
        assert source.op == "call_module" and str(source.target).endswith(f"attention.{layer}"), source.format_node()
    spec = ParamsTable["openvino"]
    at_matmul = dataclasses.replace(
        spec, name="openvino_at_matmul", placement=dataclasses.replace(spec.placement, matmul_inputs_at_layers=False)
    )
    register_backend("openvino_at_matmul", at_matmul)
    try:
        torch.manual_seed(0)
        other = prepare_by_platform(HeadsBlock().eval(), "openvino_at_matmul")
        scores = scores_of(other)
        assert all(value.op == "call_module" for value in scores.all_input_nodes)  # quantized at the matmul
        for qmodel in (model, other):
            calibrate(qmodel, tokens(1))
        x = tokens(2, batches=1)[0]
        with torch.no_grad():
            assert torch.equal(model(x), other(x))
    finally:
        ParamsTable.unregister("openvino_at_matmul")


def test_the_file_runs_no_fake_quantize_of_its_own(tmp_path):
    """Deployed with dynamic batch and token axes (as a text encoder is served), the heads' quantizers are folded
    into the layers: the compiled model has no FakeQuantize left (with them after the heads' reshapes, 2 run on
    their own in float)."""
    ov = pytest.importorskip("openvino")
    model = prepared(HeadsBlock, host_config("openvino"))
    calibrate(model, tokens(1))
    dynamic = {"x": {0: "batch", 1: "tokens"}}
    result = convert_deploy(
        model, "openvino", {"x": [2, 5, D]}, output_path=tmp_path, model_name="m", dynamic_axes=dynamic
    )
    report = verify_deploy(model, result, tokens(2, batches=1)[0])
    assert report.passed, report.failures()
    compiled = ov.Core().compile_model(result.artifacts["openvino_onnx"], "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    kinds = [op.get_rt_info()["layerType"].astype(str) for op in compiled.get_runtime_model().get_ops()]
    assert "FullyConnected" in kinds and "FakeQuantize" not in kinds, sorted(set(kinds))
