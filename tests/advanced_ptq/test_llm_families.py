"""Language models of several Hugging Face families (small random configs, tied and untied embeddings): their norm
classes read by what they compute, the output layer and embeddings float on the LLM backends, and every transform
that changes weights (rotation, SmoothQuant, AWQ, GPTQ) leaving the float function or a tied weight as it was."""

from __future__ import annotations

import warnings

import pytest
import torch

from mqbench.advanced_ptq import awq, calibrate, gptq, hadamard_rotation
from mqbench.advanced_ptq.calibration import recipe_of
from mqbench.backend_config import quantization_report
from mqbench.backends import ParamsTable
from mqbench.convert_deploy import convert_deploy
from mqbench.custom_quantizer.ops import normalizes_layers
from mqbench.deploy.verify import verify_deploy
from mqbench.fake_quantize.quantize_base import QuantizeBase
from mqbench.nn.modules.norms import norm_of
from mqbench.prepare_by_platform import prepare_by_platform
from mqbench.utils.state import UncalibratedError, disable_all, enable_calibration, enable_quantization

transformers = pytest.importorskip("transformers")

VOCAB = 96
SMALL = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}
FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    "gemma": (transformers.GemmaConfig, transformers.GemmaForCausalLM),
}


def _decoder(family: str, tied: bool) -> torch.nn.Module:
    config_class, model_class = FAMILIES[family]
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = config_class(**SMALL, tie_word_embeddings=tied)
        config._attn_implementation = "eager"
        model = model_class(config)
    model.config.use_cache = False
    with torch.no_grad():  # trained norms are not all ones: give each its own gains
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.copy_(torch.rand_like(parameter) + 0.5)
        for layer in model.model.layers:  # and an outlier channel on the residual stream, as real LLMs have
            layer.mlp.down_proj.weight[3] *= 20
    return model.eval()


def _ids(seed: int, batch: int = 4, length: int = 12) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def _prepare(model: torch.nn.Module, backend: str, **config: object) -> torch.fx.GraphModule:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return prepare_by_platform(model, backend, {"example_inputs": {"input_ids": _ids(0, 2, 8)}, **config})


def _assert_float_function(qmodel: torch.fx.GraphModule, model: torch.nn.Module) -> None:
    ids = _ids(99)
    reference = _logits(model, ids)
    disable_all(qmodel)
    torch.testing.assert_close(_logits(qmodel, ids), reference, rtol=0, atol=1e-5 * float(reference.abs().max()))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_s_norm_is_read_by_what_it_computes(family):
    model = _decoder(family, tied=True)
    norm = model.model.norm
    found = norm_of(norm)
    assert found is not None and found.width == SMALL["hidden_size"] and not found.centered
    weight = norm.weight.detach().double()
    # Gemma scales by 1 + weight; the others by weight
    torch.testing.assert_close(found.gain, weight + 1 if family == "gemma" else weight)
    x = torch.randn(3, 5, SMALL["hidden_size"]) * 4
    eps = norm.variance_epsilon if hasattr(norm, "variance_epsilon") else norm.eps
    rms = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)  # the formula, written here
    torch.testing.assert_close(norm(x), (rms * found.gain.float()).to(x.dtype), rtol=1e-5, atol=1e-5)


