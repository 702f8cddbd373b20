"""`mqbench ptq` on a Hugging Face causal language model (`model.type: causal_lm`) with a text corpus (`data.path`):
a small random-weight Llama saved with save_pretrained (with a byte-level BPE tokenizer trained here) on .txt files
and on a .jsonl file: weight-only RTN and GPTQ runs and a W8A8 run after the Hadamard rotation that finish, deploy,
verify and keep the held-out perplexity near float's; SmolLM2-135M-Instruct from its GGUF file; and every usage error
of the new keys, each naming the key."""

from __future__ import annotations

import json
import math
import re
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import yaml

from mqbench.app.causal_lm import HELD_OUT_SHARE, load_causal_lm, text_documents, token_stream_windows
from mqbench.app.config import CAUSAL_LM_SEQ_LEN, ConfigError, load_config, parse_config
from mqbench.app.runs import describe_results
from mqbench.cli import main
from mqbench.models.decoder import stdlib_corpus

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

VOCAB = 512
DOCUMENTS = 10


def _tokenizer(text: str) -> Any:
    """A byte-level BPE tokenizer of VOCAB tokens trained on ``text`` (a fraction of a second), end of text its
    only special token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([text], trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>")


def _save_llama(folder: Path, tokenizer: Any, vocab: int = VOCAB) -> Path:
    """A random-weight Llama of two blocks (width 128, tied embeddings) and ``tokenizer``, as save_pretrained
    writes them."""
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """The model folder, a folder of DOCUMENTS .txt files of the standard library's source and the same documents as
    a .jsonl file."""
    root = tmp_path_factory.mktemp("causal_lm")
    train, _ = stdlib_corpus(100_000)
    text = train.decode("utf-8", errors="ignore")
    model = _save_llama(root / "model", _tokenizer(text[:60_000]))
    lines = text[:40_000].splitlines(keepends=True)
    size = len(lines) // DOCUMENTS
    documents = ["".join(lines[i * size : (i + 1) * size]) for i in range(DOCUMENTS)]
    texts = root / "texts"
    (texts / "more").mkdir(parents=True)  # subfolders are read too, the files sorted by path
    for index, document in enumerate(documents):
        (texts / ("more" if index >= 5 else "") / f"{index:02d}.txt").write_text(document)
    (texts / "notes.md").write_text("not read: only .txt files are")
    jsonl = root / "texts.jsonl"
    jsonl.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(documents)) + "\n")
    return SimpleNamespace(root=root, model=model, texts=texts, jsonl=jsonl, documents=documents)


def _config(model: Path | str, data: Path | str, **quantize: Any) -> dict[str, Any]:
    # 2 x 4 calibration windows of 32 tokens, 8 held-out windows of 33
    return {
        "model": {"type": "causal_lm", "path": str(model)},
        "data": {"path": str(data), "seq_len": 32, "batch_size": 4, "max_eval": 8},
        "quantize": {
            "quantize_type": "weight_only",
            "backend": "llm_w4a16",
            "cali_batchsize": 2,
            "verify_samples": 4,
            **quantize,
        },
    }


def _run(folder: Path, config: dict[str, Any]) -> dict[str, Any]:
    folder.mkdir(parents=True)
    (folder / "run.yaml").write_text(yaml.safe_dump(config))
    code = main(["ptq", "--config", str(folder / "run.yaml"), "--output", str(folder / "run"), "--quiet"])
    results = json.loads((folder / "run" / "results.json").read_text())
    assert code == 0, results.get("error")
    return results


@pytest.mark.parametrize("algorithm", ["rtn", "gptq"])
def test_a_causal_lm_run_finishes_deploys_verifies_and_stays_near_float(corpus, tmp_path, algorithm):
    """W4A16 g128: RTN on the .txt folder, GPTQ on the .jsonl file (each run in its own test: a shared fixture would
    run on each worker of a parallel session)."""
    source = corpus.texts if algorithm == "rtn" else corpus.jsonl
    results = _run(tmp_path / algorithm, _config(corpus.model, source, algorithm=algorithm))
    assert results["status"] == "finished"
    assert (results["method"], results["algorithm"], results["backend"]) == ("weight_only", algorithm, "llm_w4a16")
    assert results["verify"]["passed"] and results["verify"]["samples"] == 4
    assert {"onnx", "matmulnbits_onnx"} <= set(results["artifacts"])
    ppl = results["perplexity"]
    assert (ppl["windows"], ppl["window_tokens"]) == (8, 32)
    assert all(math.isfinite(ppl[key]) for key in ("float", "simulated", "deployed"))
    # random weights: the float model is near uniform over the 512 tokens; 4-bit groups of its Gaussian weights add
    # little. Measured on these 8 windows: float 542.92, RTN 543.94 (+0.2 %), GPTQ 544.29 (+0.3 %)
    assert 100 < ppl["float"] < 2 * VOCAB
    assert ppl["simulated"] == pytest.approx(ppl["float"], rel=0.05), ppl
    assert ppl["deployed"] == pytest.approx(ppl["simulated"], rel=1e-3)
    assert results["float_layers"] == {"model.embed_tokens": "embedding", "lm_head": "lm_head"}
    # the model and the text, named in results.json, the summary and the report
    model = f"causal_lm {corpus.model} (LlamaForCausalLM, 2 blocks, "
    assert results["model"].startswith(model)
    data = results["data"]
    text = f"{source} ({'.txt files' if algorithm == 'rtn' else 'JSON lines'}: {DOCUMENTS} documents, "
    assert data["source"].startswith(text)
    assert "tokens with the model's tokenizer" in data["source"] and "32 tokens a window" in data["source"]
    assert (data["calibration_samples"], data["val_samples"]) == (8, 8)
    summary = describe_results(results)
    assert summary.startswith(model) and f"\ndata: {text}" in summary
    assert f"float {ppl['float']:.4f}, simulated {ppl['simulated']:.4f}" in summary and "verify passed" in summary
    report = (tmp_path / algorithm / "run" / "report.md").read_text()
    assert f"# PTQ run: {model}" in report and f"Data: {text}" in report
    assert "held-out perplexity (lower is better)" in report and f"{ppl['simulated']:.4f}" in report
    # config.yaml holds every default (the image keys too): it is a valid causal_lm configuration
    config = load_config(tmp_path / algorithm / "run" / "config.yaml")
    assert (config["model"]["task"], config["data"]["seq_len"]) == ("language_model", 32)


def test_w8a8_with_the_rotation_on_a_causal_lm(corpus, tmp_path):
    """The other quantize keys apply unchanged: W8A8 (tensorrt_nlp, SmoothQuant by its recipe) after the Hadamard
    rotation of the residual stream."""
    config = _config(corpus.model, corpus.texts, quantize_type="naive_ptq", backend="tensorrt_nlp", rotation={})
    results = _run(tmp_path / "w8a8", config)
    assert results["verify"]["passed"], results["verify"]["failures"]
    assert len(results["rotation"]["streams"][0]["norms"]) == 2 * 2 + 1  # LlamaRMSNorm: two a block and the last
    ppl = results["perplexity"]
    # measured on these 8 windows: float 542.92, W8A8 rotated 543.29 (+0.07 %)
    assert ppl["simulated"] == pytest.approx(ppl["float"], rel=0.05), ppl
    assert ppl["deployed"] == pytest.approx(ppl["simulated"], rel=1e-2)


@pytest.mark.parametrize("backend", ["tensorrt_nlp", "tensorrt_fp8"])
def test_w8a8_and_fp8_runs_write_the_compressed_tensors_folder_with_sdpa_attention(corpus, tmp_path, backend):
    """Attention by scaled_dot_product_attention (float, as vLLM serves it), the runtime's int8 input grid and
    SmoothQuant on the norms' outputs only: the folder holds the simulation, and transformers computes it."""
    config = _config(corpus.model, corpus.texts, quantize_type="naive_ptq", backend=backend, smooth="after_norm")
    config["model"]["kwargs"] = {"attn_implementation": "sdpa"}
    config["extra_prepare_dict"] = {"extra_qconfig_dict": {"a_qscheme": {"symmetric_range": False}}}
    if backend == "tensorrt_fp8":
        config["extra_prepare_dict"] = {}
    results = _run(tmp_path / backend, config)
    assert results["verify"]["passed"], results["verify"]["failures"]
    folder = Path(results["artifacts"]["compressed_tensors"])
    quantization = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert quantization["format"] == ("int-quantized" if backend == "tensorrt_nlp" else "float-quantized")
    assert (folder / "tokenizer.json").is_file()  # copied from the model's folder
    assert results["model"].endswith(", sdpa attention)")
    with pytest.raises(ConfigError, match=r"'quantize\.smooth' must be null .* after_norm"):
        parse_config({**config, "quantize": {**config["quantize"], "smooth": "norms"}}, "run.yaml")


