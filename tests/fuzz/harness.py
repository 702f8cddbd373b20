"""Run one fuzz graph through one backend exactly as a user does, and classify what happened.

The flow (public API only): ``prepare_by_platform(model.eval(), backend)`` -> ``enable_calibration`` ->
the graph's calibration batches -> ``enable_quantization`` -> ``convert_deploy(..., dummy_input=...,
output_path=tmp)`` -> ``verify_deploy(qmodel, result, inputs, reference=True)`` on a batch apart
from the calibration ones -> an independent check of every model artifact.

Statuses (:class:`CaseResult`):

* ``ok``: deployed, verified, and the independent check agrees.
* ``clear_error``: a ValueError, TypeError or NotImplementedError raised by mqbench's own code (the
  innermost frame of its traceback is in the mqbench package): a message the user can act on.
* ``crash``: any other exception (AttributeError, KeyError, runtime or torch internals, asserts, ...).
* ``verify_failed``: ``verify_deploy`` ran and its report did not pass.
* ``silent``: verify passed, but the artifacts, loaded as a user loads them, do not compute the
  simulation's outputs (see :func:`check_artifacts` for the tolerance), or the prepared model with
  quantization switched off no longer computes the float model.

Example:
    >>> from fuzz.grammar import generate
    >>> run_case(generate(1, "sequence"), "qdq").status
    'ok'
"""

from __future__ import annotations

import tempfile
import time
import traceback
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import torch
from torch import Tensor, nn

import mqbench
from backend_configs import host_config
from fuzz.builder import FuzzGraph
from mqbench.backends import ParamsTable
from mqbench.convert_deploy import convert_deploy
from mqbench.deploy.verify import verify_deploy
from mqbench.prepare_by_platform import prepare_by_platform
from mqbench.utils.state import disable_all, enable_calibration, enable_quantization

__all__ = [
    "FLOAT_RELATIVE",
    "MAX_RELATIVE",
    "STATUSES",
    "ArtifactMismatchError",
    "CaseResult",
    "calibrate",
    "check_artifacts",
    "classify_error",
    "ort_session",
    "run_case",
]

STATUSES = ("ok", "clear_error", "crash", "verify_failed", "silent")
CLEAR_ERRORS = (ValueError, TypeError, NotImplementedError)
MQBENCH_ROOT = str(Path(mqbench.__file__).resolve().parent)
MODEL_ARTIFACTS = ("onnx", "qlinear_onnx", "openvino_onnx")

# The independent check's tolerance, as a fraction of an output's range: the span from min(0, min) to
# max(0, max) of the simulation's values, what an 8-bit quantizer of that output would cover. The
# artifact and the simulation compute one quantized function, so they may part only where a value
# lands on a rounding tie that float arithmetic in another order decides the other way: one step of
# one quantizer, which reaches an output scaled by the layers after it, and may tip further
# quantizers on the way. Measured on 40 fuzz graphs x 14 backends (benchmarks/fuzz.py prints the
# largest passing difference): at most 3.3% of the range (4 steps of a Vitis output quantizer, after
# onnxruntime's optimized kernels took 1-step flips on 18% of one float-weight conv's outputs); a
# single flip in front of a small final Linear moves its output about 1%. A wrong deployment is off
# by far more: the output clipped to its reader's input range (the known defect) by 52% of it.
MAX_RELATIVE = 0.10  # 3x the largest difference seen on correct deployments, 5x below the known defect
# The prepared model with every quantizer off is the float model, up to BatchNorm folded into weights.
FLOAT_RELATIVE = 1e-3


@dataclass
class CaseResult:
    """One graph x backend: the status, the stage it ended in, and the error or finding."""

    seed: int
    family: str
    backend: str
    status: str
    stage: str = "done"  # prepare, calibrate, deploy, verify, check, float
    error_type: str = ""
    message: str = ""
    location: str = ""  # file:line of the innermost frame of an exception
    seconds: float = 0.0
    check_relative: float | None = None  # the check's largest output difference / range (where it ran)
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        text = f"seed {self.seed} ({self.family}) on {self.backend}: {self.status} at {self.stage}"
        if self.error_type:
            text += f": {self.error_type}"
        return text + (f": {self.message}" if self.message else "")


def _innermost(error: BaseException) -> traceback.FrameSummary | None:
    frames = traceback.extract_tb(error.__traceback__)
    return frames[-1] if frames else None


def classify_error(error: BaseException) -> tuple[str, str]:
    """``("clear_error" | "crash", "file:line")``: clear only for a ValueError, TypeError or
    NotImplementedError whose innermost frame is in the mqbench package."""
    frame = _innermost(error)
    location = f"{frame.filename}:{frame.lineno}" if frame else ""
    ours = frame is not None and str(Path(frame.filename).resolve()).startswith(MQBENCH_ROOT)
    status = "clear_error" if isinstance(error, CLEAR_ERRORS) and ours else "crash"
    return status, location


