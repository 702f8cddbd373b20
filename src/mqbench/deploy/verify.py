"""Run a deployment's artifacts on their runtimes and compare them with the simulation, tensor by tensor.

* ``onnx`` (the Q/DQ model): onnxruntime, every quantized tensor and every output.
* ``qlinear_onnx``: onnxruntime on the integer graph; its integer tensors are dequantized.
* ``openvino_onnx``: OpenVINO's runtime.
* parameter files (clip ranges, encodings, ...): a Q/DQ model rebuilt from ``deploy_onnx`` and the
  values read back from the file alone (the placement is the deployment's), run on onnxruntime.
  This proves the file is complete and right.
* ``reference``: the integer reference executor (int32 accumulation, fixed-point requantization)
  on the Q/DQ model: what integer hardware computes.

Per quantized tensor and per output the report gives the max absolute difference, the max
difference in LSBs of that tensor's quantizer and the fraction of bit-exact elements, and it
names the first tensor (in graph order) where runtime and simulation part.

Example:
    >>> import torch, tempfile
    >>> from mqbench.prepare_by_platform import prepare_by_platform
    >>> from mqbench.utils.state import enable_calibration, enable_quantization
    >>> from mqbench.convert_deploy import convert_deploy
    >>> from mqbench.deploy.verify import verify_deploy
    >>> model = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU()).eval()
    >>> qmodel = prepare_by_platform(model, "qdq")
    >>> enable_calibration(qmodel); _ = qmodel(torch.randn(2, 1, 8, 8)); enable_quantization(qmodel)
    >>> with tempfile.TemporaryDirectory() as folder:
    ...     result = convert_deploy(qmodel, "qdq", {"x": [1, 1, 8, 8]}, output_path=folder)
    ...     report = verify_deploy(qmodel, result, torch.randn(1, 1, 8, 8))
    >>> report.max_lsb_diff <= 1
    True
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn

from mqbench.deploy.comparison import (
    ArtifactReport,
    HostReport,
    TensorDiff,
    VerifyRun,
    compare,
    feeds_for,
    run_ort,
    simulate,
    simulation_copy,
)
from mqbench.deploy.fidelity import Fidelity, simulation_fidelity
from mqbench.deploy.functions import deploy_functions
from mqbench.deploy.inputs import resolve_inputs
from mqbench.deploy.qdq import insert_qdq
from mqbench.deploy.reference import run_reference
from mqbench.deploy.writers import FORMATS, READERS
from mqbench.qparams import QParamTable, TensorQParams
from mqbench.utils.host import host_facts

__all__ = ["ArtifactReport", "HostReport", "TensorDiff", "VerifyReport", "simulate", "verify_deploy"]


@dataclass
class VerifyReport:
    """Every artifact's comparison; the top-level figures are the worst over artifacts.

    Two verdicts per artifact: its arithmetic (``artifacts[key].max_lsb_diff``: what the file means,
    the same on every host) and, where it has one, this host's runtime serving it
    (``artifacts[key].host``). ``passed`` needs both within ``tolerance`` LSBs; the host verdict of
    a Q/DQ model that no CPU runtime serves (a TensorRT or SNPE deployment's) is reported, not counted.
    """

    backend: str
    artifacts: dict[str, ArtifactReport]
    host_facts: dict[str, Any] = field(default_factory=dict)
    tolerance: float = 1
    fidelity: Fidelity | None = None  # the simulation against the float model on the same inputs

    def failures(self) -> list[str]:
        """One line per failed verdict: artifact, verdict, worst tensors; for the host also cause and remedy."""
        lines = []
        for key, art in self.artifacts.items():
            bad = art.diverging(self.tolerance)
            if bad:
                lines.append(
                    f"{key}: artifact arithmetic on {art.runtime} differs from the simulation "
                    f"(max {art.max_lsb_diff:.3g} LSB, tolerance {self.tolerance:g}) at {', '.join(bad[:5])}"
                )
            host = art.host
            if host is not None and host.served and _did_not_run(host):
                lines.append(f"{key}: {host.runtime} on this host: {host.cause}; remedy: {host.remedy or 'none known'}")
            elif host is not None and host.served and host.diverging(self.tolerance):
                bad = host.diverging(self.tolerance)
                lines.append(
                    f"{key}: {host.runtime} on this host differs (max {host.max_lsb_diff:.3g} LSB) at {len(bad)} "
                    f"tensor(s) ({', '.join(bad[:5])}); cause: {host.cause}; remedy: {host.remedy or 'none known'}"
                )
        return lines

    @property
    def passed(self) -> bool:
        return not self.failures()

    @property
    def max_abs_diff(self) -> float:
        return max((a.max_abs_diff for a in self.artifacts.values()), default=0.0)

    @property
    def max_lsb_diff(self) -> float:
        return max((a.max_lsb_diff for a in self.artifacts.values()), default=0.0)

    @property
    def exact_fraction(self) -> float:
        return min((a.exact_fraction for a in self.artifacts.values()), default=1.0)

    @property
    def per_tensor(self) -> dict[str, TensorDiff]:
        """The Q/DQ model's per-tensor comparison (the other artifacts': ``artifacts[key].per_tensor``)."""
        primary = self.artifacts.get("onnx") or next(iter(self.artifacts.values()))
        return primary.per_tensor

    @property
    def first_divergence(self) -> str | None:
        """The Q/DQ model's first quantized tensor (graph order) that is not bit-exact."""
        if not self.artifacts:
            return None
        return (self.artifacts.get("onnx") or next(iter(self.artifacts.values()))).first_divergence

    def summary(self) -> str:
        lines = [f"{'artifact':<16} {'runtime':<22} {'max |diff|':>11} {'max LSB':>8} {'exact out':>9} {'exact q':>8}"]
        for key, art in self.artifacts.items():
            for label, row in ((key, art), ("  on this host", art.host)):
                if row is None:
                    continue
                if isinstance(row, HostReport) and _did_not_run(row):  # no figures to show: the reason instead
                    lines.append(f"{label:<16} {row.runtime[:22]:<22} did not run: {row.cause}")
                    continue
                lines.append(
                    f"{label:<16} {row.runtime[:22]:<22} {row.max_abs_diff:>11.3g} {row.max_lsb_diff:>8.3g} "
                    f"{row.exact_fraction:>9.2%} {row.tensor_exact_fraction:>8.2%}"
                )
            if art.host is not None and art.host.predicted:
                shown = ", ".join(list(art.host.predicted)[:4]) + (" ..." if len(art.host.predicted) > 4 else "")
                lines.append(f"{'':<16} without VNNI {len(art.host.predicted)} layer(s) would saturate: {shown}")
        if self.fidelity is not None:
            lines.append(self.fidelity.summary())
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


