"""The project's decoder (TinyGPT) in the checkpoints LLM runtimes load: written as transformers' OPT, whose blocks
compute GPT-2's with separate q / k / v layers. transformers' own OPT is the reference: the float decoder's weights
under OPT's names compute its logits, and the compressed-tensors folders of its W4A16, W8A8 and FP8 deployments
compute the simulation."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from mqbench.convert_deploy import convert_deploy
from mqbench.deploy.verify import verify_deploy
from mqbench.models.decoder import TinyGPT, opt_config
from mqbench.prepare_by_platform import prepare_by_platform
from mqbench.utils.state import enable_calibration, enable_quantization

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")
pytest.importorskip("compressed_tensors")

FULL_INT8 = {"extra_qconfig_dict": {"a_qscheme": {"symmetric_range": False}}}  # the runtime's [-128, 127] inputs


def _decoder(attention: str = "eager") -> TinyGPT:
    """A 2-block decoder with norms and biases far from their defaults, so that a misplaced one shows."""
    torch.manual_seed(0)
    model = TinyGPT(dim=64, depth=2, heads=2, context=32, attention=attention).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.LayerNorm):
                module.weight.uniform_(0.5, 2.0)
                module.bias.normal_(0.0, 0.3)
            if isinstance(module, nn.Linear) and module.bias is not None:
                module.bias.normal_(0.0, 0.1)
        model.tokens.weight.normal_(0.0, 0.5)  # the tied output layer: logits far from uniform
    return model


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(seed))


def _opt(model: TinyGPT, attention: str) -> nn.Module:
    """transformers' OPT built from the configuration alone, holding ``model``'s weights under the mapped names."""
    config = {k: v for k, v in opt_config(model).items() if not k.startswith("mqbench_") and k != "architectures"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = transformers.OPTForCausalLM(transformers.OPTConfig(**config, attn_implementation=attention)).eval()
    names = opt_config(model)["mqbench_parameter_names"]
    state = {names[k]: v for k, v in model.state_dict().items()}
    state["model.decoder.embed_positions.weight"] = torch.cat([torch.zeros(2, 64), model.positions.weight.detach()])
    missing, unexpected = opt.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied: the embedding
    return opt


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_the_decoder_is_opt_under_the_mapped_names(attention):
    model = _decoder(attention)
    opt = _opt(model, attention)
    names = opt_config(model)["mqbench_parameter_names"]
    assert sorted(names) == sorted(model.state_dict())  # every parameter named, once
    assert set(names.values()) == {n for n, _ in opt.named_parameters(remove_duplicate=False)}
    ids = _ids(1)
    with torch.no_grad():
        expected = opt(input_ids=ids, use_cache=False).logits
        got = model(ids)
    assert torch.equal(got, expected)  # the same operations in the same order: bit for bit


def _deployed(tmp_path: Path, backend: str, attention: str, heard: list[str] | None = None, **config):
    options = {"example_inputs": (_ids(0),), **config}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qmodel = prepare_by_platform(_decoder(attention), backend, options)
        enable_calibration(qmodel)
        qmodel(_ids(1))
        enable_quantization(qmodel)
        del caught[:]
        result = convert_deploy(qmodel, backend, dummy_input=(_ids(2),), output_path=tmp_path)
    if heard is not None:
        heard.extend(str(w.message) for w in caught)
    return qmodel, result


@pytest.mark.parametrize(
    ("backend", "attention", "config", "fmt"),
    [
        ("llm_w4a16", "eager", {"extra_qconfig_dict": {"w_qscheme": {"group_size": 32}}}, "pack-quantized"),
        ("tensorrt_nlp", "sdpa", FULL_INT8, "int-quantized"),
        ("tensorrt_fp8", "sdpa", {}, "float-quantized"),
    ],
)
def test_the_decoder_s_folder_is_opt_and_transformers_computes_the_simulation(
    tmp_path, backend, attention, config, fmt
):
    qmodel, result = _deployed(tmp_path, backend, attention, **config)
    folder = Path(result.artifacts["compressed_tensors"])
    written = json.loads((folder / "config.json").read_text())
    assert written["architectures"] == ["OPTForCausalLM"] and written["activation_function"] == "gelu_pytorch_tanh"
    assert not any(key.startswith("mqbench_") for key in written)
    quantization = written["quantization_config"]
    assert quantization["format"] == fmt and quantization["ignore"] == ["lm_head"]
    tensors = safetensors_torch.load_file(str(folder / "model.safetensors"))
    positions = tensors["model.decoder.embed_positions.weight"]
    assert torch.equal(positions[2:], qmodel.get_parameter("positions.weight").detach()) and not positions[:2].any()
    suffix = "weight_packed" if fmt == "pack-quantized" else "weight"
    assert f"model.decoder.layers.1.fc2.{suffix}" in tensors and "lm_head.weight" not in tensors  # tied
    report = verify_deploy(qmodel, result, (_ids(3),), ["compressed_tensors"], fidelity=False)
    art = report.artifacts["compressed_tensors"]
    assert report.passed, report.failures()
    assert len(art.per_tensor) == 12 and art.max_lsb_diff == 0  # q, k, v, out, fc, proj of each block
    (logits,) = art.outputs.values()
    assert logits.max_abs_diff <= 1e-5 * max(logits.magnitude, 1.0)
    np.testing.assert_array_equal(tensors["model.decoder.layers.0.self_attn.q_proj.bias"].numpy(), _q_bias(qmodel))


def _q_bias(qmodel: nn.Module) -> np.ndarray:
    return qmodel.get_parameter("blocks.0.attn.q.bias").detach().numpy()


def test_the_decoder_s_eager_attention_products_are_refused_for_inputs_quantized(tmp_path):
    heard: list[str] = []
    _, result = _deployed(tmp_path, "tensorrt_fp8", "eager", heard)
    (said,) = [line for line in heard if line.startswith("compressed_tensors")]
    assert "the format quantizes the inputs of linear layers only" in said and "matmul" in said
    assert "compressed_tensors" not in result.artifacts and "onnx" in result.artifacts


GGUF_GROUPS = {"extra_qconfig_dict": {"w_qscheme": {"group_size": 32, "scale_dtype": "float16"}}}


def _simulated_weights(qmodel: nn.Module) -> dict[str, np.ndarray]:
    weights = {}
    for name, module in qmodel.named_modules():
        quantizer = getattr(module, "weight_fake_quant", None)
        if quantizer is not None and isinstance(module, nn.Linear):
            with torch.no_grad():
                weights[name] = quantizer(module.weight.detach()).numpy()
    return weights


@pytest.mark.parametrize(("backend", "kind"), [("llm_w4a16", "Q4_0"), ("llm_w8a16", "Q8_0")])
def test_the_decoder_s_gguf_is_gpt2_and_its_blocks_are_the_simulation(tmp_path, backend, kind):
    gguf = pytest.importorskip("gguf")
    qmodel, result = _deployed(tmp_path, backend, "eager", **GGUF_GROUPS)
    reader = gguf.GGUFReader(result.artifacts["gguf"])
    assert reader.fields["general.architecture"].contents() == "gpt2"
    assert reader.fields["gpt2.context_length"].contents() == 32 and reader.fields["gpt2.block_count"].contents() == 2
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    assert len(tokens) == 256 and tokens[ord("a")] == "a" and tokens[ord(" ")] == "\u0120"  # GPT-2's byte characters
    stored = {t.name: t for t in reader.tensors}
    assert "output.weight" not in stored  # tied to token_embd
    positions = gguf.quants.dequantize(stored["position_embd.weight"].data, stored["position_embd.weight"].tensor_type)
    assert np.array_equal(positions, qmodel.get_parameter("positions.weight").detach().numpy())  # OPT's offset gone
    # the gguf package's own dequantization of the blocks: q, k and v one after the other, each the simulation's
    simulated = _simulated_weights(qmodel)
    for index in range(2):
        qkv = stored[f"blk.{index}.attn_qkv.weight"]
        assert qkv.tensor_type.name == kind
        q, k, v = np.split(gguf.quants.dequantize(qkv.data, qkv.tensor_type), 3)
        for part, values in zip("qkv", (q, k, v), strict=True):
            assert np.array_equal(values, simulated[f"blocks.{index}.attn.{part}"])
        bias = stored[f"blk.{index}.attn_qkv.bias"].data
        expected = np.concatenate(
            [qmodel.get_parameter(f"blocks.{index}.attn.{p}.bias").detach().numpy() for p in "qkv"]
        )
        assert np.array_equal(bias, expected)
        up = stored[f"blk.{index}.ffn_up.weight"]
        assert np.array_equal(gguf.quants.dequantize(up.data, up.tensor_type), simulated[f"blocks.{index}.fc"])
    report = verify_deploy(qmodel, result, (_ids(3),), ["gguf"], fidelity=False)
    art = report.artifacts["gguf"]
    assert report.passed, report.failures()
    assert len(art.per_tensor) == 12 and art.max_lsb_diff == 0
    (logits,) = art.outputs.values()  # transformers' GPT-2 (its own GELU and order of scaling) from the file
    assert logits.max_abs_diff <= 1e-5 * max(logits.magnitude, 1.0)


def test_an_opt_model_with_other_blocks_gets_no_gguf_naming_why(tmp_path):
    pytest.importorskip("gguf")
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = transformers.OPTConfig(
            vocab_size=96,
            hidden_size=64,
            num_hidden_layers=1,
            ffn_dim=256,
            num_attention_heads=2,
            max_position_embeddings=32,
            word_embed_proj_dim=64,
        )  # OPT's own ReLU
        opt = transformers.OPTForCausalLM(config).eval()
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    heard: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qmodel = prepare_by_platform(opt, "llm_w4a16", {"example_inputs": {"input_ids": ids}, **GGUF_GROUPS})
        enable_calibration(qmodel)
        qmodel(ids)
        enable_quantization(qmodel)
        del caught[:]
        result = convert_deploy(qmodel, "llm_w4a16", dummy_input={"input_ids": ids}, output_path=tmp_path)
        heard.extend(str(w.message) for w in caught)
    (said,) = [line for line in heard if line.startswith("gguf")]
    assert "its activation 'relu'" in said
    assert "gguf" not in result.artifacts and "genai" not in result.artifacts
    assert "compressed_tensors" in result.artifacts  # OPT itself: the folder holds any activation


def test_the_trained_decoder_s_kv_cache_decoder_generates_the_simulation_s_tokens(tmp_path):
    og = pytest.importorskip("onnxruntime_genai")
    from mqbench.models.decoder import DecoderRecipe, trained_decoder

    model, _, _ = trained_decoder(DecoderRecipe(depth=2, steps=250))
    text = torch.tensor([list(b"def main(argv):\n    for name in ")])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qmodel = prepare_by_platform(model, "llm_w4a16", {"example_inputs": (text,), **GGUF_GROUPS})
        enable_calibration(qmodel)
        qmodel(text)
        enable_quantization(qmodel)
        result = convert_deploy(qmodel, "llm_w4a16", dummy_input=(text,), output_path=tmp_path)
    folder = Path(result.artifacts["genai"])
    config = json.loads((folder / "genai_config.json").read_text())
    assert config["model"]["type"] == "decoder" and config["model"]["context_length"] == 128
    report = verify_deploy(qmodel, result, (text,), ["genai"], fidelity=False)
    assert report.passed, report.failures()
    for diff in report.artifacts["genai"].outputs.values():  # a prefill, then a decode step after its cache
        assert diff.max_abs_diff <= 1e-5 * max(diff.magnitude, 1.0)
    new = 48
    ids, leads = text.clone(), []
    with torch.no_grad():
        for _ in range(new):
            logits = qmodel(ids)[0, -1]
            top = logits.topk(2).values
            leads.append(float((top[0] - top[1]) / logits.abs().max().clamp(min=1.0)))
            ids = torch.cat([ids, logits.argmax().view(1, 1)], dim=1)
    expected = ids[0, text.shape[1] :].tolist()
    genai_model = og.Model(str(folder))
    params = og.GeneratorParams(genai_model)
    params.set_search_options(max_length=text.shape[1] + new, do_sample=False)
    generator = og.Generator(genai_model, params)
    generator.append_tokens(text.numpy().astype(np.int32))
    while not generator.is_done():
        generator.generate_next_token()
    generated = [int(t) for t in generator.get_sequence(0)][text.shape[1] :]
    # equal up to a step whose top two logits lie within ten times the verified logit error (see test_genai.py)
    clear = next((i for i, lead in enumerate(leads) if lead <= 1e-4), new)
    assert clear >= new // 2, leads
    assert generated[:clear] == expected[:clear]
    assert len(set(expected[:clear])) >= 5, bytes(expected)  # text, not one byte repeated
