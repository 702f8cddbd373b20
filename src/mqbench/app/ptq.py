"""``mqbench ptq --config FILE --output DIR``: post-training quantization of the configured model.

Calibration on ``quantize.cali_batchsize`` training batches (MQBench's order: activations, then
weights; with the backend's recipe, or ``quantize.recipe``'s, see :func:`~mqbench.advanced_ptq.calibrate`) for
``quantize_type: naive_ptq``; then :func:`~mqbench.advanced_ptq.ptq_reconstruction` with
``quantize.reconstruction`` for ``advanced_ptq``. ``weight_only`` rounds the weights with ``quantize.algorithm``
(see :func:`weight_only`). Deployment, verification, the run folder and the report are :mod:`mqbench.app.runs`'.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from torch import fx, nn
from tqdm.auto import tqdm

from mqbench.advanced_ptq import awq, calibrate, gptq, hadamard_rotation, ptq_reconstruction
from mqbench.advanced_ptq.calibration import recipe_of
from mqbench.advanced_ptq.weight_only import calibrate_weights
from mqbench.app.config import ConfigError
from mqbench.app.runs import Run, execute
from mqbench.backends import PTQRecipe
from mqbench.custom_quantizer.float_layers import float_layers_of
from mqbench.observer import ObserverDict
from mqbench.utils.state import enable_quantization

__all__ = [
    "WEIGHT_ALGORITHMS",
    "ptq_recipe",
    "quantize_ptq",
    "rotate",
    "run_ptq",
    "run_ptq_with_handles",
    "weight_only",
]

# quantize.algorithm -> the advanced_ptq function taking (qmodel, cali_data, config); rtn reads no data
WEIGHT_ALGORITHMS: dict[str, Callable[[fx.GraphModule, Any, Any], fx.GraphModule]] = {"gptq": gptq, "awq": awq}


def ptq_recipe(value: Any, qmodel: nn.Module) -> PTQRecipe:
    """``quantize.recipe``: None, the recipe of the backend the model was prepared for; ``"plain"``; or a mapping
    of :class:`~mqbench.backends.PTQRecipe`'s fields."""
    if value is None:
        return recipe_of(cast(fx.GraphModule, qmodel))
    if value == "plain":
        return PTQRecipe()
    observer = value.get("activation_observer")
    if observer is not None:
        try:
            ObserverDict.resolve(observer)
        except KeyError as error:
            raise ConfigError(f"quantize.recipe.activation_observer: {error.args[0]}") from None
    return PTQRecipe(**value)


def quantize_ptq(run: Run, model: nn.Module) -> nn.Module:
    """The PTQ step: calibrate (and reconstruct for advanced_ptq) the prepared model."""
    if run.processes.distributed:
        raise ConfigError("mqbench ptq runs in one process; torchrun is for mqbench qat")
    quantize = run.config["quantize"]
    if quantize["quantize_type"] == "qat":
        raise ConfigError("quantize.quantize_type is qat: run this configuration with mqbench qat")
    run.extra["method"] = quantize["quantize_type"]
    started = time.perf_counter()
    qmodel = run.prepare(model)
    left_float = float_layers_of(qmodel)
    if left_float:  # the backend's float_layers rule (a language model's lm_head and embeddings)
        run.extra["float_layers"] = left_float
    calibration = run.calibration_batches()
    rotate(run, qmodel, calibration)
    if quantize["quantize_type"] == "weight_only":
        return weight_only(run, qmodel, calibration, started)
    recipe = ptq_recipe(quantize.get("recipe"), qmodel)
    run.extra["recipe"] = recipe.describe()
    batches = tqdm(calibration, desc="calibration", disable=run.quiet, leave=False)
    calibrate(qmodel, batches, smooth=quantize.get("smooth"), recipe=recipe)
    run.seconds["calibration"] = time.perf_counter() - started
    if quantize["quantize_type"] == "advanced_ptq":
        started = time.perf_counter()
        reconstruction = dict(quantize["reconstruction"])
        reconstruction.setdefault("progress", not run.quiet)
        ptq_reconstruction(qmodel, calibration, reconstruction)
        run.seconds["reconstruction"] = time.perf_counter() - started
    return qmodel