def _did_not_run(host: HostReport) -> bool:
    """The runtime gave none of the outputs (it could not compile or run the file; ``cause`` says why)."""
    return bool(host.missing) and not host.outputs and not host.per_tensor


def _runner(key: str) -> Callable[..., ArtifactReport] | None:
    """How a model artifact runs on its runtime (its format record), or None for a parameter file."""
    record = FORMATS.get(key)
    return record.run if record is not None else None


def _reader(backend: str, key: str) -> Callable[..., Any] | None:
    """A step's own reader (register_deploy_function(..., reader=...)), else the built-in one."""

    return deploy_functions.reader(backend, key) or READERS.get(key)


def _verify_parameter_file(key: str, result: Any, feeds: Mapping[str, np.ndarray], run: VerifyRun) -> ArtifactReport:

    float_model = onnx.load(result.artifacts["deploy_onnx"])
    reader = _reader(result.backend, key)
    if reader is None:
        raise ValueError(f"no reader checks {key!r}")
    read = reader(result.artifacts[key], result.backend_spec, float_model)
    entries: dict[str, TensorQParams] = {}
    changed = []
    for tensor, entry in result.table.items():
        source = read.get(tensor)
        if source is None and entry.kind == "activation":
            raise ValueError(f"{key}: the file has no entry for quantized tensor {tensor!r}")
        if source is None:  # a format without weights (TensorRT's calibration cache): the deployment's
            entries[tensor] = entry
            continue
        if not _same_range(source, entry, run.tolerance):
            changed.append(f"{tensor!r} (the file's range {_shown(source)}, simulated {_shown(entry)})")
        # Values from the file; the placement (who reads the quantized value) from the deployment.
        entries[tensor] = source.with_changes(consumers=entry.consumers, quantizer=entry.quantizer, extra=entry.extra)
    table = QParamTable(entries)
    rebuilt, dequantized = insert_qdq(float_model, table)
    values = run_ort(rebuilt, feeds, list(dequantized.values()) + list(result.output_names), optimize=False)
    report = ArtifactReport(key, "onnxruntime (rebuilt)", changed=changed)
    # Measured on the simulation's grid (the deployment's table): a file whose scales or ranges were edited
    # must not set the step its own differences are counted in.
    return compare(report, values, result.table, dequantized, run, result.output_names)


def _same_range(read: TensorQParams, simulated: TensorQParams, tolerance: float) -> bool:
    """The file holds the simulated quantization: the ends of its float range lie within ``tolerance`` of the
    simulation's steps of the simulated ends. A format that cannot say a scheme exactly (a symmetric amax for
    7-bit weights in [-64, 63]) passes; an edited range (x1.5) is off by many steps."""
    if read.grid != simulated.grid:
        return False
    if read.grid != "linear":
        return bool(np.isclose(read.data_max or 0.0, simulated.data_max or 0.0, rtol=1e-6))
    step = simulated.scale.astype(np.float64)
    return all(
        float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)) / step)) <= tolerance + 1e-3
        for a, b in zip(read.float_range(), simulated.float_range(), strict=True)
    )