def test_the_configuration_guide_s_causal_lm_example_is_valid():
    import mqbench.app.causal_lm

    blocks = re.findall(r"code-block:: yaml\n\n(.*?)\n\n", mqbench.app.causal_lm.__doc__ or "", flags=re.S)
    (example,) = [block for block in blocks if "type: causal_lm" in block]
    config = parse_config(yaml.safe_load(textwrap.dedent(example)), "config.py")
    assert config["model"]["path"].endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert (config["model"]["task"], config["data"]["seq_len"]) == ("language_model", 256)


def test_the_text_folder_and_the_jsonl_file_give_the_same_windows(corpus):
    """The same documents in the same order: one token stream, the same windows."""
    _, _, texts = load_causal_lm(parse_config(_config(corpus.model, corpus.texts), "run.yaml"))
    _, _, lines = load_causal_lm(parse_config(_config(corpus.model, corpus.jsonl), "run.yaml"))
    assert torch.equal(texts.train, lines.train) and torch.equal(texts.val, lines.val)
    assert texts.source.split(": ", 1)[1] == lines.source.split(": ", 1)[1]


def test_the_stream_is_split_at_its_last_tenth_and_windows_are_seeded(corpus):
    config = parse_config(_config(corpus.model, corpus.texts), "run.yaml")
    model, described, data = load_causal_lm(config)
    assert not model.training and model.config.use_cache is False
    assert next(model.parameters()).dtype == torch.float32
    assert model.config._attn_implementation == "eager"
    tokenizer = transformers.AutoTokenizer.from_pretrained(corpus.model)
    ids = tokenizer(corpus.documents, add_special_tokens=False)["input_ids"]
    stream = torch.tensor([t for i, doc in enumerate(ids) for t in ([tokenizer.eos_token_id] if i else []) + doc])
    held = len(stream) // HELD_OUT_SHARE
    assert f"{len(stream)} tokens" in data.source and f"held-out windows from the last {held};" in data.source
    assert data.train.shape == (8, 32) and data.val.shape == (8, 33)
    assert data.train.dtype == data.val.dtype == torch.int64
    # the calibration windows (seed process.seed + 1) from the first part, the held-out ones (seed 1000) the last
    assert torch.equal(data.train, token_stream_windows(stream[: len(stream) - held], 32, 8, 1))
    assert torch.equal(data.val, token_stream_windows(stream[len(stream) - held :], 33, 8, 1000))
    assert described.startswith(f"causal_lm {corpus.model} (LlamaForCausalLM, 2 blocks, ")


