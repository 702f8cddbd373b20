"""hadamard_rotation: the matrices are orthogonal, the rotated model computes the float model's function with the
stream rotated by exactly that matrix, a norm-scale outlier stops costing activation precision, the rotated model
deploys and verifies, a post-norm encoder's MLPs alone are rotated on request, and models it cannot rotate are
refused naming why."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from tests.backend_configs import host_config
from torch import nn

from mqbench.advanced_ptq import ROTATION_DEFAULTS, calibrate, gptq, hadamard_rotation
from mqbench.advanced_ptq.rotation import hadamard_matrix, mlp_down_projections, orthogonal_matrix
from mqbench.backends import PTQRecipe
from mqbench.convert_deploy import convert_deploy
from mqbench.deploy.verify import verify_deploy
from mqbench.models.decoder import TinyGPT
from mqbench.models.transformers import bert_tiny
from mqbench.prepare_by_platform import prepare_by_platform
from mqbench.utils.state import disable_all, enable_quantization, quantizers

DIM, DEPTH = 32, 2


def _decoder(seed: int = 0) -> TinyGPT:
    """A small decoder with LayerNorm scales and shifts and biases far from their defaults (all of them folded)."""
    torch.manual_seed(seed)
    model = TinyGPT(dim=DIM, depth=DEPTH, heads=2, context=16).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.LayerNorm):
                module.weight.uniform_(0.5, 2.0)
                module.bias.normal_(0.0, 0.3)
            if isinstance(module, nn.Linear) and module.bias is not None:  # the output layer has none
                module.bias.normal_(0.0, 0.1)
    return model


def _ids(seed: int, n: int = 4) -> torch.Tensor:
    return torch.randint(0, 256, (n, 16), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("n", [1, 2, 4, 12, 20, 24, 128, 384, 768])
def test_hadamard_matrices_have_entries_of_one_and_orthogonal_rows(n):
    H = hadamard_matrix(n)
    assert H.shape == (n, n) and bool((H.abs() == 1).all())
    torch.testing.assert_close(H @ H.T, n * torch.eye(n, dtype=torch.float64), rtol=0, atol=0)


def test_sizes_without_a_construction_are_refused_and_random_rotations_are_orthogonal():
    with pytest.raises(ValueError, match=r"no Hadamard matrix of size 6.*'random'"):
        hadamard_matrix(6)
    for rotation in ("hadamard", "random"):
        Q = orthogonal_matrix(24, rotation, seed=3)
        torch.testing.assert_close(Q @ Q.T, torch.eye(24, dtype=torch.float64), rtol=0, atol=1e-12)
    assert not torch.equal(orthogonal_matrix(24, "hadamard", 0), orthogonal_matrix(24, "hadamard", 1))


@pytest.mark.parametrize("backend", ["tensorrt_nlp", "llm_w4a16"])
@pytest.mark.parametrize("ffn", [False, True])
def test_the_rotated_model_computes_the_float_function_on_a_rotated_stream(backend, ffn):
    model = _decoder()
    ids = _ids(1)
    with torch.no_grad():
        expected = model(ids)
    inputs: dict[str, list[torch.Tensor]] = {"float": [], "rotated": []}

    def keep(which: str):
        return lambda module, args: inputs[which].append(args[0].detach().double())

    model.blocks[1].norm2.register_forward_pre_hook(keep("float"))
    with torch.no_grad():
        model(ids)
    qmodel = hadamard_rotation(prepare_by_platform(model, backend), [_ids(2)], {"ffn": ffn})
    report = qmodel.meta["rotation"]["streams"][0]
    assert report["dim"] == DIM and len(report["norms"]) == 2 * DEPTH + 1
    assert qmodel.meta["rotation"]["online"] == ([f"blocks.{i}.proj" for i in range(DEPTH)] if ffn else [])
    assert sum(isinstance(m, nn.RMSNorm) for m in qmodel.modules()) == 2 * DEPTH + 1
    qmodel.get_submodule("blocks.1.norm2").register_forward_pre_hook(keep("rotated"))
    disable_all(qmodel)
    with torch.no_grad():
        got = qmodel(ids)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    # the stream itself is the float stream, centred (LayerNorm's mean moved into the writers), times Q
    stream = inputs["float"][0]
    centred = stream - stream.mean(dim=-1, keepdim=True)
    Q = orthogonal_matrix(DIM, ROTATION_DEFAULTS["rotation"], ROTATION_DEFAULTS["seed"])
    torch.testing.assert_close(inputs["rotated"][0], centred @ Q, rtol=1e-4, atol=1e-4)


def test_a_decoder_captured_with_torch_export_rotates_to_the_same_function():
    model, ids = _decoder(), _ids(1)
    qmodel = prepare_by_platform(model, "tensorrt_nlp", {"capture": "export", "example_inputs": (ids,)})
    hadamard_rotation(qmodel, [_ids(2)])
    assert qmodel.meta["rotation"]["online"] == [f"blocks.{i}.proj" for i in range(DEPTH)]
    assert sum(isinstance(m, nn.RMSNorm) for m in qmodel.modules()) == 2 * DEPTH + 1
    disable_all(qmodel)
    with torch.no_grad():
        torch.testing.assert_close(qmodel(ids), model(ids), rtol=1e-4, atol=1e-4)


def test_a_norm_scale_outlier_stops_costing_activation_precision():
    """One LayerNorm output channel 40x the others (a large norm scale, as LLMs grow): a per-tensor int8 grid on
    the norm's output spends its range on that channel; rotated, the scale sits in the weights. Measured with only
    those quantizers on (the attention's and the MLP's other grids are not what rotation changes)."""
    model = _decoder()
    with torch.no_grad():
        for block in model.blocks:
            block.norm1.weight[3] = 40.0
            block.norm2.weight[5] = 40.0
    cali, ids = [_ids(s, 8) for s in (3, 4)], _ids(5, 8)
    with torch.no_grad():
        reference = model(ids)
    errors = {}
    for rotate in (False, True):
        qmodel = prepare_by_platform(model, "tensorrt_nlp", {"extra_qconfig_dict": {"w_qscheme": {"bit": 8}}})
        if rotate:
            hadamard_rotation(qmodel, cali)
        else:
            calibrate(qmodel, cali, smooth=False, recipe=PTQRecipe())
        for name, quantizer in quantizers(qmodel):  # the grids rotation changes: the norms' outputs
            if not (name.startswith("blocks_") and "norm" in name and name.endswith("post_act_fake_quantizer")):
                quantizer.disable_fake_quant()
        with torch.no_grad():
            errors[rotate] = float(((qmodel(ids) - reference) ** 2).mean())
    # the grid's step shrinks with the range (max |g n| ~ 40 max|n| -> max |n Q| ~ max|n|) while the folded scale
    # multiplies the rotated noise by g: the error ratio is about mean(g^2) / max(g)^2 = 0.03 (measured 0.11)
    assert errors[True] < 0.25 * errors[False], errors


@pytest.mark.parametrize("backend", ["tensorrt_nlp", "llm_w4a16"])
def test_a_rotated_decoder_deploys_and_verifies(backend, tmp_path):
    model = _decoder()
    config = host_config(backend)
    qmodel = hadamard_rotation(prepare_by_platform(model, backend, config), [_ids(6)])
    if backend == "llm_w4a16":
        gptq(qmodel, [_ids(6)])
        enable_quantization(qmodel)
    ids = _ids(7, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = convert_deploy(qmodel, backend, dummy_input=ids, output_path=str(tmp_path), model_name="m")
    report = verify_deploy(qmodel, result, ids)
    assert report.passed, str(report)
    if backend == "llm_w4a16":
        assert set(report.artifacts) >= {"onnx", "matmulnbits_onnx"}


def test_a_post_norm_encoder_rotates_only_its_mlp_down_projection_inputs():
    """``residual: False`` on a BERT-style encoder: each FFN's second Linear reads ``gelu(fc1 x) @ H`` (H the seeded
    Hadamard matrix) with its weight times H, so the model computes the float function."""
    torch.manual_seed(0)
    encoder = bert_tiny(dim=32, depth=2, heads=2).eval()
    ids = torch.randint(0, 1000, (2, 8), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    hidden: dict[str, list[torch.Tensor]] = {"float": [], "rotated": []}

    def keep(which: str):
        return lambda module, args: hidden[which].append(args[0].detach().double())

    encoder.layers[1].ffn[2].register_forward_pre_hook(keep("float"))
    with torch.no_grad():
        expected = encoder(ids, mask)
    qmodel = prepare_by_platform(encoder, "tensorrt_nlp")
    hadamard_rotation(qmodel, [(ids, mask)], {"residual": False, "seed": 4})
    assert qmodel.meta["rotation"]["streams"] == []
    assert qmodel.meta["rotation"]["online"] == ["layers.0.ffn.2", "layers.1.ffn.2"]
    assert sum(isinstance(m, nn.LayerNorm) for m in qmodel.modules()) == 5  # the norms are left as they are
    qmodel.get_submodule("layers.1.ffn.2").register_forward_pre_hook(keep("rotated"))
    disable_all(qmodel)
    with torch.no_grad():
        got = qmodel(ids, mask)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    H = orthogonal_matrix(4 * 32, "hadamard", seed=5)  # the online matrices are drawn with seed + 1
    torch.testing.assert_close(hidden["rotated"][0], hidden["float"][0] @ H, rtol=1e-4, atol=1e-5)


class _Shapes(nn.Module):
    """A gated MLP, a plain Linear pair, a classifier on a tanh pooler, one Linear called twice, and two Linear
    layers reading one activation (through one quantizer)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 8)
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 8)
        self.pooler, self.classifier = nn.Linear(8, 8), nn.Linear(8, 3)
        self.fc, self.twice = nn.Linear(8, 16), nn.Linear(16, 16)
        self.wide, self.left, self.right = nn.Linear(8, 16), nn.Linear(16, 8), nn.Linear(16, 8)

    def forward(self, x):
        y = self.down(F.silu(self.gate(x)) * self.up(x))  # found: Llama's MLP
        y = self.b(self.a(y))  # no activation between them: not an MLP
        logits = self.classifier(torch.tanh(self.pooler(y)))  # writes 3, not the 8 its pooler reads
        h = self.twice(torch.relu(self.fc(y)))
        g = F.gelu(self.wide(y))
        both = self.left(g) + self.right(g)  # one quantizer feeds both: rotating one's input would turn the other's
        return logits, self.twice(h), both  # twice called twice: one rotated weight would serve two inputs


