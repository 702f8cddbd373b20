"""Timing helpers shared by the benchmark scripts: interleaved repeats, medians, JSON output."""

from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from mqbench.utils.host import host_facts

RESULTS = Path(__file__).resolve().parent / "results"


def interleaved_samples(
    functions: dict[str, Callable[[], object]], repeats: int, warmup: int = 3
) -> dict[str, list[float]]:
    """Seconds of each call of each function, calls interleaved so machine noise hits all alike."""
    for function in functions.values():
        for _ in range(warmup):
            function()
    samples: dict[str, list[float]] = {name: [] for name in functions}
    for _ in range(repeats):
        for name, function in functions.items():
            start = time.perf_counter()
            function()
            samples[name].append(time.perf_counter() - start)
    return samples


def time_interleaved(functions: dict[str, Callable[[], object]], repeats: int, warmup: int = 3) -> dict[str, float]:
    """Median seconds per call of each function, calls interleaved so machine noise hits all alike."""
    samples = interleaved_samples(functions, repeats, warmup)
    return {name: statistics.median(values) for name, values in samples.items()}


def paired_ratio(samples: dict[str, list[float]], numerator: str, denominator: str) -> float:
    """The median over repeats of numerator / denominator within each repeat: the calls of one repeat run
    back to back, so a slow stretch of the machine scales both, where a ratio of medians would take them
    from different stretches."""
    return statistics.median(a / b for a, b in zip(samples[numerator], samples[denominator], strict=True))


def write_json(name: str, payload: dict) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    payload = {
        "machine": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
        },
        "host": host_facts(),  # the instruction sets and runtimes that decide int8 behaviour and speed
        **payload,
    }
    path.write_text(json.dumps(payload, indent=2))
    return path


def print_table(headers: list[str], rows: list[list[object]]) -> None:
    cells = [[str(value) for value in row] for row in rows]
    widths = [max(len(header), *(len(row[i]) for row in cells)) for i, header in enumerate(headers)]
    print("  ".join(header.ljust(width) for header, width in zip(headers, widths, strict=True)))
    print("  ".join("-" * width for width in widths))
    for row in cells:
        print("  ".join(value.ljust(width) for value, width in zip(row, widths, strict=True)))