def test_the_defaults_of_a_causal_lm_configuration():
    config = parse_config({"model": {"type": "causal_lm", "path": "m"}, "data": {"path": "t"}}, "run.yaml")
    assert (config["model"]["task"], config["data"]["seq_len"]) == ("language_model", CAUSAL_LM_SEQ_LEN)
    assert parse_config({}, "run.yaml")["data"]["seq_len"] is None  # other models: not used


def test_text_documents_reads_a_folder_datasets_saved(tmp_path, monkeypatch):
    """A folder save_to_disk wrote is read with datasets.load_from_disk (stood in for here): the text column of the
    dataset, or of a dataset dict's train split."""

    class Dataset:
        def __init__(self, texts: list[str], columns: tuple[str, ...] = ("text",)) -> None:
            self.texts, self.column_names = texts, list(columns)

        def __getitem__(self, column: str) -> list[str]:
            return self.texts

    saved = {"dataset": Dataset(["one", "two"])}
    monkeypatch.setitem(sys.modules, "datasets", SimpleNamespace(load_from_disk=lambda path: saved["dataset"]))
    (tmp_path / "state.json").write_text("{}")
    assert text_documents(str(tmp_path)) == (["one", "two"], "datasets folder")
    saved["dataset"] = {"test": Dataset(["x"]), "train": Dataset(["a", "b", "c"])}
    assert text_documents(str(tmp_path))[0] == ["a", "b", "c"]
    saved["dataset"] = {"validation": Dataset(["v"])}
    assert text_documents(str(tmp_path))[0] == ["v"]
    saved["dataset"] = {"validation": Dataset(["v"]), "test": Dataset(["x"])}
    with pytest.raises(ConfigError, match=r"the splits validation, test and no train split"):
        text_documents(str(tmp_path))
    saved["dataset"] = Dataset(["q"], columns=("question", "answer"))
    with pytest.raises(ConfigError, match=r"the dataset has no \"text\" column \(its columns: question, answer\)"):
        text_documents(str(tmp_path))