def rotate(run: Run, qmodel: fx.GraphModule, calibration: list[Any]) -> None:
    """``quantize.rotation``: :func:`~mqbench.advanced_ptq.hadamard_rotation` with that config (which recalibrates
    the model; calibration and the algorithms then see the rotated weights). A model it cannot rotate, or a bad
    key, is a ConfigError naming why."""
    config = run.config["quantize"]["rotation"]
    if config is None:
        return
    started = time.perf_counter()
    with tqdm(total=1, desc="hadamard rotation", disable=run.quiet, leave=False) as bar:
        try:
            hadamard_rotation(qmodel, calibration, dict(config))
        except ValueError as error:
            raise ConfigError(f"quantize.rotation: {error}") from error
        bar.update()
    run.extra["rotation"] = qmodel.meta["rotation"]
    run.seconds["rotation"] = time.perf_counter() - started


def weight_only(run: Run, qmodel: fx.GraphModule, calibration: list[Any], started: float) -> fx.GraphModule:
    """``quantize_type: weight_only``: ``quantize.algorithm`` on the prepared model's weights, then quantization on.

    A backend that also quantizes activations (not ``weight_only`` in its spec, e.g. tensorrt_nlp's W8A8) is first
    calibrated as naive_ptq calibrates (activations and weights); the algorithm then re-rounds the weights. ``rtn``
    calibrates each weight quantizer on its own weight (no data); ``gptq`` and ``awq`` read the calibration batches
    with ``quantize.algorithm_config`` (whose unknown keys or bad values are a ConfigError naming the valid ones); a
    list of them runs in order, each with its entry of ``algorithm_config`` (``results.json``'s ``algorithm``:
    their names joined by ``+``).
    """
    quantize = run.config["quantize"]
    algorithm = quantize["algorithm"] or "rtn"
    algorithms = algorithm if isinstance(algorithm, list) else [algorithm]
    configs = quantize["algorithm_config"] or {}
    run.extra["algorithm"] = "+".join(algorithms)
    if not run.spec.weight_only:
        recipe = ptq_recipe(quantize.get("recipe"), qmodel)
        run.extra["recipe"] = recipe.describe()
        batches = tqdm(calibration, desc="calibration", disable=run.quiet, leave=False)
        calibrate(qmodel, batches, smooth=quantize.get("smooth"), recipe=recipe)
    run.seconds["calibration"] = time.perf_counter() - started
    for name in algorithms:  # rtn comes alone
        started = time.perf_counter()
        if name == "rtn":
            calibrate_weights(qmodel)
        else:
            config = dict(configs.get(name) or {}) if len(algorithms) > 1 else dict(configs)
            key = f"quantize.algorithm_config.{name}" if len(algorithms) > 1 else "quantize.algorithm_config"
            # one step: the algorithm passes over the calibration batches once per site of linear layers
            desc = f"{name} on {len(calibration)} batch(es)"
            with tqdm(total=1, desc=desc, disable=run.quiet, leave=False) as bar:
                try:
                    WEIGHT_ALGORITHMS[name](qmodel, calibration, config)
                except ValueError as error:
                    if f"{name} config" not in str(error):  # not a configuration error: the algorithm's own
                        raise
                    raise ConfigError(f"{key}: {error}") from error
                bar.update()
        run.seconds[name] = time.perf_counter() - started
    enable_quantization(qmodel)
    return qmodel


def run_ptq(
    config_path: str | Path | dict[str, Any], output: str | Path, quiet: bool = False, overwrite: bool = False
) -> dict[str, Any]:
    """Run the PTQ configuration ``config_path`` into the folder ``output``; returns ``results.json``'s content.

    ``overwrite``: replace a finished run in ``output`` (refused otherwise)."""
    return execute("PTQ", config_path, output, quantize_ptq, quiet, overwrite=overwrite)


def run_ptq_with_handles(
    config: dict[str, Any], output: str | Path, quiet: bool = False, overwrite: bool = False
) -> tuple[dict[str, Any], dict]:
    """:func:`run_ptq` of a checked configuration, also returning the deployment and a validation sample."""
    handles: dict[str, Any] = {}
    return execute("PTQ", config, output, quantize_ptq, quiet, handles, overwrite), handles
