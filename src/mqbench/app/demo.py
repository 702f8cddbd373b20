"""The built-in end-to-end example behind ``mqbench demo`` (no downloads).

Trains :class:`mqbench.models.DigitsCNN` on scikit-learn's digits for a few seconds, then
for every registered backend: prepares it with :func:`~mqbench.prepare_by_platform.prepare_by_platform`,
calibrates it (post-training quantization), deploys it with
:func:`~mqbench.convert_deploy.convert_deploy`, verifies every artifact against the simulation
(:func:`~mqbench.deploy.verify.verify_deploy`) and measures the test accuracy of the deployed
model on its runtime (onnxruntime, or OpenVINO for the OpenVINO backend). Finally a 4-bit model
(LSQ weights and activations, Academic backend) is fine-tuned with quantization in the loop (QAT)
and deployed the same way.
"""

from __future__ import annotations

import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mqbench import kernels
from mqbench.app.check import accuracy, deploy_and_verify, deployed_runner, reduce_range_config
from mqbench.app.training import academic_config, calibrate, evaluate, train
from mqbench.backends import ParamsTable
from mqbench.data import Split, load_digits_split
from mqbench.models import DigitsCNN
from mqbench.prepare_by_platform import prepare_by_platform
from mqbench.utils.host import describe_host, host_facts

__all__ = ["DemoRow", "format_table", "run_demo"]


@dataclass(frozen=True)
class DemoRow:
    name: str
    weights: str
    activations: str
    accuracy: float  # the simulation's
    seconds: float
    deployed_accuracy: float | None = None  # the deployed model's, on its runtime
    runtime: str = ""  # the artifact that ran
    max_lsb: float | None = None  # the largest per-tensor difference over every verified artifact
    verified: int = 0  # artifacts checked on a runtime
    failures: tuple[str, ...] = ()  # failed verdicts (as ``mqbench verify`` decides them)
    warnings: tuple[str, ...] = ()  # what preparing, calibrating and deploying it warned about, once each

    @property
    def passed(self) -> bool:
        return not self.failures


def run_demo(
    epochs: int = 30, qat_epochs: int = 10, seed: int = 0, log: Callable[[str], None] = print
) -> list[DemoRow]:
    """Run the demo and return its table rows (also printed through ``log``).

    On a CPU whose int8 kernels saturate 16-bit pair sums (no VNNI), the backends whose Q/DQ model a
    CPU runtime serves are prepared with 7-bit weights (``reduce_range``), so that what runs here is
    what the simulation computed; every row says whether all its verdicts passed.
    """
    with tempfile.TemporaryDirectory(prefix="mqbench-demo-") as folder:
        return _run_demo(epochs, qat_epochs, seed, log, Path(folder))


def _run_demo(epochs: int, qat_epochs: int, seed: int, log: Callable[[str], None], folder: Path) -> list[DemoRow]:

    torch.manual_seed(seed)
    facts = host_facts()
    log(describe_host(facts))
    if facts["int8_pairs_saturate"]:
        served = ", ".join(name for name, spec in ParamsTable.items() if spec.served_on_cpu)
        log(
            "this CPU has no VNNI: its int8 kernels sum u8 x s8 product pairs in 16 bits, which saturate with 8-bit "
            f"weights; the CPU-served backends ({served}) are prepared with reduce_range=True (7-bit weights)"
        )
    if kernels.load() is None:
        log("(fused CPU kernels unavailable: using the slower PyTorch fallback)")
    train_split, test_split = load_digits_split(seed=seed)
    rows: list[DemoRow] = []

    start = time.perf_counter()
    float_model = train(DigitsCNN(), train_split, epochs, lr=3e-3, seed=seed)
    rows.append(DemoRow("float", "fp32", "fp32", evaluate(float_model, test_split), time.perf_counter() - start))

    verification = test_split.images[:64]
    for name, spec in ParamsTable.items():
        start = time.perf_counter()
        config = academic_config(8) if spec.weight is None else None
        reduced = bool(facts["int8_pairs_saturate"] and spec.served_on_cpu)
        if reduced:
            config = reduce_range_config(spec, config)
        weights = spec.weight.scheme if spec.weight else None
        if weights is not None and reduced:
            weights = replace(weights, bits=7)
        activations = spec.activation.scheme if spec.activation else None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            prepared = prepare_by_platform(float_model, name, config)
            calibrate(prepared, train_split)
            row = _deployed_row(
                f"{name} (PTQ)",
                name,
                prepared,
                _scheme_text(weights, "int8 LSQ"),
                _scheme_text(activations, "uint8 LSQ" if spec.weight is None else "float"),  # weight-only: float
                test_split,
                verification,
                start,
                folder,
            )
        rows.append(replace(row, warnings=tuple(dict.fromkeys(str(w.message) for w in caught))))

    start = time.perf_counter()
    qat_model = prepare_by_platform(float_model.train(), "academic", academic_config(4))
    calibrate(qat_model, train_split)
    train(qat_model, train_split, qat_epochs, lr=1e-3, seed=seed + 1)
    rows.append(
        _deployed_row(
            "academic W4A4 (QAT)",
            "academic",
            qat_model,
            "int4 LSQ",
            "uint4 LSQ",
            test_split,
            verification,
            start,
            folder,
        )
    )
    log(format_table(rows, float_accuracy=rows[0].accuracy))
    return rows