def test_a_folder_datasets_saved_without_datasets_installed_says_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets raises ImportError
    (tmp_path / "dataset_info.json").write_text("{}")
    with pytest.raises(
        ConfigError,
        match=r"^data\.path '.*' is a folder datasets' save_to_disk wrote; reading it needs the datasets "
        r"package: pip install datasets",
    ):
        text_documents(str(tmp_path))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"model": {"type": "causal_lm", "path": None}},
            r"'model\.path' is missing; model\.type causal_lm loads a Hugging Face causal language model from it: a "
            r"folder save_pretrained wrote \(config\.json, the weights and the tokenizer\) or a \.gguf file",
        ),
        (
            {"data": {"path": None, "seq_len": 32}},
            r"'data\.path' is missing; model\.type causal_lm calibrates and measures its perplexity on text",
        ),
        (
            {"data": {"path": None, "factory": "texts:load"}},
            r"'data\.factory': model\.type causal_lm reads text from data\.path .*; remove data\.factory and give "
            r"data\.path",
        ),
        (
            {"data": {"path": "t", "input_size": 224}},
            r"'data\.input_size': model\.type causal_lm reads text \(data\.path, cut into windows of data\.seq_len "
            r"tokens\); this key is for image data and not used: remove data\.input_size",
        ),
        (
            {"data": {"path": "t", "mean": [0.5], "std": [0.5]}},
            r"'data\.mean, data\.std': .*these keys are for image data and not used: remove data\.mean, data\.std",
        ),
        (
            {"data": {"path": "t", "kwargs": {"split": "train"}}},
            r"'data\.kwargs': .*this key is for image data or data\.factory and not used: remove data\.kwargs",
        ),
        ({"data": {"path": "t", "seq_len": 0}}, r"'data\.seq_len' must be a positive integer \(tokens a window"),
        (
            {"model": {"type": "causal_lm", "path": "m", "tracer": "huggingface"}},
            r"'model\.tracer' and 'model\.output' are for your own classification and embedding models",
        ),
        (
            {"model": {"type": "causal_lm", "path": "m", "task": "classification"}},
            r"'model\.task' is classification but model\.type 'causal_lm' is a language_model model",
        ),
        (
            {"model": {"type": "tiny_gpt", "path": None}, "data": {"path": None, "seq_len": 64}},
            r"'data\.seq_len' is the window length, in tokens, of the text model\.type causal_lm reads; model\.type "
            r"'tiny_gpt' does not read it \(tiny_gpt's windows are its context, model\.kwargs\.context\); remove "
            r"data\.seq_len",
        ),
        (
            {"model": {"type": "resnet18", "path": None}, "data": {"path": None, "seq_len": 64}},
            r"'data\.seq_len' is the window length, in tokens, of the text model\.type causal_lm reads; model\.type "
            r"'resnet18' does not read it; remove data\.seq_len",
        ),
    ],
)
def test_the_causal_lm_keys_are_checked(change, message):
    raw: dict[str, Any] = {"model": {"type": "causal_lm", "path": "m"}, "data": {"path": "t"}}
    for section, values in change.items():
        raw[section] = {**raw[section], **values}
        raw[section] = {key: value for key, value in raw[section].items() if value is not None}
    with pytest.raises(ConfigError, match=r"^run\.yaml: " + message):
        parse_config(raw, "run.yaml")


def _load(model: Path | str, data: Path | str, **model_keys: Any) -> None:
    raw = _config(model, data)
    raw["model"] |= model_keys
    load_causal_lm(parse_config(raw, "run.yaml"))