def _as_list(outputs: Any) -> list[Tensor]:
    if isinstance(outputs, Tensor):
        return [outputs]
    flat: list[Tensor] = []
    for item in outputs:
        flat.extend(_as_list(item))
    return flat


def ort_session(path: str, optimize: bool = True) -> ort.InferenceSession:
    """An onnxruntime session as a user opens one (default optimizations), on 2 threads without spinning;
    ``optimize=False``: the file's arithmetic as written (no fused int8 kernels)."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if not optimize:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])


def _run_onnxruntime(path: str, feeds: dict[str, np.ndarray], optimize: bool = True) -> list[np.ndarray]:
    session = ort_session(path, optimize)
    wanted = [value.name for value in session.get_inputs()]
    unknown = [name for name in wanted if name not in feeds]
    if unknown:
        raise ArtifactMismatchError(
            f"the artifact takes inputs {unknown}, which are not the deployment's inputs {list(feeds)}"
        )
    return [np.asarray(value) for value in session.run(None, {name: feeds[name] for name in wanted})]


def _run_openvino(path: str, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    from openvino import Core  # optional runtime: loaded only for deployments that write its model

    compiled = Core().compile_model(path, "CPU")
    # a port has every name of its tensor (an input read only by a Reshape is also the Reshape's output)
    names = [next((n for n in sorted(port.get_names()) if n in feeds), None) for port in compiled.inputs]
    if None in names:
        shown = [sorted(port.get_names()) for port in compiled.inputs]
        raise ArtifactMismatchError(
            f"the artifact takes inputs {shown}, which are not the deployment's inputs {list(feeds)}"
        )
    values = compiled({name: feeds[name] for name in names if name is not None})
    return [np.asarray(values[port]) for port in compiled.outputs]


class ArtifactMismatchError(Exception):
    """A model artifact that does not compute what the simulation computes (or takes other inputs)."""


def _compare(label: str, expected: Sequence[np.ndarray], got: Sequence[np.ndarray], relative: float) -> float:
    """The largest difference over the outputs, as a fraction of each output's range; raises beyond ``relative``."""
    if len(got) != len(expected):
        raise ArtifactMismatchError(f"{label}: {len(got)} output(s), the simulation has {len(expected)}")
    largest = 0.0
    for index, (want, have) in enumerate(zip(expected, got, strict=True)):
        if have.size != want.size:
            raise ArtifactMismatchError(
                f"{label} output {index}: shape {list(have.shape)}, simulation {list(want.shape)}"
            )
        want64 = want.astype(np.float64).reshape(-1)
        have64 = have.astype(np.float64).reshape(-1)
        if not want64.size:
            continue
        span = float(max(want64.max(), 0.0) - min(want64.min(), 0.0)) or 1.0  # an 8-bit grid's range holds 0
        delta = np.abs(have64 - want64)
        worst = float(delta.max()) / span
        if not worst <= relative:  # NaN included
            raise ArtifactMismatchError(
                f"{label} output {index}: off by up to {worst:.1%} of its range ({float(delta.max()):.4g} of "
                f"{span:.4g}), {float(np.mean(delta > relative * span)):.0%} of elements beyond {relative:.1%}"
            )
        largest = max(largest, worst)
    return largest


def _simulated(qmodel: nn.Module, result: Any, inputs: Sequence[Tensor]) -> tuple[dict, list[np.ndarray]]:
    # Copies: a model with an inplace op on its input changes the tensor it is given.
    feeds = {name: t.detach().cpu().numpy().copy() for name, t in zip(result.input_names, inputs, strict=True)}
    with torch.no_grad():
        expected = [t.detach().cpu().numpy() for t in _as_list(qmodel(*[t.clone() for t in inputs]))]
    return feeds, expected


def tie_floor(qmodel: nn.Module, result: Any, inputs: Sequence[Tensor]) -> float:
    """The largest output difference (a fraction of the range, as in the check) between ``qmodel`` and the Q/DQ
    model as written on onnxruntime: float ops on dequantized values, the simulation's own arithmetic in another
    order, whose only departures are rounding ties decided the other way, as many layers deep as the model
    carries them. On a deep network (a transformer of random weights, say) these reach past ``MAX_RELATIVE``."""
    feeds, expected = _simulated(qmodel, result, inputs)
    return _compare("onnx", expected, _run_onnxruntime(result.artifacts["onnx"], feeds, optimize=False), np.inf)


