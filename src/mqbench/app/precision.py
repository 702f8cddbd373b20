"""``mqbench profile`` and ``mqbench mixed-precision``: where the error comes from, and widths per layer.

``mqbench profile --config FILE --output DIR`` is ``mqbench ptq`` plus
:func:`~mqbench.advanced_ptq.profiling.profile_layers` on the calibrated model (``profile.modes`` on
``profile.batches`` calibration batches): each layer's SQNR against float with only its weights,
only its activations or both quantized, and with everything up to it quantized. The table lands
in ``results.json`` (``profile``), ``profile.md`` and the report, with a plot.

``mqbench mixed-precision --config FILE --output DIR`` chooses a width per quantizer with
:func:`~mqbench.mix_precision.search_mixed_precision` (``mixed_precision.weight_bits``,
``activation_bits``, ``budget``; ``average_weight_bits`` is the size of every weight at that width),
then calibrates, deploys and verifies the mixed model as ``mqbench ptq`` does. ``pareto`` budgets are
each searched and evaluated on the validation data (the report plots accuracy against size). The
chosen ``extra_prepare_dict`` (with ``quantizer_bits``) is written to ``mixed_precision.yaml``:
``quantized_state_dict.pt`` loads into ``prepare_by_platform(model, backend, that dict)``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import yaml
from torch import nn
from tqdm.auto import tqdm

from mqbench.advanced_ptq import calibrate
from mqbench.advanced_ptq.profiling import profile_layers
from mqbench.app.config import ConfigError
from mqbench.app.ptq import quantize_ptq
from mqbench.app.runs import Run, execute
from mqbench.mix_precision import search_mixed_precision

__all__ = ["run_mixed_precision", "run_profile"]

_WEIGHTED = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


def _profile(run: Run, model: nn.Module) -> nn.Module:
    qmodel = quantize_ptq(run, model)
    settings = run.config["profile"]
    started = time.perf_counter()
    batches = run.calibration_batches()[: settings["batches"]]
    table = profile_layers(qmodel, batches, modes=tuple(settings["modes"]), progress=not run.quiet)
    run.seconds["profile"] = time.perf_counter() - started
    run.extra["profile"] = table.as_dicts()
    if run.folder is not None:
        run.folder.write_text("profile.md", table.to_markdown() + "\n")
    return qmodel


def _budget(settings: dict[str, Any], model: nn.Module) -> dict[str, float]:
    budget = dict(settings)
    average = budget.pop("average_weight_bits", None)
    if average is not None:
        params = sum(m.weight.numel() for m in model.modules() if isinstance(m, _WEIGHTED))
        size = params * float(average) / 8.0
        budget["size_bytes"] = min(size, budget.get("size_bytes", size))
    return budget


def _mixed(run: Run, model: nn.Module) -> nn.Module:
    if run.processes.distributed:
        raise ConfigError("mqbench mixed-precision runs in one process")
    settings = run.config["mixed_precision"]
    candidates = {"weight": tuple(settings["weight_bits"]), "activation": tuple(settings["activation_bits"])}
    base = dict(run.config["extra_prepare_dict"] or {})
    calibration = run.calibration_batches()
    pareto = [_budget(b, model) for b in settings["pareto"]]

    def evaluate(qmodel: nn.Module) -> float:
        return float(run.accuracy(qmodel, "mixed precision point") or 0.0)

    started = time.perf_counter()
    try:
        result = search_mixed_precision(
            model,
            run.spec.name,
            calibration,
            evaluate if pareto and run.val_labels is not None else None,
            candidates,
            _budget(settings["budget"], model),
            base,
            pareto,
            progress=not run.quiet,
        )
    except ValueError as error:  # a width the backend refuses, a budget nothing fits: the message names it
        raise ConfigError(f"mixed_precision: {error}") from error
    run.seconds["mixed-precision search"] = time.perf_counter() - started
    run.config["extra_prepare_dict"] = result.config
    run.extra["method"] = "mixed precision"
    run.extra["mixed_precision"] = {
        "candidates": {k: list(v) for k, v in candidates.items()},
        "budget": _budget(settings["budget"], model),
        "size_bytes": result.size_bytes,
        "bitops": result.bitops,
        "objective": result.objective,
        "bits": {name: list(bits) for name, bits in result.bits.items()},
        "quantizer_bits": result.quantizer_bits,
        "pareto": result.pareto,
    }
    if run.folder is not None:
        run.folder.write_text("mixed_precision.yaml", yaml.safe_dump(result.config, sort_keys=False))
    started = time.perf_counter()
    qmodel = run.prepare(model)
    calibrate(qmodel, tqdm(calibration, desc="calibration", disable=run.quiet, leave=False))
    run.seconds["calibration"] = time.perf_counter() - started
    return qmodel


def run_profile(
    config_path: str | Path | dict[str, Any], output: str | Path, quiet: bool = False, overwrite: bool = False
) -> dict[str, Any]:
    """``mqbench profile``: returns ``results.json``'s content."""
    return execute("profile", config_path, output, _profile, quiet, overwrite=overwrite)


def run_mixed_precision(
    config_path: str | Path | dict[str, Any], output: str | Path, quiet: bool = False, overwrite: bool = False
) -> dict[str, Any]:
    """``mqbench mixed-precision``: returns ``results.json``'s content."""
    return execute("mixed-precision", config_path, output, _mixed, quiet, overwrite=overwrite)