def test_a_missing_model_path_or_a_folder_without_config_json_is_a_usage_error(corpus, tmp_path):
    with pytest.raises(ConfigError, match=r"^model\.path '.*nowhere': no such folder or file; model\.type causal_lm"):
        _load(tmp_path / "nowhere", corpus.jsonl)
    (tmp_path / "empty").mkdir()
    with pytest.raises(
        ConfigError,
        match=r"^model\.path '.*empty': the folder has no config\.json; give a folder a Hugging Face "
        r"model's save_pretrained wrote \(config\.json, model\.safetensors, the tokenizer's files\) or a \.gguf file",
    ):
        _load(tmp_path / "empty", corpus.jsonl)
    (tmp_path / "model.bin").write_bytes(b"\0")
    with pytest.raises(ConfigError, match=r"^model\.path '.*model\.bin' is a file but not a \.gguf file"):
        _load(tmp_path / "model.bin", corpus.jsonl)


def test_a_gguf_file_without_the_gguf_package_says_how_to_install_it(corpus, tmp_path, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else find_spec(name, *a))
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    with pytest.raises(
        ConfigError,
        match=r"^model\.path '.*model\.gguf': transformers reads GGUF files with the gguf and accelerate "
        r"packages, and gguf is not installed: pip install gguf accelerate \(or pip install mqbench\[llm\]\)",
    ):
        _load(tmp_path / "model.gguf", corpus.jsonl)


def test_a_model_without_its_tokenizer_is_a_usage_error(corpus, tmp_path):
    folder = _save_llama(tmp_path / "bare", None)
    with pytest.raises(
        ConfigError,
        match=r"^model\.path '.*bare': its tokenizer cannot be loaded with AutoTokenizer\.from_pretrained "
        r"\(.*\); save the model's tokenizer beside it: tokenizer\.save_pretrained\(folder\)",
    ):
        _load(folder, corpus.jsonl)


def test_a_tokenizer_beyond_the_model_s_vocabulary_is_a_usage_error(corpus, tmp_path):
    tokenizer = transformers.AutoTokenizer.from_pretrained(corpus.model)
    folder = _save_llama(tmp_path / "small", tokenizer, vocab=300)
    with pytest.raises(
        ConfigError,
        match=r"^data\.path '.*': the tokenizer at model\.path gives token id \d+, beyond the model's 300 "
        r"embeddings",
    ):
        _load(folder, corpus.jsonl)


def test_model_kwargs_go_to_from_pretrained_except_what_mqbench_sets(corpus):
    with pytest.raises(ConfigError, match=r"^model\.kwargs: dtype, gguf_file are set by mqbench for model\.type"):
        _load(corpus.model, corpus.jsonl, kwargs={"dtype": "float16", "gguf_file": "x.gguf"})
    with pytest.raises(ConfigError, match=r"^model\.kwargs\.attn_implementation must be eager .* or sdpa .*'flash'"):
        _load(corpus.model, corpus.jsonl, kwargs={"attn_implementation": "flash"})
    with pytest.raises(
        ConfigError,
        match=r"^model\.path '.*': AutoModelForCausalLM\.from_pretrained cannot load it with model\.kwargs "
        r"\{'no_such_argument': 1\} \(TypeError: ",
    ):
        _load(corpus.model, corpus.jsonl, kwargs={"no_such_argument": 1})
    raw = _config(corpus.model, corpus.jsonl)
    raw["model"]["kwargs"] = {"num_hidden_layers": 1}  # a configuration key: the first block only
    model, described, _ = load_causal_lm(parse_config(raw, "run.yaml"))
    assert len(model.model.layers) == 1 and described.endswith(", num_hidden_layers 1)")


