"""`mqbench ptq` with `quantize_type: weight_only` on the bundled decoder (`model.type: tiny_gpt`): RTN, GPTQ, AWQ and
AWQ-then-GPTQ W3A16 g128 runs (``llm_w4a16`` at 3 bits) that finish, deploy both the blocked Q/DQ and the
MatMulNBits model, verify them, and keep the held-out perplexity close to float's (GPTQ below RTN); the new keys
checked like the others."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import yaml

from mqbench.app.config import ConfigError, parse_config
from mqbench.app.runs import describe_results
from mqbench.app.sources import decoder_recipe
from mqbench.cli import main
from mqbench.models.decoder import DecoderRecipe

# the guide's short recipe (two blocks, 250 steps: trained once, cached) and few windows keep each run short: 2 x 8
# calibration windows of 128 bytes, 16 held-out windows of 129
DECODER_RUN: dict[str, Any] = {
    "model": {"type": "tiny_gpt", "kwargs": {"depth": 2, "steps": 250}},
    "data": {"batch_size": 8, "max_eval": 16},
    "quantize": {"quantize_type": "weight_only", "backend": "llm_w4a16", "cali_batchsize": 2, "verify_samples": 4},
}
# the algorithms' runs at 3 bits: on this short-trained decoder 4-bit rounding to nearest loses 0.03 % of float's
# perplexity (9.2172 against 9.2141 on AVX2), too little for GPTQ or AWQ to take back measurably; 3 bits loses 0.6 %
THREE_BITS = {"extra_prepare_dict": {"extra_qconfig_dict": {"w_qscheme": {"bit": 3}}}}


def _run(
    folder: Path, algorithm: str | list[str] | None, quantize: dict[str, Any] | None = None, **sections: Any
) -> dict[str, Any]:
    config = json.loads(json.dumps({**DECODER_RUN, **sections}))
    if algorithm is not None:
        config["quantize"]["algorithm"] = algorithm
    config["quantize"] |= quantize or {}
    coarse = {"grid": 10, "clip_grid": 10, "sample_rows": 1024}  # AWQ_DEFAULTS: 20 x 20 on 4096 rows, 4x the time
    if algorithm == "awq":
        config["quantize"]["algorithm_config"] = coarse
    elif algorithm == ["awq", "gptq"]:
        config["quantize"]["algorithm_config"] = {"awq": coarse, "gptq": {"act_order": True}}
    folder.mkdir(parents=True)
    (folder / "run.yaml").write_text(yaml.safe_dump(config))
    code = main(["ptq", "--config", str(folder / "run.yaml"), "--output", str(folder / "run"), "--quiet"])
    results = json.loads((folder / "run" / "results.json").read_text())
    assert code == 0, results.get("error")
    return results


@pytest.fixture(scope="module")
def decoder_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """results.json of one W3A16 g128 run per algorithm (and AWQ then GPTQ), on the same calibration and evaluation
    windows."""
    root = tmp_path_factory.mktemp("llm")
    runs = {algorithm: _run(root / algorithm, algorithm, **THREE_BITS) for algorithm in ("rtn", "gptq", "awq")}
    runs["awq+gptq"] = _run(root / "awq+gptq", ["awq", "gptq"], **THREE_BITS)
    return runs


@pytest.mark.parametrize("algorithm", ["rtn", "gptq", "awq", "awq+gptq"])
def test_a_weight_only_decoder_run_finishes_deploys_both_formats_and_verifies(decoder_runs, algorithm):
    results = decoder_runs[algorithm]
    assert results["status"] == "finished"
    assert (results["method"], results["algorithm"], results["backend"]) == ("weight_only", algorithm, "llm_w4a16")
    verify = results["verify"]
    assert verify["passed"] and verify["samples"] == 4
    assert {"onnx", "matmulnbits_onnx"} <= set(verify["artifacts"])
    for key in ("onnx", "matmulnbits_onnx"):
        assert Path(results["artifacts"][key]).is_file()
    ppl = results["perplexity"]
    assert (ppl["windows"], ppl["window_tokens"]) == (16, 128)
    assert all(math.isfinite(ppl[k]) for k in ("float", "simulated", "deployed"))
    # the deployed model (MatMulNBits on onnxruntime) serves what the simulation computes
    assert ppl["deployed"] == pytest.approx(ppl["simulated"], rel=1e-3)
    # within 10 % of float, on either side: the rounding's noise can land a quantized model a hair below float (float
    # training, and so the decoder, differs between AVX2 and AVX-512 hosts).
    # Measured on these 16 windows (AVX2): float 9.2141, RTN 9.2698 (+0.6 %), GPTQ 9.2172, AWQ 9.2523, AWQ then GPTQ
    # 9.2396
    assert ppl["simulated"] == pytest.approx(ppl["float"], rel=0.1), ppl
    assert results["accuracy"]["float"] is None  # no labels: a language model is measured by its perplexity
    report = (Path(results["artifacts"]["onnx"]).parents[1] / "report.md").read_text()
    assert "held-out perplexity (lower is better)" in report and f"{ppl['simulated']:.4f}" in report


def test_gptq_and_awq_beat_rounding_to_nearest_on_the_same_windows(decoder_runs):
    ppl = {algorithm: results["perplexity"]["simulated"] for algorithm, results in decoder_runs.items()}
    assert ppl["gptq"] < ppl["rtn"] and ppl["awq"] < ppl["rtn"] and ppl["awq+gptq"] < ppl["rtn"], ppl
    assert {"awq", "gptq"} <= set(decoder_runs["awq+gptq"]["seconds"])  # both ran, in the order given
    floats = {results["perplexity"]["float"] for results in decoder_runs.values()}
    assert len(floats) == 1  # the same held-out windows in every run


def test_the_terminal_summary_shows_the_perplexity(decoder_runs):
    summary = describe_results(decoder_runs["gptq"])
    ppl = decoder_runs["gptq"]["perplexity"]
    assert "(weight_only)" in summary and "held-out perplexity (lower is better)" in summary
    assert f"float {ppl['float']:.4f}, simulated {ppl['simulated']:.4f}" in summary and "verify passed" in summary
    # the byte embeddings and the head onto the 256 bytes stay float on llm_w4a16, and the run says so
    assert decoder_runs["gptq"]["float_layers"] == {"tokens": "embedding", "positions": "embedding", "head": "lm_head"}
    assert "left float: tokens, positions, head" in summary
    report = (Path(decoder_runs["gptq"]["artifacts"]["onnx"]).parents[1] / "report.md").read_text()
    assert (
        "Left float by the backend (float_layers): tokens (embedding), positions (embedding), head (lm_head)." in report
    )


@pytest.mark.parametrize(
    ("quantize", "message"),
    [
        (
            {"algorithm": "smoothquant"},
            r"'quantize\.algorithm' must be one of rtn, gptq, awq, or a list of gptq and awq run in order "
            r"\(e\.g\. \[awq, gptq\]\), got 'smoothquant'",
        ),
        ({"algorithm": ["rtn", "gptq"]}, r"'quantize\.algorithm' must be one of rtn, gptq, awq, or a list"),
        ({"algorithm": []}, r"'quantize\.algorithm' must be one of rtn, gptq, awq, or a list"),
        ({"algorithm": ["gptq", "awq"]}, r"'quantize\.algorithm' \['gptq', 'awq'\]: gptq must come last"),
        ({"algorithm": ["awq", "awq"]}, r"'quantize\.algorithm' names an algorithm twice: \['awq', 'awq'\]"),
        (
            {"algorithm": ["awq", "gptq"], "algorithm_config": {"damp": 0.1}},
            r"'quantize\.algorithm_config' of the algorithms \['awq', 'gptq'\] maps each one's name to its config "
            r"\(e\.g\. \{gptq: \{act_order: true\}\}\); got 'damp': 0\.1",
        ),
        (
            {"quantize_type": "naive_ptq", "algorithm": "gptq"},
            r"'quantize\.algorithm' is for quantize_type: weight_only",
        ),
        (
            {"quantize_type": "naive_ptq", "algorithm_config": {"damp": 0.1}},
            r"'quantize\.algorithm_config' is for quantize_type: weight_only",
        ),
        ({"algorithm_config": {"damp": 0.1}}, r"'quantize\.algorithm_config' is for gptq and awq; rtn"),
        ({"algorithm_config": [1]}, r"'quantize\.algorithm_config' must be a mapping"),
    ],
)
def test_the_weight_only_keys_are_checked(quantize, message):
    raw = {"model": {"type": "tiny_gpt"}, "quantize": {"quantize_type": "weight_only", **quantize}}
    with pytest.raises(ConfigError, match=r"^run\.yaml: " + message):
        parse_config(raw, "run.yaml")


def test_the_task_follows_the_model_and_brings_its_own_data():
    config = parse_config({"model": {"type": "tiny_gpt"}, "quantize": {"quantize_type": "weight_only"}}, "run.yaml")
    assert config["model"]["task"] == "language_model" and config["quantize"]["algorithm"] == "rtn"
    one = parse_config(
        {"model": {"type": "tiny_gpt"}, "quantize": {"quantize_type": "weight_only", "algorithm": ["gptq"]}}, "run.yaml"
    )
    assert one["quantize"]["algorithm"] == "gptq"  # a list of one is that algorithm
    assert parse_config({}, "run.yaml")["model"]["task"] == "classification"
    with pytest.raises(ConfigError, match=r"'model\.task' is language_model but model\.type 'resnet18'"):
        parse_config({"model": {"task": "language_model"}}, "run.yaml")
    with pytest.raises(ConfigError, match=r"'data\.path': model\.type tiny_gpt brings its own data"):
        parse_config({"model": {"type": "tiny_gpt"}, "data": {"path": "x.npz"}}, "run.yaml")
    with pytest.raises(ConfigError, match=r"'model\.task' must be null \(from model\.type\) or classification"):
        parse_config({"model": {"task": "regression"}}, "run.yaml")


def test_tiny_gpt_s_kwargs_change_its_recipe_and_bad_ones_are_usage_errors():
    assert decoder_recipe({}) == DecoderRecipe()
    assert decoder_recipe({"depth": 1, "steps": 150, "lr": 1}) == DecoderRecipe(depth=1, steps=150, lr=1.0)
    with pytest.raises(
        ConfigError, match=r"^model\.kwargs: tiny_gpt's recipe has no 'layers'; its keys are dim, depth"
    ):
        decoder_recipe({"layers": 2})
    for bad in (
        {"steps": 1.5},
        {"depth": 0},
        {"dim": True},
        {"lr": "fast"},
        {"seed": -1},
        {"steps": float("inf")},
        {"lr": float("nan")},
    ):
        with pytest.raises(
            ConfigError, match=rf"^model\.kwargs\.{next(iter(bad))}: tiny_gpt's recipe takes a (positive|non-negative) "
        ):
            decoder_recipe(bad)
    with pytest.raises(ConfigError, match=r"^model\.kwargs: dim 100 is not a multiple of heads 3"):
        decoder_recipe({"dim": 100, "heads": 3})


def test_an_unknown_algorithm_config_key_is_a_usage_error_naming_the_valid_ones(tmp_path, capsys):
    config = json.loads(json.dumps(DECODER_RUN))
    config["quantize"] |= {"algorithm": "gptq", "algorithm_config": {"dampening": 0.1}, "cali_batchsize": 1}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(SystemExit) as exit:  # a usage error
        main(["ptq", "--config", str(tmp_path / "run.yaml"), "--output", str(tmp_path / "run"), "--quiet"])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert "quantize.algorithm_config" in err and "'dampening'" in err
    assert "valid keys: block_size, damp, act_order, layers" in err
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["status"] == "failed" and "quantize.algorithm_config" in results["error"]


@pytest.fixture(scope="module")
def format_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """W8A8 with the Hadamard rotation and FP8 E4M3, from the command line."""
    root = tmp_path_factory.mktemp("formats")
    w8a8 = {"quantize_type": "naive_ptq", "backend": "tensorrt_nlp", "rotation": {"seed": 1}}
    return {
        "w8a8 rotation": _run(root / "w8a8", None, w8a8),
        "fp8": _run(root / "fp8", None, {"quantize_type": "naive_ptq", "backend": "tensorrt_fp8"}),
    }


@pytest.mark.parametrize("run", ["w8a8 rotation", "fp8"])
def test_rotation_w8a8_and_fp8_runs_finish_deploy_and_verify(format_runs, run):
    results = format_runs[run]
    assert results["status"] == "finished" and results["verify"]["passed"], results.get("verify")
    ppl = results["perplexity"]
    # within 10 % of float on either side (quantization noise may land below float); measured on these 16 windows
    # (AVX2): float 8.876; W8A8 rotated 8.890 (+0.2 %)
    assert ppl["simulated"] == pytest.approx(ppl["float"], rel=0.1), ppl
    assert ppl["deployed"] == pytest.approx(ppl["simulated"], rel=1e-2)
    if "rotation" in run:
        stream = results["rotation"]["streams"][0]
        depth = DECODER_RUN["model"]["kwargs"]["depth"]  # two norms a block and the last one; an online FFN rotation
        assert stream["dim"] == 128 and len(stream["norms"]) == 2 * depth + 1
        assert len(results["rotation"]["online"]) == depth


def test_a_model_the_rotation_cannot_take_is_a_usage_error(tmp_path, capsys):
    config = {
        "model": {"type": "torch.nn:Flatten"},
        "quantize": {"backend": "tensorrt_nlp", "rotation": {}},
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(SystemExit) as exit:
        main(["ptq", "--config", str(tmp_path / "run.yaml"), "--output", str(tmp_path / "run"), "--quiet"])
    assert exit.value.code == 2
    assert "quantize.rotation: hadamard_rotation cannot rotate this model" in capsys.readouterr().err
