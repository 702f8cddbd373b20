"""The configuration's vocabulary: the accepted values, the defaults of every section, and the check of each key's
value (:mod:`mqbench.app.config` reads and checks a file with them; its docstring is the reference of the keys).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

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
]

QUANTIZE_TYPES = ("naive_ptq", "advanced_ptq", "weight_only")
ALGORITHMS = ("rtn", "gptq", "awq")
TASKS = ("classification", "language_model", "embedding")
# model.type names of the models that bring their own data or metric, and their task
TASK_MODELS = {"tiny_gpt": "language_model", "causal_lm": "language_model"}
CAUSAL_LM_SEQ_LEN = 256  # data.seq_len of model.type causal_lm when not given
# data keys of image data, which a text corpus (model.type causal_lm) does not use
_IMAGE_DATA_KEYS = ("input_size", "test_resize", "mean", "std")
# Names MQBench's example configs also use ("support ptq or qat"): ptq is resolved by whether a
# reconstruction is given; qat is kept, for mqbench qat (mqbench ptq refuses it, naming the command).
_ACCEPTED_QUANTIZE_TYPES = (*QUANTIZE_TYPES, "ptq", "qat")

DEFAULTS: dict[str, Any] = {
    "model": {
        "type": "resnet18",
        "kwargs": {},
        "path": None,
        "tracer": None,
        "input_names": None,
        "output": None,
        "task": None,
    },
    "data": {
        "path": None,
        "factory": None,
        "kwargs": {},
        "batch_size": 32,
        "num_workers": 0,
        "pin_memory": False,
        "input_size": 32,
        "test_resize": 32,
        "mean": [0.485, 0.456, 0.406],
        "std": [0.229, 0.224, 0.225],
        "max_eval": None,
        "seq_len": None,
    },
    "quantize": {
        "quantize_type": "naive_ptq",
        "cali_batchsize": 4,
        "backend": "Academic",
        "reconstruction": None,
        "algorithm": None,
        "algorithm_config": {},
        "rotation": None,
        "recipe": None,
        "smooth": None,
        "deploy": {"model_name": "model", "output_path": None, "deploy_to_qlinear": False},
        "verify_samples": 32,
    },
    "extra_prepare_dict": {},
    "training": {
        "epochs": 1,
        "lr": 1e-4,
        "optimizer": "adam",
        "momentum": 0.9,
        "weight_decay": 0.0,
        "max_steps": None,
        "lr_scheduler": None,
        "resume": None,
    },
    "process": {"seed": 0},
    "profile": {"modes": ["standalone", "interaction"], "batches": 2},
    "mixed_precision": {
        "weight_bits": [8, 4, 2],
        "activation_bits": [8],
        "budget": {"average_weight_bits": 5},
        "pareto": [],
    },
}

OPTIMIZERS = ("adam", "adamw", "sgd")
TRACERS = ("huggingface",)
LR_SCHEDULERS = ("cosine",)

# MQBench's flat QAT layout: key -> (section, key) of ours.
_FLAT_KEYS = {
    "arch": ("model", "type"),
    "model_path": ("model", "path"),
    "resume": ("training", "resume"),
    "epochs": ("training", "epochs"),
    "batch_size": ("data", "batch_size"),
    "optim": ("training", "optimizer"),
    "lr": ("training", "lr"),
    "lr_scheduler": ("training", "lr_scheduler"),
    "weight_decay": ("training", "weight_decay"),
    "momentum": ("training", "momentum"),
}
# Its run-mode flags: the value a QAT run has, and what to do instead of another value.
_FLAT_FLAGS = {
    "deploy": (False, "deploying a trained checkpoint is mqbench deploy on the run folder"),
    "evaluate": (False, "evaluating a checkpoint is mqbench verify on the run folder"),
    "pretrained": (True, "mqbench qat starts from the trained model: model_path, or arch naming a trained model"),
    "start_epoch": (0, "to continue a run, set resume to its checkpoint.pt (it holds the epoch)"),
}
_FLAT_QUANTIZATION = ("enabled", "type", "qparams")


class ConfigError(ValueError):
    """A configuration that cannot run: the message names the file, the key and what is valid."""


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _optional_positive_int(value: Any) -> bool:
    return value is None or _positive_int(value)


def _optional_str(value: Any) -> bool:
    return value is None or isinstance(value, str)


def _algorithm_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(v in ALGORITHMS[1:] for v in value)


def _mapping(value: Any) -> bool:
    return isinstance(value, Mapping)


def _recipe(value: Any) -> bool:
    if value is None or value == "plain":
        return True
    if not isinstance(value, dict) or not set(value) <= {"activation_observer", "equalize", "bias_correction"}:
        return False
    observer = value.get("activation_observer")
    flags = [value.get(key, False) for key in ("equalize", "bias_correction")]
    return (observer is None or isinstance(observer, str)) and all(isinstance(flag, bool) for flag in flags)


def _three_floats(value: Any) -> bool:
    return (
        isinstance(value, list | tuple)
        and len(value) in (1, 3)
        and all(isinstance(v, int | float) and not isinstance(v, bool) for v in value)
    )


BUDGET_KEYS = ("average_weight_bits", "size_bytes", "bitops")


def _bit_list(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(b, int) and not isinstance(b, bool) and 2 <= b <= 8 for b in value)
    )


def _budget(value: Any) -> bool:
    return (
        _mapping(value)
        and bool(value)
        and all(
            k in BUDGET_KEYS and isinstance(v, int | float) and not isinstance(v, bool) and v > 0
            for k, v in value.items()
        )
    )


# key -> (check, what a valid value is)
_CHECKS: dict[str, dict[str, tuple[Callable[[Any], bool], str]]] = {
    "model": {
        "type": (lambda v: isinstance(v, str) and bool(v), "a model name or an import path package.module:factory"),
        "kwargs": (lambda v: v is None or _mapping(v), "a mapping of keyword arguments"),
        "path": (_optional_str, "a checkpoint file path (causal_lm: a model folder or a .gguf file) or null"),
        "tracer": (lambda v: v is None or v in TRACERS, "null (torch.fx) or huggingface"),
        "input_names": (
            lambda v: v is None or (isinstance(v, list) and len(v) == 1 and all(isinstance(n, str) and n for n in v)),
            "null or a list of one forward argument name (the data holds one input per sample)",
        ),
        "output": (
            lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 0) or isinstance(v, str),
            "null, an index (0, 1, ...) into the model's outputs or a key of its mapping output",
        ),
        "task": (lambda v: v is None or v in TASKS, "null (from model.type) or " + ", ".join(TASKS)),
    },
    "data": {
        "path": (
            _optional_str,
            "an image folder, a .npz file or null (the bundled digits); for model.type causal_lm, text",
        ),
        "factory": (
            lambda v: v is None or (isinstance(v, str) and ":" in v),
            "null or an import path package.module:function returning the train and val datasets",
        ),
        "kwargs": (lambda v: v is None or _mapping(v), "a mapping of keyword arguments for data.factory"),
        "batch_size": (_positive_int, "a positive integer"),
        "num_workers": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0, "an integer >= 0"),
        "pin_memory": (lambda v: isinstance(v, bool), "true or false"),
        "input_size": (_positive_int, "a positive integer (pixels)"),
        "test_resize": (_positive_int, "a positive integer (pixels)"),
        "mean": (_three_floats, "a list of 1 or 3 numbers"),
        "std": (_three_floats, "a list of 1 or 3 numbers"),
        "max_eval": (_optional_positive_int, "a positive integer or null"),
        "seq_len": (_optional_positive_int, "a positive integer (tokens a window, model.type causal_lm) or null"),
    },
    "quantize": {
        "quantize_type": (lambda v: v in _ACCEPTED_QUANTIZE_TYPES, ", ".join(_ACCEPTED_QUANTIZE_TYPES)),
        "cali_batchsize": (_positive_int, "a positive integer (number of calibration batches)"),
        "backend": (lambda v: isinstance(v, str) and bool(v), "a backend name (mqbench backends lists them)"),
        "reconstruction": (lambda v: v is None or _mapping(v), "a mapping (ptq_reconstruction's config)"),
        "algorithm": (
            lambda v: v is None or v in ALGORITHMS or _algorithm_list(v),
            "one of " + ", ".join(ALGORITHMS) + ", or a list of gptq and awq run in order (e.g. [awq, gptq])",
        ),
        "algorithm_config": (
            lambda v: v is None or _mapping(v),
            "a mapping (gptq's or awq's config: mqbench.advanced_ptq.GPTQ_DEFAULTS / AWQ_DEFAULTS name its keys)",
        ),
        "rotation": (
            lambda v: v is None or _mapping(v),
            "null, or a mapping (hadamard_rotation's config; {} for mqbench.advanced_ptq.ROTATION_DEFAULTS)",
        ),
        "recipe": (
            _recipe,
            "null (the backend's recipe), plain, or a mapping of activation_observer (an observer name or null), "
            "equalize and bias_correction (true or false)",
        ),
        "smooth": (
            lambda v: v in (None, True, False, "after_norm"),
            "null (the backend's default: SmoothQuant for the NLP backends), true, false, or after_norm (SmoothQuant "
            "on the norms' outputs only, whose scales the Hugging Face checkpoints hold)",
        ),
        "deploy": (_mapping, "a mapping with model_name, output_path, deploy_to_qlinear"),
        "verify_samples": (_positive_int, "a positive integer"),
    },
    "deploy": {
        "model_name": (lambda v: isinstance(v, str) and bool(v), "a file name"),
        "output_path": (_optional_str, "a folder or null (the run folder)"),
        "deploy_to_qlinear": (lambda v: isinstance(v, bool), "true or false"),
    },
    "training": {
        "epochs": (_positive_int, "a positive integer"),
        "lr": (lambda v: isinstance(v, int | float) and not isinstance(v, bool) and v > 0, "a positive number"),
        "optimizer": (lambda v: v in OPTIMIZERS, " or ".join(OPTIMIZERS)),
        "momentum": (lambda v: isinstance(v, int | float) and not isinstance(v, bool) and 0 <= v < 1, "in [0, 1)"),
        "weight_decay": (lambda v: isinstance(v, int | float) and not isinstance(v, bool) and v >= 0, "a number >= 0"),
        "max_steps": (_optional_positive_int, "a positive integer (steps per epoch) or null"),
        "lr_scheduler": (lambda v: v is None or v in LR_SCHEDULERS, "null (constant) or cosine"),
        "resume": (_optional_str, "a checkpoint.pt of an earlier run of this configuration, or null"),
    },
    "process": {"seed": (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer")},
    "profile": {
        "modes": (
            lambda v: isinstance(v, list) and bool(v) and all(m in ("standalone", "interaction") for m in v),
            "a list of standalone and/or interaction",
        ),
        "batches": (_positive_int, "a positive integer (calibration batches to profile on)"),
    },
    "mixed_precision": {
        "weight_bits": (_bit_list, "a list of bit widths from 2 to 8"),
        "activation_bits": (_bit_list, "a list of bit widths from 2 to 8"),
        "budget": (_budget, "a mapping with average_weight_bits, size_bytes and/or bitops (positive numbers)"),
        "pareto": (
            lambda v: isinstance(v, list) and all(_budget(b) for b in v),
            "a list of budgets (each like budget)",
        ),
    },
}