def test_text_that_is_missing_empty_or_not_text_is_a_usage_error(corpus, tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"^data\.path '.*missing\.jsonl': no such folder or file; model\.type "
        r"causal_lm reads text: a folder of \.txt files, a \.txt file, a \.jsonl file",
    ):
        text_documents(str(tmp_path / "missing.jsonl"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "README.md").write_text("no text here")
    with pytest.raises(ConfigError, match=r"^data\.path '.*empty': the folder holds no \.txt files \(nor a dataset"):
        text_documents(str(tmp_path / "empty"))
    lines = tmp_path / "lines.jsonl"
    lines.write_text('{"text": "one"}\n\n{"content": "two"}\n')
    with pytest.raises(
        ConfigError,
        match=r"^data\.path '.*lines\.jsonl': line 3 has no \"text\" field holding a string \(keys "
        r"'content'\); each line of a \.jsonl file is one document: \{\"text\": \"\.\.\.\"\}",
    ):
        text_documents(str(lines))
    lines.write_text('{"text": "one"}\nnot json\n')
    with pytest.raises(ConfigError, match=r"^data\.path '.*lines\.jsonl': line 2 is not JSON"):
        text_documents(str(lines))
    lines.write_text("\n")
    with pytest.raises(ConfigError, match=r"^data\.path '.*lines\.jsonl': the file holds no lines"):
        text_documents(str(lines))
    (tmp_path / "text.csv").write_text("a,b")
    with pytest.raises(ConfigError, match=r"^data\.path '.*text\.csv' is neither a \.jsonl nor a \.txt file"):
        text_documents(str(tmp_path / "text.csv"))
    (tmp_path / "one.txt").write_text("a single document")
    assert text_documents(str(tmp_path / "one.txt")) == (["a single document"], "text file")


def test_too_few_tokens_for_one_window_is_a_usage_error(corpus, tmp_path):
    short = tmp_path / "short.jsonl"
    short.write_text(json.dumps({"text": corpus.documents[0][:500]}) + "\n")
    with pytest.raises(
        ConfigError,
        match=r"^data\.path '.*short\.jsonl': \d+ tokens with the model's tokenizer; their held-out part "
        r"\(the last 1/10\) has \d+, too few for one window of 33 tokens \(data\.seq_len 32 \+ 1 for the targets\); "
        r"give more text \(about 340 tokens at least\) or a smaller data\.seq_len",
    ):
        _load(corpus.model, short)


def test_a_usage_error_from_the_command_line_exits_with_2_naming_the_key(corpus, tmp_path, capsys):
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(_config(tmp_path / "nowhere", corpus.jsonl)))
    with pytest.raises(SystemExit) as exit:
        main(["ptq", "--config", str(tmp_path / "run.yaml"), "--output", str(tmp_path / "run"), "--quiet"])
    assert exit.value.code == 2
    assert "model.path" in capsys.readouterr().err
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["status"] == "failed" and "no such folder or file" in results["error"]


@pytest.mark.slow  # 75 s alone, 108 s beside the rest of tests/app on 2 cores: reading the GGUF file twice
# (tokenizer, weights) and writing the 49152 x 576 embedding table into both ONNX files
def test_smollm2_from_its_gguf_file(corpus, tmp_path):
    """The real SmolLM2-135M-Instruct through model.path: its GGUF file (the weights dequantized to float32, its own
    tokenizer); model.kwargs keep its first two blocks (then its final norm and tied lm_head), which keeps the run
    short: the perplexity of a cut model is not a language model's, the run's path through the GGUF file is what is
    tested (all 30 blocks take about 5 minutes here, most of it deploying and verifying)."""
    smollm2 = pytest.importorskip("mqbench.models.smollm2")
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    try:
        path = smollm2.smollm2_path()
    except FileNotFoundError as error:  # the Makefile installs the wheel; a bare checkout may lack it
        pytest.skip(str(error))
    config = _config(path, corpus.texts, algorithm="rtn", cali_batchsize=1, verify_samples=2)
    config["model"]["kwargs"] = {"num_hidden_layers": 2}
    config["data"] |= {"seq_len": 16, "batch_size": 2, "max_eval": 2}
    results = _run(tmp_path / "smollm2", config)
    assert results["verify"]["passed"]
    assert results["model"].startswith(f"causal_lm {path} (LlamaForCausalLM, 2 blocks, ")
    assert results["model"].endswith(", num_hidden_layers 2)")
    ppl = results["perplexity"]
    assert (ppl["windows"], ppl["window_tokens"]) == (2, 16)
    assert all(math.isfinite(ppl[key]) for key in ("float", "simulated", "deployed"))
    assert ppl["deployed"] == pytest.approx(ppl["simulated"], rel=1e-3)
    assert results["float_layers"] == {"model.embed_tokens": "embedding", "lm_head": "lm_head"}
