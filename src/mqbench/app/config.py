"""Run configurations: MQBench's application YAML layout, read and checked key by key.

The layout is the one MQBench's ImageNet example uses (``model``, ``data``, ``quantize``,
``extra_prepare_dict``, ``process``), so its configs load unchanged; mqbench adds a few keys (marked
below). Every key is checked: an unknown key or a wrong value is an error naming the file, the key
and the valid choices. Missing sections and keys take the defaults below.

.. code-block:: yaml

    model:
      type: resnet18            # a zoo name, an import path "package.module:factory", or a torchvision/timm name;
                                #   mqbench: tiny_gpt (the bundled decoder) or causal_lm (a Hugging Face causal LM)
      kwargs: {}                # passed to the factory (causal_lm: to from_pretrained)
      path: null                # a checkpoint (state dict), read with torch.load(weights_only=True); causal_lm: a
                                #   folder save_pretrained wrote (config.json, weights, tokenizer) or a .gguf file
      tracer: null              # mqbench: null (torch.fx) or huggingface (HFTracer on transformers 4, export on 5)
      input_names: null         # mqbench, huggingface: the forward arguments the data feeds (default [input_ids])
      output: null              # mqbench: which output holds the class scores: null (the tensor, a mapping's
                                #   logits, else the first), an index into the outputs as returned (flattened),
                                #   or a key of a mapping output
      task: null                # mqbench: classification, language_model or embedding; null: language_model
                                #   for model.type tiny_gpt and causal_lm, else classification
    data:
      path: null                # null: the bundled digits; a folder with train/ and val/; or a .npz file;
                                #   causal_lm: text (a folder of .txt files, a .jsonl file with a "text" field a
                                #   line, or a folder datasets' save_to_disk wrote)
      factory: null             # mqbench: instead of path, package.module:function returning the train and
      kwargs: {}                #   val datasets ({train, val} or a pair), called with data.kwargs
      batch_size: 32
      num_workers: 0
      pin_memory: false
      input_size: 32            # images are resized to input_size (after test_resize for folders)
      test_resize: 32
      mean: [0.485, 0.456, 0.406]   # mqbench: normalisation of folder images
      std: [0.229, 0.224, 0.225]
      max_eval: null            # mqbench: evaluate on at most this many validation samples (language_model:
                                #   held-out windows, default 64)
      seq_len: null             # mqbench, causal_lm: tokens a calibration window (held-out: seq_len + 1); null: 256
    quantize:
      quantize_type: naive_ptq  # naive_ptq, advanced_ptq or weight_only (mqbench); MQBench's older names: ptq
                                # (advanced_ptq when reconstruction is given, else naive_ptq) and qat (mqbench qat)
      cali_batchsize: 4         # calibration batches (of data.batch_size)
      backend: Academic
      reconstruction: {...}     # advanced_ptq: ptq_reconstruction's config
      algorithm: rtn            # mqbench, weight_only: rtn (round to nearest, reads no data), gptq or awq; or
                                #   a list run in order, gptq last: [awq, gptq]
      algorithm_config: {}      # mqbench, weight_only: gptq's or awq's config (GPTQ_DEFAULTS / AWQ_DEFAULTS keys);
                                #   with a list, each algorithm's by its name: {gptq: {act_order: true}}
      rotation: null            # mqbench: null, or hadamard_rotation's config ({} for its defaults:
                                #   ROTATION_DEFAULTS) to rotate a pre-norm transformer's residual stream first
                                #   ({residual: false}: only the MLPs' down-projection inputs, any transformer)
      recipe: null              # mqbench: calibration recipe: null (the backend's ptq_recipe; its transformer_recipe
                                #   for a model with LayerNorm or RMSNorm), plain, or {activation_observer:
                                #   PercentileObserver, equalize: true, bias_correction: true, smooth: true,
                                #   smooth_alpha: 0.95}
      smooth: null              # mqbench: SmoothQuant before calibration: null (the backend's default), true, false,
                                #   or after_norm (the norms' outputs only: the scales a Hugging Face checkpoint holds)
      deploy: {model_name: model, output_path: null, deploy_to_qlinear: false}
      verify_samples: 32        # mqbench: validation samples verify_deploy compares on
    extra_prepare_dict: {...}   # prepare_by_platform's prepare_custom_config_dict
    training:                   # mqbench: mqbench qat
      epochs: 1
      lr: 1.0e-4
      optimizer: adam           # adam, adamw or sgd
      momentum: 0.9             # sgd
      weight_decay: 0.0
      max_steps: null           # optimizer steps per epoch (null: the whole training set)
      lr_scheduler: null        # null (constant) or cosine (lr (1 + cos(pi epoch / epochs)) / 2, set per epoch)
      resume: null              # checkpoint.pt of an earlier run of the same configuration
    process:
      seed: 0
    profile:                    # mqbench: mqbench profile
      modes: [standalone, interaction]
      batches: 2                # calibration batches the per-layer errors are measured on
    mixed_precision:            # mqbench: mqbench mixed-precision (backends listing mixed_precision_bits)
      weight_bits: [8, 4, 2]    # candidate widths per weight quantizer
      activation_bits: [8]      # candidate widths per activation quantizer
      budget: {average_weight_bits: 5}   # and/or size_bytes, bitops (replaces the default whole)
      pareto: []                # more budgets to sweep, each evaluated: the report's accuracy vs size plot

``data.batch_size`` is per process: under ``torchrun`` with N processes a step sees N batches.

Weight-only quantization of language models (``quantize_type: weight_only``): the weights are rounded by
``algorithm`` (``rtn``: each weight quantizer calibrated on its own weight; ``gptq`` / ``awq``:
:func:`~mqbench.advanced_ptq.gptq` / :func:`~mqbench.advanced_ptq.awq` on the calibration batches with
``algorithm_config``; a list such as ``[awq, gptq]``: AWQ's scales and clipping, then GPTQ on the scaled
layers, each with its own config, ``algorithm_config: {awq: {...}, gptq: {...}}``), then the model quantizes.
The bits and group size are the backend's (``llm_w4a16``: 4-bit symmetric groups of 128 input channels;
``llm_w8a16``: 8-bit); change them through ``extra_qconfig_dict``. A backend that also quantizes activations
(``tensorrt_nlp``'s W8A8) gets its activation calibration first (as naive_ptq does), then the algorithm re-rounds
its weights. ``rotation`` (any quantize_type) first rotates a pre-norm transformer's residual stream
(:func:`~mqbench.advanced_ptq.hadamard_rotation`, which recalibrates; ``{residual: false}``: only the MLPs'
down-projection inputs, which post-norm encoders such as MiniLM allow too):

.. code-block:: yaml

    model: {type: tiny_gpt}     # the bundled decoder (task language_model): perplexity on held-out windows
    data: {batch_size: 8, max_eval: 64}   # calibration: cali_batchsize x batch_size training windows
    quantize: {quantize_type: weight_only, backend: llm_w4a16, algorithm: gptq, algorithm_config: {damp: 0.01},
               rotation: {}}   # optional: Hadamard rotation (ROTATION_DEFAULTS) before GPTQ
    extra_prepare_dict:         # W3A16, groups of 64 (optional: the backend's scheme otherwise)
      extra_qconfig_dict: {w_qscheme: {bit: 3, group_size: 64}}

Tasks (``model.task``): ``classification`` (top-1 accuracy on labelled validation samples); ``language_model``
(``model.type: causal_lm``, a Hugging Face model on your text, below; or ``tiny_gpt``,
:func:`mqbench.models.decoder.trained_decoder`'s byte-level decoder with its standard library corpus;
``model.kwargs`` changes its recipe's fields, e.g. ``{depth: 2, steps: 250}``: calibration on
``cali_batchsize x batch_size`` windows of 128 bytes of the training part, drawn with seed ``process.seed + 1``;
the metric is the perplexity, lower is better, on ``max_eval`` (default 64) windows of 129 bytes of the held-out
part, drawn with seed 1000; deployment is verified on their first 128 bytes). tiny_gpt brings
its own data: ``data.path`` and ``data.factory`` stay null, ``data.batch_size`` and ``data.max_eval`` apply, the
image keys are not used; ``embedding`` (a sentence encoder, any model.type but the bundled tiny_gpt, with the
data of ``data``; labels are not read): the output ``model.output`` selects (``[N, L, D]`` hidden states, e.g.
``last_hidden_state``, averaged over the L tokens, or ``[N, D]`` already pooled) is L2-normalised into one
embedding per validation sample, and the metric is the agreement of the quantized model's embeddings with the float
model's (:func:`mqbench.models.sentence_embedding.embedding_agreement`: mean and min cosine, nearest-neighbour
agreement; higher is better), for the simulated and the deployed model. The samples are of one length (no
padding: the attention mask is ones), so the mean over all tokens is the attention-masked mean. all-MiniLM-L6-v2 on
windows of the standard library's docstrings:

.. code-block:: yaml

    model: {type: "mqbench.models.sentence_embedding:minilm", tracer: huggingface, task: embedding,
            output: last_hidden_state}
    data: {factory: "mqbench.models.sentence_embedding:docstring_token_windows", kwargs: {length: 32},
           batch_size: 16, max_eval: 64}
    quantize: {quantize_type: weight_only, backend: llm_w4a16, algorithm: gptq, cali_batchsize: 2}

A Hugging Face causal language model on your own text: ``model.type: causal_lm`` with ``model.path`` (a
``save_pretrained`` folder or a ``.gguf`` file) and ``data: {path, seq_len}``; :mod:`mqbench.app.causal_lm` says
how the text is read and split, with an example on SmolLM2-135M-Instruct.

MQBench's QAT example configs (its ``lsq_configs``) are flat; they load too, each key mapped to
one above: ``arch`` (model.type), ``model_path`` (model.path), ``resume``, ``epochs``, ``optim``
(training.optimizer), ``lr``, ``lr_scheduler``, ``weight_decay``, ``momentum`` (training.*),
``batch_size`` (data.batch_size, per process here), and ``quantization: {enabled, type, qparams}``
(quantize.backend and extra_prepare_dict.extra_qconfig_dict). Its run-mode flags are accepted
with the values of a QAT run (``deploy: false``, ``evaluate: false``, ``pretrained: true``,
``start_epoch: 0``); other values are errors naming the mqbench command or key that does that.
Sections of the layout above may be added next to them (``data`` for your data).
``data.num_workers`` and ``data.pin_memory`` are accepted for MQBench's configs; the data is read
into memory once.

Example:
    >>> cfg = parse_config({"quantize": {"backend": "tensorrt"}}, "run.yaml")
    >>> cfg["quantize"]["quantize_type"], cfg["data"]["batch_size"]
    ('naive_ptq', 32)
    >>> try:
    ...     parse_config({"quantize": {"quantize_typ": "naive_ptq"}}, "run.yaml")
    ... except ConfigError as error:
    ...     print(str(error)[:60])
    run.yaml: unknown key 'quantize.quantize_typ'; valid keys: a
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mqbench.app.config_schema import (
    _CHECKS,
    _FLAT_FLAGS,
    _FLAT_KEYS,
    _FLAT_QUANTIZATION,
    _IMAGE_DATA_KEYS,
    ALGORITHMS,
    BUDGET_KEYS,
    CAUSAL_LM_SEQ_LEN,
    DEFAULTS,
    LR_SCHEDULERS,
    OPTIMIZERS,
    QUANTIZE_TYPES,
    TASK_MODELS,
    TASKS,
    TRACERS,
    ConfigError,
    _mapping,
)

__all__ = [
    "ALGORITHMS",
    "BUDGET_KEYS",
    "CAUSAL_LM_SEQ_LEN",
    "DEFAULTS",
    "LR_SCHEDULERS",
    "OPTIMIZERS",
    "QUANTIZE_TYPES",
    "TASKS",
    "TASK_MODELS",
    "TRACERS",
    "ConfigError",
    "load_config",
    "parse_config",
]


def _merge(defaults: Mapping[str, Any], given: Mapping[str, Any]) -> dict[str, Any]:
    merged = copy.deepcopy(dict(defaults))
    for key, value in given.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def _check_section(name: str, given: Any, source: str, prefix: str) -> None:
    checks = _CHECKS[name]
    if not isinstance(given, Mapping):
        raise ConfigError(f"{source}: {prefix.rstrip('.')!r} must be a mapping of keys, got {type(given).__name__}")
    for key, value in given.items():
        if key not in checks:
            raise ConfigError(f"{source}: unknown key '{prefix}{key}'; valid keys: {', '.join(sorted(checks))}")
        check, valid = checks[key]
        if key == "deploy" and name == "quantize":
            if not _mapping(value):
                raise ConfigError(f"{source}: '{prefix}{key}' must be {valid}, got {value!r}")
            _check_section("deploy", value, source, f"{prefix}{key}.")
        elif not check(value):
            raise ConfigError(f"{source}: '{prefix}{key}' must be {valid}, got {value!r}")


def _from_flat_layout(raw: Mapping[str, Any], source: str) -> dict[str, Any]:
    """MQBench's flat QAT layout (see the module docstring) as this layout's sections."""
    sections: dict[str, Any] = {k: v for k, v in raw.items() if k in DEFAULTS}
    translated: dict[str, dict[str, Any]] = {}

    def put(section: str, key: str, value: Any, flat: str) -> None:
        given = sections.get(section) or {}
        if isinstance(given, Mapping) and key in given:
            raise ConfigError(f"{source}: '{flat}' and '{section}.{key}' both given; keep one")
        translated.setdefault(section, {})[key] = value

    for key, value in raw.items():
        if key in DEFAULTS:
            continue
        if key in _FLAT_KEYS:
            section, ours = _FLAT_KEYS[key]
            if ours in ("path", "resume") and value == "":
                value = None
            if ours == "lr_scheduler" and isinstance(value, str):
                value = value.lower()
            put(section, ours, value, key)
        elif key in _FLAT_FLAGS:
            expected, instead = _FLAT_FLAGS[key]
            if value != expected and not (value is None and key == "start_epoch"):
                raise ConfigError(f"{source}: '{key}: {value}' is not a QAT run here; {instead}")
        elif key == "quantization":
            if not _mapping(value):
                raise ConfigError(f"{source}: 'quantization' must be a mapping with {', '.join(_FLAT_QUANTIZATION)}")
            unknown = [k for k in value if k not in _FLAT_QUANTIZATION]
            if unknown:
                valid = ", ".join(_FLAT_QUANTIZATION)
                raise ConfigError(f"{source}: unknown key 'quantization.{unknown[0]}'; valid keys: {valid}")
            if value.get("enabled", True) is not True:
                raise ConfigError(f"{source}: 'quantization.enabled' is not true; mqbench qat trains quantized")
            if "type" in value:
                put("quantize", "backend", value["type"], "quantization.type")
            if value.get("qparams") is not None:
                if "extra_qconfig_dict" in (sections.get("extra_prepare_dict") or {}):
                    raise ConfigError(
                        f"{source}: 'quantization.qparams' and 'extra_prepare_dict.extra_qconfig_dict' both given"
                    )
                translated.setdefault("extra_prepare_dict", {})["extra_qconfig_dict"] = value["qparams"]
        else:
            choices = ", ".join(sorted([*DEFAULTS, *_FLAT_KEYS, *_FLAT_FLAGS, "quantization"]))
            raise ConfigError(f"{source}: unknown key {key!r} of MQBench's flat QAT layout; valid: {choices}")
    for section, values in translated.items():
        sections[section] = {**(sections.get(section) or {}), **values}
    return sections


def parse_config(raw: Any, source: str = "<config>") -> dict[str, Any]:
    """Check a configuration (the parsed YAML) and fill in the defaults; ``source`` names it in errors."""
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{source}: a configuration is a mapping of sections, got {type(raw).__name__}")
    if "arch" in raw or "quantization" in raw:
        raw = _from_flat_layout(raw, source)
    if "quant" in raw and ("train" in raw or "progress" in raw):
        raise ConfigError(
            f"{source}: this is the layout of MQBench's Hugging Face Trainer examples (quant, model, data, train, "
            "progress: Trainer arguments), which mqbench does not read. Write its quantizers as "
            "extra_prepare_dict.extra_qconfig_dict (quant.a_qconfig.quantizer -> a_fakequantize, observer -> "
            "a_observer, bit/symmetric/ch_axis -> a_qscheme bit/symmetry/per_channel; w_qconfig likewise), "
            "quant.backend as quantize.backend, and the model as model.type with model.tracer: huggingface "
            "(docs/your_own_model.md)"
        )
    for section, value in raw.items():
        if section not in DEFAULTS:
            raise ConfigError(f"{source}: unknown section {section!r}; valid sections: {', '.join(sorted(DEFAULTS))}")
        if section == "extra_prepare_dict":
            if value is not None and not isinstance(value, Mapping):
                raise ConfigError(f"{source}: 'extra_prepare_dict' must be a mapping, got {type(value).__name__}")
            continue  # prepare_by_platform checks its own keys, naming them
        _check_section(section, value if value is not None else {}, source, f"{section}.")
    config = _merge(DEFAULTS, {k: v for k, v in raw.items() if v is not None})
    given_budget = (raw.get("mixed_precision") or {}).get("budget")
    if given_budget is not None:  # a budget replaces the default one, not merged with it
        config["mixed_precision"]["budget"] = dict(given_budget)
    if config["data"]["factory"] is not None and config["data"]["path"] is not None:
        raise ConfigError(f"{source}: 'data.path' and 'data.factory' both given; the data comes from one of them")
    if config["model"]["input_names"] is not None and config["model"]["tracer"] != "huggingface":
        raise ConfigError(f"{source}: 'model.input_names' is for model.tracer: huggingface")
    if config["quantize"]["quantize_type"] == "ptq":
        config["quantize"]["quantize_type"] = "advanced_ptq" if config["quantize"]["reconstruction"] else "naive_ptq"
    if config["quantize"]["quantize_type"] == "advanced_ptq" and not config["quantize"]["reconstruction"]:
        raise ConfigError(
            f"{source}: quantize.quantize_type is advanced_ptq but quantize.reconstruction is empty; give "
            "ptq_reconstruction's config (pattern, max_count, ...) or use naive_ptq"
        )
    _check_weight_only(config, source)
    _check_task(config, source, raw.get("data") or {})
    return config


def _check_weight_only(config: dict[str, Any], source: str) -> None:
    """``algorithm`` and ``algorithm_config`` belong to weight_only (whose algorithm defaults to rtn)."""
    quantize = config["quantize"]
    quantize["algorithm_config"] = dict(quantize["algorithm_config"] or {})
    if quantize["quantize_type"] != "weight_only":
        for key in ("algorithm", "algorithm_config"):
            if quantize[key]:
                raise ConfigError(
                    f"{source}: 'quantize.{key}' is for quantize_type: weight_only (its algorithms: "
                    f"{', '.join(ALGORITHMS)}); this run's quantize_type is {quantize['quantize_type']}"
                )
        return
    if quantize["algorithm"] is None:
        quantize["algorithm"] = "rtn"
    if isinstance(quantize["algorithm"], list):
        _check_algorithm_list(quantize, source)
    if quantize["algorithm"] == "rtn" and quantize["algorithm_config"]:
        raise ConfigError(
            f"{source}: 'quantize.algorithm_config' is for gptq and awq; rtn (round to nearest) takes no settings"
        )
    if quantize["reconstruction"]:
        raise ConfigError(f"{source}: 'quantize.reconstruction' is for advanced_ptq, not weight_only")


def _check_algorithm_list(quantize: dict[str, Any], source: str) -> None:
    """A list of algorithms: each once, GPTQ last (it rounds the weights; what came after would round them again),
    and with more than one, ``algorithm_config`` keyed by their names. A list of one is that algorithm."""
    algorithms, config = quantize["algorithm"], quantize["algorithm_config"]
    if len(set(algorithms)) != len(algorithms):
        raise ConfigError(f"{source}: 'quantize.algorithm' names an algorithm twice: {algorithms}")
    if "gptq" in algorithms and algorithms[-1] != "gptq":
        raise ConfigError(
            f"{source}: 'quantize.algorithm' {algorithms}: gptq must come last (it rounds the weights, compensating "
            "each rounding's error; an algorithm after it would scale and round them again), e.g. [awq, gptq]"
        )
    if len(algorithms) == 1:
        quantize["algorithm"] = algorithms[0]
        return
    for key, value in config.items():
        if key not in algorithms or not _mapping(value):
            raise ConfigError(
                f"{source}: 'quantize.algorithm_config' of the algorithms {algorithms} maps each one's name to its "
                f"config (e.g. {{gptq: {{act_order: true}}}}); got {key!r}: {value!r}"
            )
    quantize["algorithm_config"] = {key: dict(value) for key, value in config.items()}


def _check_task(config: dict[str, Any], source: str, given_data: Mapping[str, Any]) -> None:
    """``model.task`` from ``model.type`` where null; a model that brings its own data takes no data source, and
    ``causal_lm`` takes text (``data.path``) and no image keys (``given_data``: the data section as written)."""
    model, data = config["model"], config["data"]
    implied = TASK_MODELS.get(model["type"])
    if model["task"] is None:
        model["task"] = implied or "classification"
    if implied is not None and model["task"] != implied:
        raise ConfigError(
            f"{source}: 'model.task' is {model['task']} but model.type {model['type']!r} is a {implied} model, "
            f"measured by the {implied} task's metric; remove model.task (the {model['task']} task runs your own "
            "model: model.type package.module:factory with data.path or data.factory)"
        )
    if implied is None and model["task"] in TASK_MODELS.values():
        raise ConfigError(
            f"{source}: 'model.task' is {model['task']} but model.type {model['type']!r} is not a {model['task']} "
            f"model; the {model['task']} task runs model.type tiny_gpt (the bundled decoder) or causal_lm (a "
            "Hugging Face causal language model, model.path, with a text corpus, data.path)"
        )
    if model["task"] == "embedding" and data["max_eval"] == 1:
        raise ConfigError(
            f"{source}: 'data.max_eval' is 1; the embedding task compares each validation sample's nearest other "
            "sample, so it needs at least 2"
        )
    if data["seq_len"] is not None and model["type"] != "causal_lm":
        own = " (tiny_gpt's windows are its context, model.kwargs.context)" if model["type"] == "tiny_gpt" else ""
        raise ConfigError(
            f"{source}: 'data.seq_len' is the window length, in tokens, of the text model.type causal_lm reads; "
            f"model.type {model['type']!r} does not read it{own}; remove data.seq_len"
        )
    if model["task"] in ("classification", "embedding"):
        return
    for key in ("path", "factory"):
        if data[key] is not None and model["type"] != "causal_lm":
            raise ConfigError(
                f"{source}: 'data.{key}': model.type {model['type']} brings its own data (the task "
                f"{model['task']}); remove data.{key}"
            )
    if model["tracer"] is not None or model["output"] is not None:
        raise ConfigError(
            f"{source}: 'model.tracer' and 'model.output' are for your own classification and embedding models; "
            f"model.type {model['type']} is loaded and measured by its own recipe"
        )
    if model["type"] == "causal_lm":
        _check_causal_lm(config, source, given_data)


def _check_causal_lm(config: dict[str, Any], source: str, given_data: Mapping[str, Any]) -> None:
    """``model.type: causal_lm``: ``model.path`` (the model) and ``data.path`` (text) given, no data.factory and no
    image keys; ``data.seq_len`` defaults to :data:`CAUSAL_LM_SEQ_LEN`."""
    model, data = config["model"], config["data"]
    if model["path"] is None:
        raise ConfigError(
            f"{source}: 'model.path' is missing; model.type causal_lm loads a Hugging Face causal language model "
            "from it: a folder save_pretrained wrote (config.json, the weights and the tokenizer) or a .gguf file"
        )
    if data["factory"] is not None:
        raise ConfigError(
            f"{source}: 'data.factory': model.type causal_lm reads text from data.path (a folder of .txt files, a "
            '.jsonl file with a "text" field a line, or a folder datasets\' save_to_disk wrote) and tokenizes it '
            "with the model's tokenizer; remove data.factory and give data.path"
        )
    if data["path"] is None:
        raise ConfigError(
            f"{source}: 'data.path' is missing; model.type causal_lm calibrates and measures its perplexity on text: "
            'a folder of .txt files, a .jsonl file with a "text" field a line, or a folder datasets\' save_to_disk '
            "wrote"
        )
    # a value other than the default (a run folder's config.yaml holds every default)
    given = [
        key
        for key in (*_IMAGE_DATA_KEYS, "kwargs")
        if key in given_data and given_data[key] not in (None, DEFAULTS["data"][key])
    ]
    if given:
        keys = ", ".join(f"data.{key}" for key in given)
        raise ConfigError(
            f"{source}: '{keys}': model.type causal_lm reads text (data.path, cut into windows of data.seq_len "
            f"tokens); {'these keys are' if len(given) > 1 else 'this key is'} for image data "
            f"{'or data.factory ' if 'kwargs' in given else ''}and not used: remove {keys}"
        )
    if data["seq_len"] is None:
        data["seq_len"] = CAUSAL_LM_SEQ_LEN


def load_config(path: str | Path) -> dict[str, Any]:
    """Read and check a YAML configuration file (see the module docstring for the layout)."""
    try:
        import yaml
    except ImportError as error:  # pragma: no cover - a declared dependency
        raise ImportError("reading YAML configurations needs PyYAML: pip install pyyaml") from error
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"{file}: no such configuration file")
    try:
        raw = yaml.safe_load(file.read_text())
    except yaml.YAMLError as error:
        raise ConfigError(f"{file}: not valid YAML: {error}") from error
    if raw is None or raw == {}:
        raise ConfigError(
            f"{file}: the file is empty (no sections); a run configuration needs at least a quantize section naming "
            "the backend (quantize: {backend: tensorrt}), and model and data sections for your own model and data "
            f"(valid sections: {', '.join(sorted(DEFAULTS))}; examples/ptq_resnet18_digits.yaml is a complete one)"
        )
    config = parse_config(raw, str(file))
    _check_backend_given(raw, config, str(file))
    return config


def _check_backend_given(raw: Mapping[str, Any], config: dict[str, Any], source: str) -> None:
    """A file that names no backend gets the default, Academic, only with the quantizers it needs."""
    named = isinstance(raw.get("quantize"), Mapping) and "backend" in raw["quantize"]
    named = named or (isinstance(raw.get("quantization"), Mapping) and "type" in raw["quantization"])
    if named or "extra_qconfig_dict" in (config["extra_prepare_dict"] or {}):
        return
    missing = ["quantize.backend"] if "quantize" in raw else ["the quantize section (quantize.backend)"]
    missing.append("extra_prepare_dict.extra_qconfig_dict")
    raise ConfigError(
        f"{source}: missing {' and '.join(missing)}: without a backend the run quantizes for the default, "
        f"{DEFAULTS['quantize']['backend']}, which takes its quantizers from extra_prepare_dict.extra_qconfig_dict; "
        "name a backend (quantize: {backend: tensorrt}; mqbench backends lists them) or give extra_qconfig_dict"
    )