def test_modules_that_are_not_norms_are_not_taken_for_one():
    assert norm_of(torch.nn.Linear(8, 8)) is None
    assert norm_of(torch.nn.GELU()) is None
    assert norm_of(transformers.models.llama.modeling_llama.LlamaMLP(transformers.LlamaConfig(**SMALL))) is None

    class Scale(torch.nn.Module):  # a weight of one width, but no normalization
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.rand(8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.weight

    assert norm_of(Scale()) is None


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "qwen3"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_the_rotation_finds_the_family_s_norms_and_keeps_the_float_function(family, tied):
    model = _decoder(family, tied)
    qmodel = hadamard_rotation(_prepare(model, "tensorrt_nlp"), [_ids(1), _ids(2)])
    report = qmodel.meta["rotation"]
    depth = SMALL["num_hidden_layers"]
    assert len(report["streams"][0]["norms"]) == 2 * depth + 1 and len(report["online"]) == depth
    assert "lm_head" in report["streams"][0]["readers"]  # the final norm's gain folded into the output layer
    assert report["untied"] == (["lm_head", "model.embed_tokens"] if tied else [])
    if family == "qwen3":  # its per-head q / k norms read attention heads, not the residual stream
        assert not any("q_norm" in name for name in report["streams"][0]["norms"])
    _assert_float_function(qmodel, model)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_smoothquant_on_a_tied_model_keeps_the_float_function(family):
    model = _decoder(family, tied=True)
    qmodel = _prepare(model, "tensorrt_nlp", float_layers=[])  # lm_head quantized: its input would be smoothed
    tied = qmodel.lm_head.weight  # the embedding table too (Gemma's scaled embedding reads it as a function)
    before = tied.detach().clone()
    calibrate(qmodel, [_ids(1), _ids(2)], smooth=True)
    assert qmodel.lm_head.weight is tied and torch.equal(tied, before)  # not scaled for lm_head's sake
    assert any(name.endswith("_smoothing") for name, _ in qmodel.named_modules())  # the other layers were
    _assert_float_function(qmodel, model)


def test_awq_keeps_the_float_function_and_gptq_leaves_a_tied_weight_alone():
    model = _decoder("llama", tied=True)
    data = [_ids(1), _ids(2)]
    with_awq = awq(_prepare(model, "llm_w4a16", float_layers=[]), data, {"grid": 4, "clip_grid": 4})
    scaled = {layer for site in with_awq.meta["awq"]["sites"].values() for layer in site["layers"]}
    assert "lm_head" not in scaled and "model.layers.0.mlp.down_proj" in scaled
    _assert_float_function(with_awq, model)

    with_gptq = gptq(_prepare(model, "llm_w4a16", float_layers=[]), data)
    assert "lm_head" not in with_gptq.meta["gptq"] and "model.layers.0.mlp.down_proj" in with_gptq.meta["gptq"]
    assert torch.equal(with_gptq.model.embed_tokens.weight, model.model.embed_tokens.weight)
    enable_quantization(with_gptq)
    assert torch.isfinite(_logits(with_gptq, _ids(3))).all()


@pytest.mark.parametrize("backend", ["llm_w4a16", "llm_w8a16", "tensorrt_nlp", "tensorrt_fp8"])
def test_the_output_layer_and_embeddings_stay_float_on_the_llm_backends_unless_asked(backend):
    model = _decoder("llama", tied=True)
    qmodel = _prepare(model, backend)
    assert not hasattr(qmodel.lm_head, "weight_fake_quant")
    rows = {line.split()[0]: line for line in str(quantization_report(qmodel)).splitlines() if line.strip()}
    assert "output projection (lm_head), float on this backend" in rows["lm_head"]
    assert "float_layers'] = [] quantizes it" in rows["lm_head"]
    assert "an embedding table, float on this backend" in rows["model_embed_tokens"]
    quantized = _prepare(model, backend, float_layers=["embedding"])
    assert hasattr(quantized.lm_head, "weight_fake_quant")
    with pytest.raises(
        ValueError, match=r"float_layers has unknown roles \['head'\]; valid: \['lm_head', 'embedding'\]"
    ):
        _prepare(model, backend, float_layers=["head"])


@pytest.mark.parametrize("family", FAMILIES)
def test_a_decoder_gets_its_backend_s_transformer_defaults(family):
    """A family's RMSNorm marks a transformer as LayerNorm does: calibration takes the backend's transformer recipe,
    and a backend that keeps a transformer's residual stream float (OpenVINO) quantizes no value a norm reads."""
    qmodel = _prepare(_decoder(family, tied=False), "openvino")
    assert normalizes_layers(qmodel)
    assert recipe_of(qmodel) == ParamsTable["openvino"].transformer_recipe
    modules = dict(qmodel.named_modules())
    nodes = [n for n in qmodel.graph.nodes if n.op == "call_module"]
    quantizers = [n for n in nodes if isinstance(modules[n.target], QuantizeBase)]
    normalised = [n.args[0] for n in nodes if norm_of(modules[n.target])]
    assert len(normalised) >= 2 * SMALL["num_hidden_layers"] + 1  # two a block and the last (Qwen3: queries, keys)
    assert not {q.args[0] for q in quantizers} & set(normalised)
    # chosen at prepare from the captured graph: the linear layers' inputs on the transformer's asymmetric grid
    linear_inputs = [
        q for q in quantizers if any(isinstance(modules.get(str(u.target)), torch.nn.Linear) for u in q.users)
    ]
    assert linear_inputs
    for node in linear_inputs:
        quantizer = modules[node.target]
        assert (int(quantizer.quant_min), int(quantizer.quant_max), quantizer.qscheme) == (
            0,
            255,
            torch.per_tensor_affine,
        ), node


@pytest.mark.parametrize("backend", ["tensorrt", "snpe", "onnx_qnn", "openvino", "tensorrt_nlp"])
def test_a_backend_that_quantizes_a_decoder_s_residual_stream_says_so(backend):
    """The residual adds a decoder's RMSNorms read: quantized by the CNN placements (named in a warning, with the
    backends that keep them float), float on OpenVINO's and TensorRT NLP's."""
    model = _decoder("llama", tied=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prepare_by_platform(model, backend, {"example_inputs": {"input_ids": _ids(0, 2, 8)}})
    said = [str(w.message) for w in caught if "residual add(s) of this model's RMSNorm stream" in str(w.message)]
    if backend in ("openvino", "tensorrt_nlp"):
        assert not said
    else:
        (message,) = said
        assert message.startswith(f"backend {backend!r} quantizes 4 residual add(s)") or message.startswith(
            f"backend {backend!r} quantizes 3 residual add(s)"
        ), message
        assert message.endswith("openvino, tensorrt_fp8, tensorrt_nlp"), message


def test_a_classifier_head_is_not_taken_for_an_lm_head():
    classifier = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).eval()
    qmodel = prepare_by_platform(classifier, "tensorrt_nlp")
    assert hasattr(qmodel.get_submodule("2"), "weight_fake_quant")


def test_weight_only_rounds_to_nearest_without_data():
    model = _decoder("llama", tied=False)
    ids = _ids(5)
    no_data = _prepare(model, "llm_w4a16")
    enable_quantization(no_data)  # no calibration batch: weights need none
    calibrated = _prepare(model, "llm_w4a16")
    enable_calibration(calibrated)
    _logits(calibrated, ids)  # the usual way: the weight observers see the weights during a forward
    enable_quantization(calibrated)
    assert torch.equal(_logits(no_data, ids), _logits(calibrated, ids))
    assert not torch.equal(_logits(no_data, ids), _logits(model, ids))  # and it did quantize

    w8a8 = _prepare(model, "tensorrt_nlp")
    enable_quantization(w8a8)
    with pytest.raises(UncalibratedError, match=r"never calibrated: .*post_act_fake_quantizer") as error:
        _logits(w8a8, ids)
    assert "weight_fake_quant" not in str(error.value)  # activations still need data; weights did not


@pytest.mark.parametrize(
    ("backend", "float_layers"),
    [("llm_w4a16", None), ("llm_w4a16", []), ("tensorrt_nlp", []), ("tensorrt_fp8", None)],
    ids=["w4a16", "w4a16-lm_head-quantized", "w8a8-lm_head-quantized", "fp8"],
)
def test_a_tied_decoder_deploys_and_verifies(backend, float_layers, tmp_path):
    """Every artifact of a decoder whose output layer is its embedding table: a quantized lm_head gets its own
    quantized weight in the file, the embedding Gather keeps reading the float table."""
    model = _decoder("llama", tied=True)
    config = {} if float_layers is None else {"float_layers": float_layers}
    qmodel = _prepare(model, backend, **config)
    calibrate(qmodel, [_ids(1), _ids(2)])
    enable_quantization(qmodel)
    sample = _ids(7, 2, 10)
    result = convert_deploy(qmodel, backend, dummy_input={"input_ids": sample}, output_path=tmp_path)
    report = verify_deploy(qmodel, result, {"input_ids": _ids(8, 3, 9)})
    assert report.passed, report.failures()
    assert qmodel.lm_head.weight is qmodel.model.embed_tokens.weight  # deploying left the prepared model tied


def test_fp8_quantizes_the_inputs_of_matrix_products_only():
    """FP8 engines run the matrix products in FP8 and the residual adds, gates and rotary multiplications in 16-bit:
    3 mantissa bits on the residual stream cost SmolLM2 2.7x its perplexity (+3% on the products' inputs alone)."""
    qmodel = _prepare(_decoder("llama", tied=False), "tensorrt_fp8")
    modules = dict(qmodel.named_modules())
    readers = set()
    for node in qmodel.graph.nodes:
        if node.op == "call_module" and node.target.endswith("post_act_fake_quantizer"):
            for user in node.users:
                module = modules.get(str(user.target)) if user.op == "call_module" else None
                readers.add(
                    type(module).__name__ if module is not None else getattr(user.target, "__name__", user.target)
                )
    assert readers and readers <= {"Linear", "matmul"}, readers


def test_a_decoder_asking_for_its_kv_cache_is_captured_as_a_prefill() -> None:
    """transformers' default ``use_cache=True`` returns a cache object torch.export cannot hold: the capture runs
    without it (the logits of every position) and leaves the model's config as it was."""
    model = _decoder("llama", tied=True)
    model.config.use_cache = True
    qmodel = _prepare(model, "llm_w4a16")
    assert model.config.use_cache is True
    disable_all(qmodel)
    out = qmodel(input_ids=_ids(5))
    assert list(out.keys()) == ["logits"]
    reference = _logits(model, _ids(5))
    torch.testing.assert_close(out.logits, reference, rtol=0, atol=1e-5 * float(reference.abs().max()))
