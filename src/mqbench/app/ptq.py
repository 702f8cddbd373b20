"""``mqbench ptq --config FILE --output DIR``: post-training quantization of the configured model, in one run folder.

The run: the float model and data of the configuration; ``prepare_by_platform`` for its backend
with ``extra_prepare_dict``; calibration on ``cali_batchsize`` training batches (naive PTQ), then
``ptq_reconstruction`` with ``quantize.reconstruction`` (advanced PTQ); deployment of every artifact
the backend consumes; ``verify_deploy`` on validation samples; accuracy of the float model, the
simulation and the deployed model as its runtime serves it (when the data has labels).

The run folder holds ``config.yaml`` (the configuration with every default filled in),
``quantized_state_dict.pt`` (the prepared model's state dict, loadable with
``torch.load(weights_only=True)`` into ``prepare_by_platform(model, backend, extra_prepare_dict)``
after :func:`~mqbench.advanced_ptq.restore_smoothing`), ``deploy/`` (the artifacts),
``verify.txt``, ``results.json`` and ``report.md``. Each file is written under a temporary name
and renamed when complete, so an interrupted run leaves finished files and no half-written one;
``results.json`` is written last and its ``status`` says whether the run finished.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from tqdm.auto import tqdm

from mqbench.advanced_ptq import calibrate, ptq_reconstruction
from mqbench.app.check import deploy_and_verify, deployed_runner
from mqbench.app.config import ConfigError, load_config
from mqbench.app.sources import Data, load_data, load_model
from mqbench.backends import resolve_backend
from mqbench.prepare_by_platform import prepare_by_platform
from mqbench.utils.host import describe_host, host_facts
from mqbench.utils.logger import logger

__all__ = ["RunFolder", "describe_results", "run_ptq"]


class RunFolder:
    """A run's output folder: every file written whole (temporary name, then renamed)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)

    def write_text(self, name: str, text: str) -> Path:
        return self._replace(name, lambda tmp: tmp.write_text(text))

    def write_json(self, name: str, payload: Any) -> Path:
        return self.write_text(name, json.dumps(payload, indent=2, sort_keys=False, default=str) + "\n")

    def save_torch(self, name: str, payload: Any) -> Path:
        return self._replace(name, lambda tmp: torch.save(payload, tmp))

    def _replace(self, name: str, write: Callable[[Path], Any]) -> Path:
        final = self.path / name
        tmp = final.with_name(f".{final.name}.partial")
        try:
            write(tmp)
            os.replace(tmp, final)
        finally:
            tmp.unlink(missing_ok=True)
        return final


def _seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _batches(images: Tensor, size: int) -> Iterable[Tensor]:
    return (images[i : i + size] for i in range(0, len(images), size))


@torch.no_grad()
def _accuracy(
    run: Callable[[Tensor], Any], images: Tensor, labels: Tensor | None, size: int, what: str, quiet: bool
) -> float | None:
    if labels is None:
        return None
    correct = 0
    for start in tqdm(range(0, len(images), size), desc=f"accuracy ({what})", disable=quiet, leave=False):
        logits = torch.as_tensor(np.asarray(run(images[start : start + size])))
        correct += int((logits.argmax(1) == labels[start : start + size]).sum())
    return correct / len(labels)


def _report(results: dict[str, Any]) -> str:
    def pct(value: float | None) -> str:
        return "-" if value is None else f"{100 * value:.2f} %"

    acc = results["accuracy"]
    lines = [
        f"# PTQ run: {results['model']} on {results['backend']}",
        "",
        f"Data: {results['data']['source']} ({results['data']['calibration_samples']} calibration samples, "
        f"{results['data']['val_samples']} validation samples). Method: {results['method']}.",
        "",
        "| model | top-1 accuracy |",
        "| --- | --- |",
        f"| float | {pct(acc['float'])} |",
        f"| simulated (fake quantization) | {pct(acc['simulated'])} |",
        f"| deployed ({acc.get('deployed_artifact') or '-'}, on its runtime) | {pct(acc['deployed'])} |",
        "",
        f"## Verification ({results['verify']['samples']} samples, tolerance {results['verify']['tolerance']} LSB)",
        "",
        "| artifact | runtime | max LSB difference | exact |",
        "| --- | --- | --- | --- |",
    ]
    for key, art in results["verify"]["artifacts"].items():
        lines.append(f"| {key} | {art['runtime']} | {art['max_lsb_diff']:.3g} | {100 * art['exact_fraction']:.1f} % |")
    lines += [
        "",
        f"Verdict: {'passed' if results['verify']['passed'] else 'FAILED'}.",
        "",
        *[f"- {line}" for line in results["verify"]["failures"]],
        *([""] if results["verify"]["failures"] else []),
        f"{results['host']}",
        "",
        "Timings (s): " + ", ".join(f"{k} {v:.1f}" for k, v in results["seconds"].items()),
        "",
    ]
    return "\n".join(lines)


def _verify_summary(check: Any, samples: int) -> dict[str, Any]:
    report = check.report
    artifacts = {}
    for key, art in report.artifacts.items():
        artifacts[key] = {
            "runtime": art.runtime,
            "max_lsb_diff": float(art.max_lsb_diff),
            "exact_fraction": float(art.exact_fraction),
            "host_max_lsb_diff": None if art.host is None else float(art.host.max_lsb_diff),
        }
    return {
        "passed": bool(check.passed),
        "tolerance": check.tolerance,
        "samples": samples,
        "artifacts": artifacts,
        "failures": report.failures(),
    }


