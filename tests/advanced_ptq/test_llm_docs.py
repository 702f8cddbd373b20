"""docs/llm_quantization.md runs as written: GPTQ at W3A16 and its deployment verify, GPTQ on weights kept on disk
(the same model), the FP8 / W8A8 / W3A16 part, and the checkpoints LLM runtimes load (loaded as a user would);
GPTQ's perplexity is below rounding to nearest's on the same decoder."""

from __future__ import annotations

import re
from pathlib import Path

import torch
import yaml

from mqbench.advanced_ptq.weight_only import calibrate_weights
from mqbench.app.config import parse_config
from mqbench.models.decoder import held_out_perplexity
from mqbench.prepare_by_platform import prepare_by_platform
from mqbench.utils.state import enable_quantization

DOC = Path(__file__).resolve().parents[2] / "docs" / "llm_quantization.md"


def test_the_guide_runs_deploys_and_verifies(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the decoder is cached where the suite's other decoders are (its command-line runs')
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) == 5
    namespace: dict = {"__name__": "llm_guide"}
    for block in blocks:
        exec(compile(block, str(DOC), "exec"), namespace)
    out = capsys.readouterr().out
    assert "W3A16 GPTQ" in out and "FP8 E4M3: perplexity" in out and "W4A16 rotation + GPTQ: perplexity" in out
    assert "weights on disk: 0 left to load" in out
    # GPTQ with the weights on disk gives the model GPTQ gave in memory
    lazy, qmodel = namespace["lazy"].state_dict(), namespace["qmodel"].state_dict()
    assert lazy.keys() == qmodel.keys() and all(torch.equal(lazy[name], qmodel[name]) for name in qmodel)
    assert "['compressed_tensors', 'deploy_onnx', 'genai', 'matmulnbits_onnx', 'onnx']" in out
    # the serving section: both checkpoints written and verified by their loaders, and loaded as a user would
    assert "served: ['compressed_tensors', 'deploy_onnx', 'genai', 'gguf', 'matmulnbits_onnx', 'onnx'] passed" in out
    assert re.search(r"FP8 folder: \S*llama_fp8/\S+_compressed_tensors passed", out)
    ids = namespace["ids"]
    with torch.no_grad():
        folder_logits = namespace["folder_model"](ids).logits
        gguf_logits = namespace["gguf_model"](ids).logits
        simulated = namespace["served"](input_ids=ids)
    simulated = simulated["logits"] if isinstance(simulated, dict) else simulated[0]
    assert torch.allclose(folder_logits, simulated, atol=1e-4) and torch.allclose(gguf_logits, simulated, atol=1e-4)
    tokens = [int(t) for t in out.split("onnxruntime-genai: [")[1].split("]")[0].split(",")]
    prompt = ids[:1, :8]
    with torch.no_grad():
        for _ in range(16):
            step = namespace["served"](input_ids=prompt)
            step = step["logits"] if isinstance(step, dict) else step[0]
            prompt = torch.cat([prompt, step[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert tokens == prompt[0, 8:].tolist()  # the KV-cache decoder generates the simulation's greedy tokens
    nearest = prepare_by_platform(namespace["model"], "llm_w4a16", namespace["W3"])  # the same 3-bit grid
    calibrate_weights(nearest)
    enable_quantization(nearest)
    evaluation = namespace["evaluation"]
    assert held_out_perplexity(namespace["qmodel"], evaluation) < held_out_perplexity(nearest, evaluation)


def test_the_guide_s_command_line_configurations_are_valid():
    decoder, causal_lm, served = re.findall(r"```yaml\n(.*?)```", DOC.read_text(), flags=re.S)
    config = parse_config(yaml.safe_load(decoder), "llm_quantization.md")
    quantize = config["quantize"]
    assert (quantize["quantize_type"], quantize["algorithm"], quantize["rotation"]) == ("weight_only", "gptq", {})
    assert config["model"]["task"] == "language_model"
    config = parse_config(yaml.safe_load(causal_lm), "llm_quantization.md")  # SmolLM2's GGUF file on your text
    assert (config["model"]["type"], config["model"]["task"], config["data"]["seq_len"]) == (
        "causal_lm",
        "language_model",
        256,
    )
    config = parse_config(yaml.safe_load(served), "llm_quantization.md")  # the W8A8 folder vLLM serves
    assert (config["quantize"]["smooth"], config["model"]["kwargs"]) == ("after_norm", {"attn_implementation": "sdpa"})
