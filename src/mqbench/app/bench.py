"""``mqbench bench --config FILE --output DIR``: a matrix of backends x methods x models in one command.

The hardware-aware table MQBench's paper reports, measured here: for every combination, the
accuracy of the simulation and of the deployed model on its runtime, the largest verification
difference (LSB), and the deployed model's latency on its runtime (one sample, median of
``latency_repeats`` runs, runtimes set to 2 threads without spinning). Each combination is an
ordinary ``mqbench ptq`` run in ``DIR/<model>-<backend>-<method>/``; the matrix is written as
``bench.md``, ``bench.json`` and ``bench.png``.

The configuration is a run configuration (the keys of ``mqbench ptq``, shared by every
combination) with a ``bench`` section:

.. code-block:: yaml

    bench:
      models: [resnet18, mobilenet_v2]      # model.type of each row (zoo names, import paths, ...)
      backends: [tensorrt, openvino, snpe]
      methods: [naive_ptq]                  # naive_ptq and/or advanced_ptq (needs quantize.reconstruction)
      latency_repeats: 20

Example:
    >>> split_bench({"bench": {"models": ["resnet18"], "backends": ["tensorrt"]}})[0]["methods"]
    ['naive_ptq']
"""

from __future__ import annotations

import copy
import statistics
import time
from pathlib import Path
from typing import Any

import yaml

from mqbench.app.check import deployed_runner
from mqbench.app.config import QUANTIZE_TYPES, ConfigError, parse_config
from mqbench.app.folder import OutputError, RunFolder
from mqbench.app.ptq import run_ptq_with_handles

__all__ = ["BENCH_DEFAULTS", "run_bench", "split_bench"]

BENCH_DEFAULTS: dict[str, Any] = {"models": None, "backends": None, "methods": ["naive_ptq"], "latency_repeats": 20}


def split_bench(raw: Any, source: str = "<config>") -> tuple[dict[str, Any], dict[str, Any]]:
    """(the bench section with defaults, the rest: a run configuration) of a bench configuration."""
    if not isinstance(raw, dict) or not isinstance(raw.get("bench"), dict):
        raise ConfigError(f"{source}: a bench configuration needs a 'bench' section (models, backends, methods)")
    rest = {k: v for k, v in raw.items() if k != "bench"}
    bench = {**BENCH_DEFAULTS, **raw["bench"]}
    unknown = sorted(set(bench) - set(BENCH_DEFAULTS))
    if unknown:
        raise ConfigError(
            f"{source}: unknown key 'bench.{unknown[0]}'; valid keys: {', '.join(sorted(BENCH_DEFAULTS))}"
        )
    for key in ("models", "backends", "methods"):
        value = bench[key]
        if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
            raise ConfigError(f"{source}: 'bench.{key}' must be a non-empty list of names, got {value!r}")
    bad = [m for m in bench["methods"] if m not in QUANTIZE_TYPES]
    if bad:
        raise ConfigError(f"{source}: 'bench.methods' has {bad[0]!r}; choose from {', '.join(QUANTIZE_TYPES)}")
    repeats = bench["latency_repeats"]
    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
        raise ConfigError(f"{source}: 'bench.latency_repeats' must be a positive integer, got {repeats!r}")
    return bench, rest


def _latency_ms(handles: dict[str, Any], repeats: int) -> float:
    """Median milliseconds of one sample through the deployed model on its runtime."""
    _, runner = deployed_runner(handles["deploy_result"])
    sample = handles["sample"]
    for _ in range(3):
        runner(sample)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        runner(sample)
        times.append(time.perf_counter() - started)
    return 1e3 * statistics.median(times)


def run_bench(
    config_path: str | Path, output: str | Path, quiet: bool = False, overwrite: bool = False
) -> dict[str, Any]:
    """Run every combination of the bench configuration ``config_path`` into ``output``; returns ``bench.json``.

    ``overwrite``: replace an earlier bench in ``output`` and its runs (refused otherwise)."""
    file = Path(config_path)
    if not file.is_file():
        raise ConfigError(f"{file}: no such configuration file")
    raw = yaml.safe_load(file.read_text())
    bench, rest = split_bench(raw, str(file))
    if (Path(output) / "bench.json").is_file() and not overwrite:
        raise OutputError(
            f"{output} holds an earlier bench (bench.json); give --output another folder, or add --overwrite to "
            "run it again there (each combination's run folder is replaced when its new run finishes)"
        )
    folder = RunFolder(output)
    rows: list[dict[str, Any]] = []
    for model in bench["models"]:
        for backend in bench["backends"]:
            for method in bench["methods"]:
                combination = copy.deepcopy(rest)
                combination.setdefault("model", {})["type"] = model
                combination.setdefault("quantize", {})["backend"] = backend
                combination["quantize"]["quantize_type"] = method
                config = parse_config(combination, f"{file} ({model}, {backend}, {method})")
                name = f"{model.replace(':', '_').replace('.', '_')}-{backend}-{method}"
                started = time.perf_counter()
                result, handles = run_ptq_with_handles(config, folder.path / name, quiet, overwrite)
                latency = _latency_ms(handles, bench["latency_repeats"])
                row = {
                    "model": model,
                    "backend": result["backend"],
                    "method": method,
                    "float": result["accuracy"]["float"],
                    "simulated": result["accuracy"]["simulated"],
                    "deployed": result["accuracy"]["deployed"],
                    "artifact": result["accuracy"]["deployed_artifact"],
                    "max_lsb": max((a["max_lsb_diff"] for a in result["verify"]["artifacts"].values()), default=None),
                    "verified": result["verify"]["passed"],
                    "latency_ms": latency,
                    "seconds": time.perf_counter() - started,
                    "run": name,
                }
                rows.append(row)
                folder.write_json("bench.json", {"rows": rows, "host": result["host"]})
    payload = {"rows": rows, "host": result["host"], "host_facts": result["host_facts"]}
    folder.write_text("bench.md", _markdown(rows, result["host"]))
    _plot(rows, folder)
    folder.write_json("bench.json", payload)
    return payload


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2f}"


def _markdown(rows: list[dict[str, Any]], host: str) -> str:
    lines = [
        "| model | backend | method | float % | simulated % | deployed % | runtime | max LSB | verify | latency ms |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        latency = f"{r['latency_ms']:.2f}"
        lines.append(
            f"| {r['model']} | {r['backend']} | {r['method']} | {_pct(r['float'])} | {_pct(r['simulated'])} | "
            f"{_pct(r['deployed'])} | {r['artifact']} | {r['max_lsb']:.3g} | {'ok' if r['verified'] else 'FAILED'} | "
            f"{latency} |"
        )
    return "\n".join([*lines, "", host, ""])


def _plot(rows: list[dict[str, Any]], folder: RunFolder) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    labels = [f"{r['model']}\n{r['backend']}\n{r['method']}" for r in rows]
    figure, axis = plt.subplots(figsize=(max(5, 1.1 * len(rows)), 3.5))
    xs = range(len(rows))
    axis.bar([x - 0.2 for x in xs], [100 * (r["simulated"] or 0) for r in rows], width=0.4, label="simulated")
    axis.bar([x + 0.2 for x in xs], [100 * (r["deployed"] or 0) for r in rows], width=0.4, label="deployed")
    axis.set_xticks(list(xs))
    axis.set_xticklabels(labels, fontsize=7)
    axis.set_ylabel("top-1 accuracy (%)")
    axis.legend(fontsize=7)
    folder._replace("bench.png", lambda tmp: figure.savefig(tmp, format="png", dpi=100, bbox_inches="tight"))
    plt.close(figure)
