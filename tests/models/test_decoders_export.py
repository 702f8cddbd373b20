"""Hugging Face decoders (small configs, random weights) captured with torch.export: prepare, calibrate, deploy and
verify the prefill forward (token ids and a padded attention mask to logits, no KV cache)."""

from __future__ import annotations

import warnings

import onnx
import pytest
import torch

from backend_configs import config_for, host_config
from mqbench.convert_deploy import convert_deploy
from mqbench.deploy.verify import verify_deploy
from mqbench.prepare_by_platform import prepare_by_platform
from mqbench.utils.hf_capture import broadcast_for_bhqkv
from mqbench.utils.state import disable_all, enable_calibration, enable_quantization

transformers = pytest.importorskip("transformers")

VOCAB = 64
SMALL = {"vocab_size": VOCAB, "num_hidden_layers": 2, "num_attention_heads": 2, "max_position_embeddings": 32}
DECODERS = {
    "gpt2": lambda: transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    ),
    "llama": lambda: transformers.LlamaForCausalLM(
        transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_key_value_heads=1, **SMALL)
    ),
    "mistral": lambda: transformers.MistralForCausalLM(
        transformers.MistralConfig(
            hidden_size=32, intermediate_size=64, num_key_value_heads=1, sliding_window=4, **SMALL
        )
    ),
    "qwen2": lambda: transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(hidden_size=32, intermediate_size=64, num_key_value_heads=1, **SMALL)
    ),
    "phi": lambda: transformers.PhiForCausalLM(transformers.PhiConfig(hidden_size=32, intermediate_size=64, **SMALL)),
    "falcon": lambda: transformers.FalconForCausalLM(
        transformers.FalconConfig(hidden_size=32, vocab_size=VOCAB, num_hidden_layers=2, num_attention_heads=2)
    ),
    "opt": lambda: transformers.OPTForCausalLM(
        transformers.OPTConfig(hidden_size=32, ffn_dim=64, word_embed_proj_dim=32, **SMALL)
    ),
}