def _shown(entry: TensorQParams) -> str:
    low, high = entry.float_range()
    if entry.axis is not None:
        return f"per channel, up to [{float(np.min(low)):.4g}, {float(np.max(high)):.4g}]"
    return f"[{low:.4g}, {high:.4g}]"


def _verify_reference(result: Any, feeds: Mapping[str, np.ndarray], run: VerifyRun) -> ArtifactReport:

    model = onnx.load(result.artifacts["onnx"])
    names = list(dict.fromkeys([*result.dequantized.values(), *result.output_names]))
    values = run_reference(model, dict(feeds), names)
    report = ArtifactReport("reference", "integer reference")
    return compare(report, values, result.table, result.dequantized, run, result.output_names)


def _check_shapes(result: Any, feeds: Mapping[str, np.ndarray]) -> None:
    model = onnx.load(result.artifacts["deploy_onnx"], load_external_data=False)
    for value in model.graph.input:
        if value.name not in feeds:
            continue
        dims = [d.dim_value if d.HasField("dim_value") else None for d in value.type.tensor_type.shape.dim]
        got = list(feeds[value.name].shape)
        if len(dims) != len(got) or any(d is not None and d != g for d, g in zip(dims, got, strict=False)):
            shown = [d if d is not None else "dynamic" for d in dims]
            raise ValueError(
                f"the deployment takes input {value.name!r} of shape {shown}, got {got}; verify with that shape "
                "or deploy with dynamic_axes"
            )


def verify_deploy(
    qmodel: nn.Module,
    result: Any,
    inputs: Any,
    artifacts: Sequence[str] | None = None,
    reference: bool = False,
    host: bool = True,
    predict: bool | None = None,
    fidelity: bool = True,
) -> VerifyReport:
    """Compare every runnable artifact of ``result`` (a DeployResult) with ``qmodel``'s simulation on ``inputs``.

    With ``fidelity`` (default) the report also says how far the simulation is from the float model on the
    same inputs (``report.fidelity``: per output and per quantizer, :mod:`mqbench.deploy.fidelity`), and a
    simulation far from float warns, naming the worst quantizers and the remedies: a passing verification
    means the files compute the simulation, not that the simulation is close to float.

    ``artifacts`` limits the keys checked (default: every artifact with a runtime or a reader);
    ``reference=True`` also runs the integer reference executor on the Q/DQ model; ``host=False``
    skips the host verdicts (each artifact's arithmetic alone). ``predict`` runs the saturation
    model (which layers a CPU without VNNI would compute differently): True always, False never,
    None (default) where a host verdict parts from the simulation, to explain it (the QLinear
    graph's prediction comes with its arithmetic and is always given). Inputs keep their dtype
    (token ids stay int64); float inputs take the deployment's float type.

    ``inputs`` is the model's call in any form ``convert_deploy``'s ``dummy_input`` takes (a tensor, a tuple of
    positional arguments that may be dicts of tensors, optionally ending in a dict of keyword inputs, a dict),
    or a dict of the deployment's input names (``result.input_names``) -> tensor. The simulation runs ``qmodel``
    on the structured call; the artifacts get its tensors by input name.
    """

    call, tensors = resolve_inputs(qmodel, result, inputs)
    for name, tensor in zip(result.input_names, tensors, strict=True):
        if tensor.is_floating_point() and not bool(tensor.isfinite().all()):
            bad = int((~tensor.isfinite()).sum())
            raise ValueError(
                f"input {name!r} has {bad} non-finite value(s) (NaN or inf): quantized and float arithmetic give no "
                "comparable result on them; verify with finite inputs (e.g. the calibration data)"
            )
    feeds = feeds_for(result, tensors)
    _check_shapes(result, feeds)
    model = simulation_copy(qmodel)
    spec = result.backend_spec
    run = VerifyRun(model, list(call), simulate(model, call), host, spec.lsb_tolerance, spec.served_on_cpu, predict)
    readable = [k for k in result.artifacts if _runner(k) is not None or _reader(result.backend, k) is not None]
    keys = readable if artifacts is None else list(artifacts)
    reports: dict[str, ArtifactReport] = {}
    for key in keys:
        if key not in result.artifacts:
            raise ValueError(f"the deployment has no {key!r} artifact; it has {sorted(result.artifacts)}")
        runner = _runner(key)
        if runner is not None:
            reports[key] = runner(result, feeds, run)
        elif _reader(result.backend, key) is not None:
            reports[key] = _verify_parameter_file(key, result, feeds, run)
        else:
            raise ValueError(f"no runtime or reader checks {key!r}")
    if reference:
        reports["reference"] = _verify_reference(result, feeds, run)
    report = VerifyReport(result.backend, reports, host_facts(), spec.lsb_tolerance)
    if fidelity:
        copies = lambda: pytree.tree_map_only(Tensor, torch.clone, tuple(call))  # noqa: E731
        report.fidelity = simulation_fidelity(model, lambda m: m(*copies()))
        message = report.fidelity.warning()
        if message is not None:
            warnings.warn(message, stacklevel=2)
    return report