def check_artifacts(qmodel: nn.Module, result: Any, inputs: Sequence[Tensor], relative: float = MAX_RELATIVE) -> float:
    """Load each model artifact as a user would, run it on ``inputs`` and compare every output with
    ``qmodel(*inputs)``: the largest difference as a fraction of the output's range (see
    ``MAX_RELATIVE``); raises ArtifactMismatchError naming the artifact and output that is off by more than
    ``relative``."""
    feeds, expected = _simulated(qmodel, result, inputs)
    # The Q/DQ model of a backend no CPU runtime serves (TensorRT, SNPE, ...) stands for that hardware: its
    # arithmetic as written is what it means, as verify takes it; onnxruntime's fused int8 kernels are not it.
    served = ParamsTable[result.backend].served_on_cpu
    runners = {
        "onnx": lambda path, feeds: _run_onnxruntime(path, feeds, optimize=served),
        "qlinear_onnx": _run_onnxruntime,
        "openvino_onnx": _run_openvino,
    }
    largest = 0.0
    for key in MODEL_ARTIFACTS:
        if key in result.artifacts:
            got = runners[key](result.artifacts[key], feeds)
            largest = max(largest, _compare(key, expected, got, relative))
    return largest


def _check_float(graph: FuzzGraph, qmodel: nn.Module, inputs: Sequence[Tensor]) -> None:
    """With every quantizer off, the prepared model computes the float model (BN folding aside)."""
    model = graph.build()
    disable_all(qmodel)
    try:
        with torch.no_grad():
            expected = [t.numpy() for t in _as_list(model(*[t.clone() for t in inputs]))]
            got = [t.numpy() for t in _as_list(qmodel(*[t.clone() for t in inputs]))]
    finally:
        enable_quantization(qmodel)
    _compare("prepared model with quantization off", expected, got, FLOAT_RELATIVE)


def prepare_config(backend: str) -> dict | None:
    """What a user passes: the 8-bit settings for a backend without default quantizers, and on a host whose int8
    kernels saturate 16-bit pair sums (x86 without VNNI) the documented remedy for a backend a CPU runtime serves
    (``reduce_range``: 7-bit weights); see ``backend_configs.host_config``."""
    return host_config(backend)


def calibrate(graph: FuzzGraph, qmodel: nn.Module) -> nn.Module:
    """Calibrate ``qmodel`` (prepared from ``graph``) on the graph's calibration batches; quantization on."""
    enable_calibration(qmodel)
    with torch.no_grad():
        for batch in graph.calibration_batches():
            qmodel(*batch)
    enable_quantization(qmodel)
    return qmodel


def run_case(graph: FuzzGraph, backend: str, verify_scale: float = 1.0, folder: str | None = None) -> CaseResult:
    """Prepare, calibrate, deploy, verify and check ``graph`` on ``backend``; never raises for the model's sake.

    ``verify_scale`` multiplies the verification batch (1: the calibration distribution).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the graphs are tiny: more threads only wait on each other
    try:
        return _run_case(graph, backend, verify_scale, folder)
    finally:
        torch.set_num_threads(threads)


def _run_case(graph: FuzzGraph, backend: str, verify_scale: float, folder: str | None) -> CaseResult:
    start = time.perf_counter()
    case = CaseResult(graph.seed, graph.family, backend, "ok")
    stage = "prepare"
    with warnings.catch_warnings(record=True) as caught, tempfile.TemporaryDirectory(dir=folder) as tmp:
        warnings.simplefilter("always")
        try:
            qmodel = prepare_by_platform(graph.build(), backend, prepare_custom_config_dict=prepare_config(backend))
            stage = "calibrate"
            calibrate(graph, qmodel)
            stage = "deploy"
            result = convert_deploy(qmodel, backend, dummy_input=graph.batch(0), output_path=tmp)
            stage = "verify"
            report = verify_deploy(qmodel, result, graph.verify_inputs(verify_scale), reference=True)
            if not report.passed:
                case.status, case.message = "verify_failed", "; ".join(report.failures())
            else:
                stage = "check"
                case.check_relative = check_artifacts(qmodel, result, graph.verify_inputs(verify_scale))
                stage = "float"
                _check_float(graph, qmodel, graph.verify_inputs(verify_scale))
        except ArtifactMismatchError as mismatch:
            case.status, case.message = "silent", str(mismatch)
        except Exception as error:  # the harness's purpose: every failure becomes a result
            case.status, case.location = classify_error(error)
            case.error_type, case.message = type(error).__name__, str(error).strip()
        case.warnings = sorted({f"{w.category.__name__}: {w.message}" for w in caught})
    case.stage = stage if case.status != "ok" else "done"
    case.seconds = time.perf_counter() - start
    return case
