"""The ONNX decoder with a KV cache: prefill and decode steps against the simulation, and onnxruntime-genai's greedy
generation from the folder against the simulation's greedy tokens."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from mqbench.convert_deploy import convert_deploy
from mqbench.deploy.onnx_graph import ort_session
from mqbench.deploy.verify import verify_deploy
from mqbench.deploy.writers.genai import run_step
from mqbench.prepare_by_platform import prepare_by_platform
from mqbench.utils.state import enable_calibration, enable_quantization

transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parent))
from test_compressed_tensors import VOCAB, _deployed, _ids, _llama  # noqa: E402

NEW_TOKENS = 32


def _simulated_greedy(qmodel: torch.nn.Module, prompt: torch.Tensor, count: int) -> tuple[list[int], list[float]]:
    """The simulation's greedy tokens, and at each step the lead of the chosen token's logit over the next one,
    relative to the largest logit magnitude."""
    ids = prompt.clone()
    leads = []
    with torch.no_grad():
        for _ in range(count):
            out = qmodel(input_ids=ids)
            logits = (out["logits"] if isinstance(out, dict) else out[0])[0, -1]
            top = logits.topk(2).values
            leads.append(float((top[0] - top[1]) / logits.abs().max().clamp(min=1.0)))
            ids = torch.cat([ids, logits.argmax().view(1, 1)], dim=1)
    return ids[0, prompt.shape[1] :].tolist(), leads


def test_prefill_and_decode_steps_compute_the_simulation_with_matmulnbits_layers(tmp_path):
    qmodel, result = _deployed(tmp_path, "llm_w4a16", {"group_size": 32})
    folder = Path(result.artifacts["genai"])
    model = onnx.load(folder / "model.onnx")
    ops = [node.op_type for node in model.graph.node]
    assert ops.count("MatMulNBits") == 14  # every quantized linear layer; the float lm_head a MatMul
    config = json.loads((folder / "genai_config.json").read_text())
    decoder = config["model"]["decoder"]
    assert (decoder["num_hidden_layers"], decoder["num_key_value_heads"], decoder["head_size"]) == (2, 2, 16)
    names = [value.name for value in model.graph.input]
    assert names[:3] == ["input_ids", "attention_mask", "position_ids"] and "past_key_values.1.value" in names
    report = verify_deploy(qmodel, result, {"input_ids": _ids(3)}, ["genai"], fidelity=False)
    assert report.passed, report.failures()
    art = report.artifacts["genai"]
    assert set(art.outputs) == {"logits (prefill)", "logits (decode step)"}
    for diff in art.outputs.values():
        assert diff.max_abs_diff <= 1e-5 * max(diff.magnitude, 1.0)
    # two decode steps after a prefill give the logits of one prefill of the whole sequence (computed here)
    ids = _ids(4).numpy()
    session = ort_session(str(folder / "model.onnx"), optimize=False)
    whole, _ = run_step(session, config, ids, None)
    _, past = run_step(session, config, ids[:, :-2], None)
    first, past = run_step(session, config, ids[:, -2:-1], past)
    second, past = run_step(session, config, ids[:, -1:], past)
    assert past[0].shape == (2, 2, ids.shape[1], 16)
    assert np.allclose(first[:, 0], whole[:, -2], atol=1e-5) and np.allclose(second[:, 0], whole[:, -1], atol=1e-5)


def test_onnxruntime_genai_generates_the_simulations_greedy_tokens(tmp_path):
    og = pytest.importorskip("onnxruntime_genai")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qmodel = prepare_by_platform(
            _llama(initializer_range=0.3),
            "llm_w4a16",
            {"example_inputs": {"input_ids": _ids(0)}, "extra_qconfig_dict": {"w_qscheme": {"group_size": 32}}},
        )
        enable_calibration(qmodel)
        qmodel(_ids(1))
        enable_quantization(qmodel)
        result = convert_deploy(qmodel, "llm_w4a16", dummy_input={"input_ids": _ids(2)}, output_path=tmp_path)
    prompt = _ids(5)[:1]
    expected, leads = _simulated_greedy(qmodel, prompt, NEW_TOKENS)
    assert len(set(expected)) >= 5  # a continuation, not one token repeated
    model = og.Model(result.artifacts["genai"])
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=prompt.shape[1] + NEW_TOKENS, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(prompt.numpy().astype(np.int32))
    while not generator.is_done():
        generator.generate_next_token()
    generated = [int(t) for t in generator.get_sequence(0)][prompt.shape[1] :]
    # the tokens are the simulation's up to a step whose top two logits lie closer than ten times the decoder's
    # verified logit error (1e-5 of the magnitude): there float summation order, which differs between hosts and
    # kernels, may pick either, and the sequences part (on the decoder here, no step comes that close)
    clear = next((i for i, lead in enumerate(leads) if lead <= 1e-4), NEW_TOKENS)
    assert clear >= NEW_TOKENS // 2, leads
    assert generated[:clear] == expected[:clear]


def test_a_wrong_weight_in_the_decoder_fails_verification(tmp_path):
    qmodel, result = _deployed(tmp_path, "llm_w4a16", {"group_size": 32})
    path = Path(result.artifacts["genai"]) / "model.onnx"
    model = onnx.load(path)
    (scales,) = [init for init in model.graph.initializer if "layers.1.mlp.up_proj.scales" in init.name]
    values = numpy_helper.to_array(scales).copy()
    values[:8] *= 1.5
    scales.CopyFrom(numpy_helper.from_array(values, scales.name))
    onnx.save(model, path)
    report = verify_deploy(qmodel, result, {"input_ids": _ids(3)}, ["genai"], fidelity=False)
    assert not report.passed and "genai" in report.failures()[0]


def test_a_gpt2_model_gets_none_of_the_llama_files_and_no_folder_for_its_conv1d_layers(tmp_path):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=64, n_layer=2, n_head=4)
        gpt2 = transformers.GPT2LMHeadModel(config).eval()
        gpt2.config.use_cache = False
        qmodel = prepare_by_platform(
            gpt2,
            "llm_w4a16",
            {"example_inputs": {"input_ids": _ids(0)}, "extra_qconfig_dict": {"w_qscheme": {"group_size": 32}}},
        )
        enable_calibration(qmodel)
        qmodel(_ids(1))
        enable_quantization(qmodel)
    with pytest.warns(UserWarning, match=r"compressed_tensors: not written, 8 of the model's layers are not nn.Linear"):
        result = convert_deploy(qmodel, "llm_w4a16", dummy_input={"input_ids": _ids(2)}, output_path=tmp_path)
    assert sorted(result.artifacts) == ["deploy_onnx", "matmulnbits_onnx", "onnx"]