def _decoder(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = DECODERS[name]()
    model.config.use_cache = False
    model.config._attn_implementation = "eager"  # attention as matmuls, which the NLP backends quantize
    return model.eval()


def _tokens(batch: int, length: int, seed: int) -> dict[str, torch.Tensor]:
    """Token ids and a padded mask: the second sequence ends 3 tokens early (right padding), the third starts 2
    tokens late (left padding, as batched generation pads: its first rows attend to no key at all)."""
    ids = torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[1, length - 3 :] = 0
    if batch > 2:
        mask[2, :2] = 0
    return {"input_ids": ids, "attention_mask": mask}


CASES = [(name, "tensorrt_nlp") for name in DECODERS]
CASES += [("llama", backend) for backend in ("academic_nlp", "tensorrt", "openvino")]
CASES += [("gpt2", "tensorrt"), ("mistral", "openvino")]
CASES += [(name, "openvino") for name in ("gpt2", "opt", "phi")]  # LayerNorm of a quantized residual sum


@pytest.mark.parametrize(("name", "backend"), CASES)
def test_a_decoder_prefill_prepares_deploys_and_verifies(name, backend, tmp_path):
    model = _decoder(name)
    inputs = _tokens(4, 10, seed=1)
    config = {**(host_config(backend) or config_for(backend) or {}), "example_inputs": inputs}
    qmodel = prepare_by_platform(model, backend, config)
    assert qmodel.mqbench_capture == "export"  # torch.fx cannot trace these forwards
    enable_calibration(qmodel)
    with torch.no_grad():
        for seed in (1, 2):
            qmodel(**_tokens(4, 10, seed))
    enable_quantization(qmodel)
    with torch.no_grad():
        other = _tokens(3, 7, seed=3)  # batch and sequence length are dynamic
        assert qmodel(**other).logits.shape == (3, 7, VOCAB)
        expected = model(**inputs).logits.flatten()
        got = qmodel(**inputs).logits.flatten()
    assert torch.isfinite(got).all()
    cosine = torch.nn.functional.cosine_similarity(expected, got, dim=0)
    assert cosine > 0.99, float(cosine)  # W8A8 of a 2-layer decoder keeps its logits
    result = convert_deploy(qmodel, backend, dummy_input=inputs, output_path=tmp_path)
    graph = onnx.load(result.artifacts["deploy_onnx"]).graph
    axes = [[d.dim_param for d in i.type.tensor_type.shape.dim] for i in graph.input]
    assert axes[0] == ["batch", "sequence"] and all(a and all(a) for a in axes), axes  # every dimension dynamic
    report = verify_deploy(qmodel, result, other)  # deployed for 4 x 10, verified on 3 x 7 with padding
    assert report.passed, report.failures()


class Doubled(torch.nn.Linear):
    """A linear layer whose own forward computes something else: kept as written."""

    __module__ = "transformers.models.doubled"

    def forward(self, x):
        return 2 * super().forward(x)


@pytest.mark.parametrize("name", ["gpt2", "falcon"])
def test_linear_layers_written_otherwise_are_prepared_as_linear_layers(name):
    """GPT-2's Conv1D (a weight ``[in, out]`` used by ``addmm``) and Falcon's FalconLinear (``x @ weight.T + bias``)
    are prepared as the nn.Linear each is: every projection gets a weight quantizer, and the float model is left as
    it was. A subclass whose forward computes something else stays as written."""
    model = _decoder(name)
    first = next(n for n, m in model.named_modules() if type(m).__name__ in ("Conv1D", "FalconLinear"))
    parent, _, child = first.rpartition(".")
    layer = model.get_submodule(first)
    weight = layer.weight.t() if name == "gpt2" else layer.weight
    doubled = Doubled(weight.shape[1], weight.shape[0])
    setattr(model.get_submodule(parent), child, doubled)
    qmodel = prepare_by_platform(model, "tensorrt_nlp", {"example_inputs": _tokens(2, 6, seed=5)})
    written = [n for n, m in model.named_modules() if type(m).__name__ in ("Conv1D", "FalconLinear")]
    assert len(written) >= 7, written  # the attention and MLP projections of both blocks
    for layer_name in written:
        prepared = qmodel.get_submodule(layer_name)
        assert hasattr(prepared, "weight_fake_quant"), layer_name
        original = model.get_submodule(layer_name).weight
        assert torch.equal(prepared.weight, original.t() if name == "gpt2" else original), layer_name
    disable_all(qmodel)  # with the quantizers off the prepared model computes the float model: 2x kept
    with torch.no_grad():
        tokens = _tokens(2, 6, seed=6)
        assert torch.allclose(qmodel(**tokens).logits, model(**tokens).logits, atol=1e-5)
    assert type(model.get_submodule(written[0])).__name__ in ("Conv1D", "FalconLinear")


def test_mask_arithmetic_is_never_quantized():
    """The attention mask (integer inputs and finfo.min constants) and the scores it fills with finfo.min are
    left in float on every quantizing backend, so no quantizer holds a non-finite or sentinel range."""
    model = _decoder("gpt2")
    inputs = _tokens(2, 8, seed=4)
    for backend in ("tensorrt", "openvino"):
        qmodel = prepare_by_platform(model, backend, {"example_inputs": inputs})
        enable_calibration(qmodel)
        with torch.no_grad():
            qmodel(**inputs)
        for name, module in qmodel.named_modules():
            observer = getattr(module, "activation_post_process", None)
            if observer is not None and hasattr(observer, "min_val") and observer.min_val.numel():
                low, high = float(observer.min_val.min()), float(observer.max_val.max())
                assert abs(low) < 1e6 and abs(high) < 1e6, (backend, name, low, high)


@pytest.mark.parametrize("bh_indices", [True, False])
def test_masks_by_broadcasting_equal_transformers_vmapped_masks(bh_indices):
    """While capturing, transformers' masks are built by broadcasting instead of four nested vmaps: the same
    causal, padding and sliding-window masks (the vmapped ones computed by transformers itself)."""
    masking = pytest.importorskip("transformers.masking_utils")
    if not hasattr(masking, "_vmap_for_bhqkv"):
        pytest.skip("this transformers builds its masks without vmap: nothing is replaced while capturing")
    padding = torch.tensor([[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]], dtype=torch.bool)
    functions = [
        masking.causal_mask_function,
        masking.and_masks(masking.causal_mask_function, masking.padding_mask_function(padding)),
        masking.and_masks(masking.sliding_window_causal_mask_function(3), masking.padding_mask_function(padding)),
    ]
    batch, head, q, kv = torch.arange(2), torch.arange(1), torch.arange(6), torch.arange(6)
    for function in functions:
        if not bh_indices and function is not functions[0]:
            continue  # padding needs the batch index
        with masking.TransformGetItemToIndex():
            expected = masking._vmap_for_bhqkv(function, bh_indices)(batch, head, q, kv)
        got = broadcast_for_bhqkv(function, bh_indices)(batch, head, q, kv)
        assert got.shape == expected.shape and torch.equal(got, expected)