def run_ptq(config_path: str | Path, output: str | Path, quiet: bool = False) -> dict[str, Any]:
    """Run the PTQ configuration ``config_path`` into the folder ``output``; returns ``results.json``'s content.

    A run that stops early (an error, Ctrl-C) leaves ``results.json`` with ``status`` ``failed`` or
    ``interrupted`` and the error, next to the files finished before it.
    """
    config = load_config(config_path)
    folder = RunFolder(output)
    results: dict[str, Any] = {"status": "running", "config": str(config_path)}
    try:
        return _run(config, folder, results, quiet)
    except KeyboardInterrupt:
        folder.write_json("results.json", {**results, "status": "interrupted"})
        raise
    except Exception as error:
        folder.write_json("results.json", {**results, "status": "failed", "error": f"{type(error).__name__}: {error}"})
        raise


def _run(config: dict[str, Any], folder: RunFolder, results: dict[str, Any], quiet: bool) -> dict[str, Any]:
    import yaml

    folder.write_text("config.yaml", yaml.safe_dump(config, sort_keys=False))
    quantize = config["quantize"]
    try:
        spec = resolve_backend(quantize["backend"])
    except (KeyError, ValueError) as error:
        raise ConfigError(f"quantize.backend: {error}") from error
    seconds: dict[str, float] = {}
    results["backend"] = spec.name
    folder.write_json("results.json", results)
    _seed(config["process"]["seed"])

    started = time.perf_counter()
    model, described = load_model(config["model"])
    data: Data = load_data(config["data"])
    batch_size = config["data"]["batch_size"]
    val, val_labels = data.val, data.val_labels
    if config["data"]["max_eval"] is not None:
        val = val[: config["data"]["max_eval"]]
        val_labels = None if val_labels is None else val_labels[: config["data"]["max_eval"]]
    seconds["load"] = time.perf_counter() - started
    logger.info("model: %s; data: %s (%d train, %d validation)", described, data.source, len(data.train), len(val))
    results |= {
        "model": described,
        "method": quantize["quantize_type"],
        "host": describe_host(),
        "host_facts": host_facts(),
    }

    started = time.perf_counter()
    float_accuracy = _accuracy(model, val, val_labels, batch_size, "float", quiet)
    seconds["float evaluation"] = time.perf_counter() - started

    started = time.perf_counter()
    try:
        qmodel = prepare_by_platform(model, spec, dict(config["extra_prepare_dict"] or {}))
    except ValueError as error:  # a key or value prepare_by_platform does not take; its message names it
        raise ConfigError(f"extra_prepare_dict: {error}") from error
    calibration = data.calibration_batches(quantize["cali_batchsize"], batch_size)
    calibrate(qmodel, tqdm(calibration, desc="calibration", disable=quiet, leave=False))
    seconds["calibration"] = time.perf_counter() - started
    if quantize["quantize_type"] == "advanced_ptq":
        started = time.perf_counter()
        recipe = dict(quantize["reconstruction"])
        recipe.setdefault("progress", not quiet)
        ptq_reconstruction(qmodel, calibration, recipe)
        seconds["reconstruction"] = time.perf_counter() - started
    qmodel.eval()
    folder.save_torch("quantized_state_dict.pt", qmodel.state_dict())

    started = time.perf_counter()
    simulated_accuracy = _accuracy(qmodel, val, val_labels, batch_size, "simulated", quiet)
    seconds["simulated evaluation"] = time.perf_counter() - started

    started = time.perf_counter()
    deploy = quantize["deploy"]
    deploy_folder = Path(deploy["output_path"]) if deploy["output_path"] else folder.path / "deploy"
    samples = val[: quantize["verify_samples"]]
    logger.info("deploying for %s into %s and verifying on %d samples", spec.name, deploy_folder, len(samples))
    check = deploy_and_verify(qmodel, spec, samples, deploy_folder, deploy["model_name"])
    folder.write_text("verify.txt", check.report.summary() + "\n")
    seconds["deploy and verify"] = time.perf_counter() - started

    started = time.perf_counter()
    artifact, runner = deployed_runner(check.result)
    deployed_accuracy = _accuracy(
        lambda x: runner(x.numpy()), val, val_labels, batch_size, f"deployed {artifact}", quiet
    )
    seconds["deployed evaluation"] = time.perf_counter() - started

    results |= {
        "status": "finished",
        "data": {
            "source": data.source,
            "calibration_samples": sum(len(b) for b in calibration),
            "val_samples": len(val),
            "classes": list(data.classes),
        },
        "accuracy": {
            "float": float_accuracy,
            "simulated": simulated_accuracy,
            "deployed": deployed_accuracy,
            "deployed_artifact": artifact,
        },
        "verify": _verify_summary(check, len(samples)),
        "artifacts": {key: str(path) for key, path in check.result.artifacts.items()},
        "seconds": seconds,
    }
    folder.write_text("report.md", _report(results))
    folder.write_json("results.json", results)
    return results


def describe_results(results: dict[str, Any]) -> str:
    """A few lines for the terminal."""
    acc = results["accuracy"]

    def pct(value: float | None) -> str:
        return "-" if value is None else f"{100 * value:.2f}%"

    verdict = "passed" if results["verify"]["passed"] else "FAILED"
    return (
        f"{results['model']} on {results['backend']} ({results['method']}): float {pct(acc['float'])}, "
        f"simulated {pct(acc['simulated'])}, deployed {pct(acc['deployed'])} ({acc['deployed_artifact']}); "
        f"verify {verdict}"
    )
