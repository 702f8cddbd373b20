"""``mqbench ptq --config FILE --output DIR``: post-training quantization of the configured model.

Calibration on ``quantize.cali_batchsize`` training batches (MQBench's order: activations, then
weights; with the backend's recipe, or ``quantize.recipe``'s, see :func:`~mqbench.advanced_ptq.calibrate`) for
``quantize_type: naive_ptq``; then :func:`~mqbench.advanced_ptq.ptq_reconstruction` with
``quantize.reconstruction`` for ``advanced_ptq``. Deployment, verification, the run folder and the
report are :mod:`mqbench.app.runs`'.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, cast

from torch import fx, nn
from tqdm.auto import tqdm

from mqbench.advanced_ptq import calibrate, ptq_reconstruction
from mqbench.advanced_ptq.calibration import recipe_of
from mqbench.app.config import ConfigError
from mqbench.app.runs import Run, execute
from mqbench.backends import PTQRecipe
from mqbench.observer import ObserverDict

__all__ = ["ptq_recipe", "quantize_ptq", "run_ptq", "run_ptq_with_handles"]


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
    calibration = run.calibration_batches()
    recipe = ptq_recipe(quantize.get("recipe"), qmodel)
    run.extra["recipe"] = recipe.describe()
    calibrate(qmodel, tqdm(calibration, desc="calibration", disable=run.quiet, leave=False), recipe=recipe)
    run.seconds["calibration"] = time.perf_counter() - started
    if quantize["quantize_type"] == "advanced_ptq":
        started = time.perf_counter()
        reconstruction = dict(quantize["reconstruction"])
        reconstruction.setdefault("progress", not run.quiet)
        ptq_reconstruction(qmodel, calibration, reconstruction)
        run.seconds["reconstruction"] = time.perf_counter() - started
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