def test_the_mlp_down_projections_are_found_by_their_shape():
    qmodel = prepare_by_platform(_Shapes().eval(), "tensorrt_nlp")
    assert list(mlp_down_projections(qmodel)) == ["down"]


def test_post_norm_encoders_and_models_without_norms_are_refused():
    encoder = bert_tiny().eval()
    ids = torch.randint(0, 100, (2, 8))
    qmodel = prepare_by_platform(encoder, "tensorrt_nlp")
    with pytest.raises(ValueError, match=r"cannot rotate this model: .*post-norm.*'residual': False"):
        hadamard_rotation(qmodel, [(ids, torch.ones_like(ids))])
    plain = prepare_by_platform(nn.Sequential(nn.Linear(4, 4), nn.ReLU()).eval(), "tensorrt_nlp")
    with pytest.raises(ValueError, match="found no normalization module"):
        hadamard_rotation(plain, [torch.randn(2, 4)])
    with pytest.raises(ValueError, match="down projections' inputs are rotated, and none was found"):
        hadamard_rotation(plain, [torch.randn(2, 4)], {"residual": False})
    with pytest.raises(ValueError, match="residual and ffn are both False"):
        hadamard_rotation(plain, [torch.randn(2, 4)], {"residual": False, "ffn": False})
    with pytest.raises(ValueError, match="residual must be true or false, got 'no'"):
        hadamard_rotation(plain, [torch.randn(2, 4)], {"residual": "no"})
    with pytest.raises(ValueError, match=r"unknown.*ffn"):
        hadamard_rotation(prepare_by_platform(_decoder(), "tensorrt_nlp"), [_ids(1)], {"online": True})