def _deployed_row(
    label: str,
    backend: str,
    model: nn.Module,
    weights: str,
    activations: str,
    test_split: Split,
    verification: torch.Tensor,
    start: float,
    folder: Path,
) -> DemoRow:

    simulated = evaluate(model, test_split)
    target = folder / label.split()[0] / label.split()[-1].strip("()")
    check = deploy_and_verify(model.eval(), backend, verification, target, model_name="digits")
    runtime, run = deployed_runner(check.result)
    deployed = accuracy(run, test_split.images, test_split.labels)
    return DemoRow(
        label,
        weights,
        activations,
        simulated,
        time.perf_counter() - start,
        deployed,
        runtime,
        check.report.max_lsb_diff,
        len(check.report.artifacts),
        tuple(check.report.failures()),
    )


def _scheme_text(scheme: Any, default: str) -> str:
    """The format as a user names it: ``int8 per-channel``, ``uint8``, ``int4 g128``, ``FP8 E4M3``, ``int8 pot``."""
    if scheme is None:
        return default
    sign = "u" if scheme.quant_min >= 0 else ""
    number = f"FP8 {scheme.fp8.upper()}" if scheme.fp8 else f"{sign}int{scheme.bits}"
    per_channel = " per-channel" if scheme.per_channel else ""
    granularity = f" g{scheme.group_size}" if scheme.group_size else per_channel
    return f"{number}{granularity}{' pot' if scheme.pot_scale else ''}"


def format_table(rows: list[DemoRow], float_accuracy: float) -> str:
    """The rows as a table whose text columns are as wide as their longest entry; below it the failed verdicts and
    the warnings, each once, under the row that gave them."""
    name_width = max(len("model"), *(len(row.name) for row in rows)) + 2
    weight_width = max(len("weights"), *(len(row.weights) for row in rows)) + 2
    act_width = max(len("activations"), *(len(row.activations) for row in rows)) + 2
    runtime_width = max(len("runtime"), *(len(row.runtime or "-") for row in rows)) + 2
    header = (
        f"{'model':<{name_width}}{'weights':<{weight_width}}{'activations':<{act_width}}{'simulated':>10}"
        f"{'deployed':>10}{'vs float':>9}{'runtime':>{runtime_width}}{'max LSB':>8}{'checked':>8}{'time':>7}"
    )
    lines = [
        "DigitsCNN on scikit-learn digits (test split, 450 images): simulation, then the deployed model on its runtime",
        header,
        "-" * len(header),
    ]
    for row in rows:
        accuracy = row.deployed_accuracy if row.deployed_accuracy is not None else row.accuracy
        delta = (accuracy - float_accuracy) * 100
        deployed = f"{row.deployed_accuracy * 100:>9.1f}%" if row.deployed_accuracy is not None else f"{'-':>10}"
        lsb = f"{row.max_lsb:>8.3g}" if row.max_lsb is not None else f"{'-':>8}"
        checked = f"{row.verified:>8}" if row.verified else f"{'-':>8}"
        checked = checked if row.passed else f"{'FAILED':>8}"
        lines.append(
            f"{row.name:<{name_width}}{row.weights:<{weight_width}}{row.activations:<{act_width}}"
            f"{row.accuracy * 100:>9.1f}%{deployed}{delta:>+8.1f}%{row.runtime or '-':>{runtime_width}}{lsb}{checked}"
            f"{row.seconds:>6.1f}s"
        )
    lines.append(
        "max LSB: the largest difference of any quantized tensor between the simulation and a runtime, over every "
        "artifact checked (Q/DQ ONNX, parameter files rebuilt, integer graphs, OpenVINO); FAILED: a verdict "
        "(the artifact's arithmetic, or this host's runtime serving it) is out of tolerance"
    )
    lines += [f"FAILED {row.name}: {line}" for row in rows for line in row.failures]
    warned = [(row.name, message) for row in rows for message in row.warnings]
    if warned:
        lines += ["", "warnings:"] + [f"  {name}: {message}" for name, message in warned]
    return "\n".join(lines)
