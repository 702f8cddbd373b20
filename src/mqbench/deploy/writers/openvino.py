"""The ``openvino_onnx`` artifact: written (:mod:`mqbench.deploy.writers.openvino_layout` holds the file's format
and layouts), run on OpenVINO's CPU plugin, and verified, on this host too.
"""

from __future__ import annotations

import pickle
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
from onnx import helper

from mqbench.deploy.comparison import (
    REDUCE_RANGE_REMEDY,
    ArtifactReport,
    HostReport,
    TensorDiff,
    VerifyRun,
    compare,
    host_verdict,
    run_ort,
    served_outputs,
    simulate,
    tail_quantized,
    tensor_diff,
)
from mqbench.deploy.onnx_graph import (
    consumers_of,
    save_model,
)
from mqbench.deploy.writers.openvino_layout import (
    FAKE_QUANTIZE_DOMAIN,
    _constant_values,
    fake_quantize_as_onnx,
    fake_quantize_outputs,
    to_openvino,
)
from mqbench.nn.quantized.saturation import ONEDNN_AVX2
from mqbench.qparams import QParamTable

if TYPE_CHECKING:
    from mqbench.deploy.context import DeployContext

__all__ = [
    "FAKE_QUANTIZE_DOMAIN",
    "fake_quantize_as_onnx",
    "fake_quantize_outputs",
    "run_openvino",
    "run_openvino_file",
    "run_openvino_isolated",
    "to_openvino",
    "write",
]


def write(context: DeployContext) -> Path:
    """The ``openvino_onnx`` artifact: ``<model_name>_openvino.onnx``.

    MQBench writes its FakeQuantize model as ``<model_name>_deploy_model.onnx``; here that name is
    the float model every backend's deployment holds (the ``deploy_onnx`` artifact), so the
    FakeQuantize model keeps a name of its own.
    """
    model, _ = to_openvino(context.float_model, context.table)
    path = context.path("_openvino.onnx")
    save_model(model, path)
    return path


def run_openvino(
    path: str | Path,
    inputs: Mapping[str, np.ndarray],
    outputs: Sequence[str] | None = None,
    threads: int = 2,
    precision: str | None = "f32",
) -> dict[str, np.ndarray]:
    """Run an ONNX model with OpenVINO's CPU plugin; ``outputs`` may name intermediate tensors too.

    Requested tensors that are not graph outputs become outputs of an in-memory copy first.
    ``precision`` sets ``INFERENCE_PRECISION_HINT`` ("f32" by default: on CPUs with bf16 support
    the plugin's default is bf16, far from the Q/DQ arithmetic); None leaves the plugin's choice.
    """
    import openvino as ov

    model = onnx.load(str(path))
    declared = [v.name for v in model.graph.output]
    names = list(outputs) if outputs is not None else declared
    produced = {o for n in model.graph.node for o in n.output} | {v.name for v in model.graph.input}
    unknown = [name for name in names if name not in produced and name not in declared]
    if unknown:
        raise ValueError(f"the model has no tensors named {unknown[:5]}")
    for name in names:
        if name not in declared:
            model.graph.output.append(helper.make_empty_tensor_value_info(name))
            declared.append(name)
    core = ov.Core()
    with tempfile.TemporaryDirectory() as folder:
        copy = Path(folder) / "model.onnx"
        onnx.save(model, str(copy))
        ov_model = core.read_model(str(copy))
    compiled = core.compile_model(ov_model, "CPU", _compile_config(threads, precision))
    results = compiled({name: np.ascontiguousarray(value) for name, value in inputs.items()})
    by_name: dict[str, np.ndarray] = {}
    for port, value in results.items():
        for name in port.get_names():
            by_name[name] = np.asarray(value)
    missing = [name for name in names if name not in by_name]
    if missing:
        raise ValueError(f"OpenVINO returned no tensors named {missing[:5]}")
    return {name: by_name[name] for name in names}


def _compile_config(threads: int, precision: str | None) -> dict[str, object]:
    config: dict[str, object] = {"INFERENCE_NUM_THREADS": int(threads)}
    if precision is not None:
        config["INFERENCE_PRECISION_HINT"] = precision
    return config


# The child process of run_openvino_file: only OpenVINO and numpy (no torch to import first).
_SERVE_FILE = """
import pickle, sys
from pathlib import Path
import numpy as np
import openvino as ov
model, inputs, outputs, threads, copy_threads, precision = sys.argv[1:7]
config = {"INFERENCE_NUM_THREADS": int(threads)}
copy_config = {"INFERENCE_NUM_THREADS": int(copy_threads)}
if precision:
    config["INFERENCE_PRECISION_HINT"] = copy_config["INFERENCE_PRECISION_HINT"] = precision
feeds, copies = pickle.loads(Path(inputs).read_bytes())
feeds = {name: np.ascontiguousarray(value) for name, value in feeds.items()}
core = ov.Core()
def run(compiled):
    return {name: np.asarray(value) for port, value in compiled(feeds).items() for name in port.get_names()}
served = run(core.compile_model(model, "CPU", config))
exposed = []
for expose in copies:
    copy = core.read_model(model)
    known = {name for op in copy.get_ops() for port in op.outputs() for name in port.get_names()}
    if any(name in known for name in expose):  # a tensor no output depends on is not in OpenVINO's model
        copy.add_outputs([name for name in expose if name in known])
    exposed.append(run(core.compile_model(copy, "CPU", copy_config)))
Path(outputs).write_bytes(pickle.dumps((served, exposed)))
"""


def run_openvino_file(
    path: str | Path,
    inputs: Mapping[str, np.ndarray],
    threads: int = 2,
    precision: str | None = "f32",
    timeout: float = 900.0,
) -> dict[str, np.ndarray]:
    """Compile the file at ``path`` as written (``Core().compile_model(path, "CPU")``) and run it: every output.

    It runs in a child process, so that a runtime crashing on the file (a segmentation fault while
    compiling or running) is reported as a :class:`RuntimeError` naming the exit status instead of
    ending the caller. ``threads`` and ``precision`` as in :func:`run_openvino` (the configuration
    :func:`serve` compiles with).
    """
    return run_openvino_isolated(path, inputs, [], threads, precision, timeout)[0]


def run_openvino_isolated(
    path: str | Path,
    inputs: Mapping[str, np.ndarray],
    copies: Sequence[Sequence[str]],
    threads: int = 2,
    precision: str | None = "f32",
    timeout: float = 900.0,
    copy_threads: int = 1,
) -> tuple[dict[str, np.ndarray], list[dict[str, np.ndarray]]]:
    """:func:`run_openvino_file`'s outputs, and in the same fresh process, for each list of tensor names in
    ``copies``, the values of a copy with those tensors as extra outputs (those that OpenVINO's model of the
    file has: it drops what no output depends on).

    Extra outputs change which kernels OpenVINO fuses, and with them how exact rounding ties are
    decided; a fresh process keeps the runs alike (results can depend on what ran before in a process).
    The copies run on ``copy_threads`` threads: on two, OpenVINO 2026.4 computes an int8 ``ConvTranspose``
    (stride 2) differently from run to run (1.5% of it 178 steps off in about 40% of the runs; the file and its
    copies alike), on one it is the same every time; the file itself runs on ``threads``, as a user serves it
    (verify names such a race: ``_thread_race``).
    """
    with tempfile.TemporaryDirectory() as folder:
        feeds, results = Path(folder) / "inputs.pkl", Path(folder) / "outputs.pkl"
        arrays = {name: np.asarray(value) for name, value in inputs.items()}
        feeds.write_bytes(pickle.dumps((arrays, [list(names) for names in copies])))
        command = [sys.executable, "-c", _SERVE_FILE, str(path), str(feeds), str(results), str(int(threads))]
        command += [str(int(copy_threads)), precision or ""]
        child = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        if child.returncode != 0 or not results.exists():
            status = f"signal {-child.returncode}" if child.returncode < 0 else f"exit status {child.returncode}"
            tail = child.stderr.strip().splitlines()[-3:]
            raise RuntimeError(f"OpenVINO ended with {status} compiling or running {str(path)!r}: {' | '.join(tail)}")
        served, exposed = pickle.loads(results.read_bytes())
    return served, exposed


# -- verification ----------------------------------------------------------------------------------
def verify(result: Any, feeds: Mapping[str, np.ndarray], run: VerifyRun) -> ArtifactReport:
    """The FakeQuantize model: its formula on onnxruntime, then OpenVINO's CPU plugin on this host.

    On OpenVINO, in one fresh process (:func:`run_openvino_isolated`): the file compiled and run as
    written, whose outputs the verdict compares with the simulation (each computed from the quantized
    tensors it reads, taken from a copy that exposes only those, so that OpenVINO fuses and rounds the
    rest as in the file); and a copy exposing every quantized tensor, which says where a difference
    starts (each from the copy's tensors before it). A file OpenVINO cannot compile or run fails it.
    """
    path = result.artifacts["openvino_onnx"]
    model = onnx.load(path)
    exposed = fake_quantize_outputs(model, result.table)  # tensor -> FakeQuantize output name
    names = list(result.output_names) + list(exposed.values())
    args = (result.table, exposed, run, result.output_names)
    values = run_ort(fake_quantize_as_onnx(model), feeds, names, optimize=False)
    report = compare(ArtifactReport("openvino_onnx", "FakeQuantize formula"), values, *args)
    if run.host:
        crash = None
        outputs = set(result.output_names)
        # weights are constants (the formula above checks them); exposing one can make the plugin compute the layer
        # wrongly (a per-channel scale after a depthwise convolution is folded into the exposed weights)
        extra = [
            name for tensor, name in exposed.items() if name not in outputs and result.table[tensor].kind != "weight"
        ]
        tail = [
            name for name in tail_quantized(model, result.output_names, exposed, result.table) if name not in outputs
        ]
        try:
            served, (values, tail_values) = run_openvino_isolated(path, feeds, [extra, tail])
        except RuntimeError as error:
            crash, served, values, tail_values = str(error), {}, {}, {}
        host = compare(HostReport("openvino_onnx", "OpenVINO CPU"), values, *args)
        # the file as written: its outputs, from the quantized tensors they are computed from (a copy exposing
        # only those fuses the rest as the file does)
        tail_shown = {name: tail_values[name] for name in tail if name in tail_values}
        as_written = served_outputs(HostReport("openvino_onnx", "OpenVINO CPU"), served, tail_shown, *args)
        file_values = {**tail_shown, **served}
        explained = _dropped_rounding(model, result, run, file_values) if as_written.diverging(run.tolerance) else None
        if explained is not None:
            as_written.local_outputs, effect = explained
            host.per_tensor.update({f"{tensor} (as written)": diff for tensor, diff in effect.items()})
        host.outputs, host.local_outputs, host.missing = (
            as_written.outputs,
            as_written.local_outputs,
            as_written.missing,
        )
        for tensor, name in exposed.items():
            if name in outputs and tensor in as_written.per_tensor:
                host.per_tensor[tensor] = as_written.per_tensor[tensor]
        predicted = run.predicted(result, feeds, ONEDNN_AVX2) if run.wants_prediction(host) else {}
        report.host = host_verdict(host, predicted, ONEDNN_AVX2, REDUCE_RANGE_REMEDY, run.tolerance)
        if explained is not None and report.host.cause is not None:
            report.host.cause = (
                "OpenVINO's CPU plugin computes the file as written with the rounding of the FakeQuantize between "
                "a convolution or matrix product and the Add after it left out (the Add fused into the layer), "
                f"which moves {', '.join(t for t, d in explained[1].items() if (d.max_lsb_diff or 0) > run.tolerance)}"
                " beyond the tolerance"
            )
        if crash is not None:
            report.host.cause = f"the file as written does not run: {crash}"
        elif (
            explained is None
            and as_written.diverging(run.tolerance)
            and not _normalized_without_epsilon(report.host, path, model, feeds, run)
        ):
            _thread_race(report.host, path, feeds, served, tail_shown, args)
        if crash is None and explained is None and report.host.remedy is None and report.host.diverging(run.tolerance):
            _static_shapes(report.host, model, feeds, [extra, tail], args)
    return report


def _with_dynamic_batch(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[str]] | None:
    """A copy of ``model`` whose inputs' and outputs' first dimension is symbolic ("batch"), and the inputs it
    changed; None where every input's first dimension is symbolic already."""
    changed = [value.name for value in model.graph.input if _static_first(value)]
    if not changed:
        return None
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    del copy.graph.value_info[:]  # intermediate shapes inferred for the static batch
    for value in [*copy.graph.input, *copy.graph.output]:
        if _static_first(value):
            value.type.tensor_type.shape.dim[0].dim_param = "batch"
    return copy, changed


def _static_first(value: onnx.ValueInfoProto) -> bool:
    dims = value.type.tensor_type.shape.dim
    return len(dims) > 0 and dims[0].HasField("dim_value")


def _static_shapes(
    host: HostReport,
    model: onnx.ModelProto,
    feeds: Mapping[str, np.ndarray],
    copies: Sequence[Sequence[str]],
    args: tuple[Any, ...],
) -> None:
    """Where the file parts from the simulation and nothing else explains it: whether that depends on its static
    shapes. OpenVINO's CPU plugin picks other kernels for a static batch (measured on OpenVINO 2026.4: a padded
    3x3 average pool 2 steps off); if the same file with a dynamic batch dimension computes what the simulation
    computes, at every tensor verify shows and at the outputs, the cause says so and the remedy is a dynamic batch
    axis."""
    run: VerifyRun = args[2]
    dynamic = _with_dynamic_batch(model)
    if dynamic is None:
        return
    copy, inputs = dynamic
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "dynamic_batch.onnx"
        onnx.save(copy, str(path))
        try:
            served, (values, tail_values) = run_openvino_isolated(path, feeds, copies)
        except RuntimeError:
            return
    shown = compare(HostReport("openvino_onnx", "OpenVINO CPU"), values, *args)
    tail = {name: tail_values[name] for name in copies[1] if name in tail_values}
    outputs = served_outputs(HostReport("openvino_onnx", "OpenVINO CPU"), served, tail, *args)
    if shown.diverging(run.tolerance) or outputs.diverging(run.tolerance) or outputs.missing:
        return
    parted = ", ".join(host.diverging(run.tolerance)[:5])
    host.cause = (
        f"OpenVINO's CPU plugin computes this file, whose inputs have a static batch dimension, differently at "
        f"{parted}; the same file with a dynamic batch dimension computes what the simulation computes (the "
        "plugin picks other kernels for static shapes)"
    )
    axes = ", ".join(f"{name!r}: {{0: 'batch'}}" for name in inputs)
    host.remedy = (
        f"deploy with a dynamic batch axis: convert_deploy(..., dynamic_axes={{{axes}}}) (a model captured with "
        "torch.export gets one by default)"
    )


def _normalized_without_epsilon(
    host: HostReport, path: str | Path, model: onnx.ModelProto, feeds: Mapping[str, np.ndarray], run: VerifyRun
) -> bool:
    """Where the file parts from the simulation: whether OpenVINO computes its LayerNormalizations without their
    epsilon. Measured on OpenVINO 2026.4: where a normalization reads a sum of FakeQuantize outputs directly, the
    CPU plugin normalizes by the square root of the variance alone (to float32 rounding), while ONNX, like the
    simulation, adds epsilon to the variance (:func:`_normalization_keeps_epsilon` keeps the writer's own files
    from it); a row whose variance is within a few hundred times epsilon comes out steps off (the relative
    difference is about epsilon / (2 variance)). The check serves a copy showing each LayerNormalization's input
    and output, and compares the output with both formulas; if so, the cause says so (True)."""
    norms = [
        node for node in model.graph.node if node.op_type == "LayerNormalization" and node.domain in ("", "ai.onnx")
    ]
    if not norms:
        return False
    try:
        _, (values,) = run_openvino_isolated(
            path, feeds, [[n for node in norms for n in (node.input[0], node.output[0])]]
        )
    except RuntimeError:
        return False
    constants = _constant_values(model.graph)
    found = []
    for node in norms:
        x, y = values.get(node.input[0]), values.get(node.output[0])
        if x is None or y is None:
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        epsilon, axis = float(attrs.get("epsilon", 1e-5)), int(attrs.get("axis", -1))
        axes = tuple(range(axis % x.ndim, x.ndim))
        weight = constants.get(node.input[1], 1.0) if len(node.input) > 1 else 1.0
        bias = constants.get(node.input[2], 0.0) if len(node.input) > 2 and node.input[2] else 0.0
        centered = x.astype(np.float64) - x.astype(np.float64).mean(axis=axes, keepdims=True)
        variance = (centered**2).mean(axis=axes, keepdims=True)
        with np.errstate(divide="ignore", invalid="ignore"):
            kept = np.abs(centered / np.sqrt(variance + epsilon) * weight + bias - y).max()
            left_out = np.abs(centered / np.sqrt(variance) * weight + bias - y).max()
        size = max(float(np.abs(y).max()), 1.0)
        if left_out <= 1e-5 * size < kept:
            found.append((node.output[0], epsilon, float(variance.min()), float(kept) / size))
    if not found:
        return False
    parted = ", ".join(host.diverging(run.tolerance)[:5])
    names = ", ".join(name for name, _, _, _ in found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
    epsilon, variance = found[0][1], min(v for _, _, v, _ in found)
    worst = max(off for _, _, _, off in found)
    host.cause = (
        f"OpenVINO's CPU plugin computes the LayerNormalization of {names} without its epsilon ({epsilon:g}), which "
        f"ONNX and the simulation add to the variance: rows with a variance down to {variance:.2g} come out up to "
        f"{worst:.2%} off, which moves {parted}"
    )
    host.remedy = (
        "have the normalization read its input through an op the plugin moves no scale through, such as "
        "Max(x, x) (the writer does so for each LayerNormalization and ReduceMean / Sub normalization it finds; "
        "this one is written otherwise); the difference is about epsilon / (2 x variance) of a row, below one step "
        "where the rows' variance is far above epsilon (as in a trained model)"
    )
    return True


SERVED_THREADS = 2  # the threads verify serves the file on (run_openvino_isolated's default)
RACE_RUNS = 3  # how many more times verify serves a file whose outputs part from the simulation


def _thread_race(
    host: HostReport,
    path: str | Path,
    feeds: Mapping[str, np.ndarray],
    served: Mapping[str, np.ndarray],
    tail: Mapping[str, np.ndarray],
    args: tuple[Any, ...],
) -> None:
    """Where the file's outputs part from the simulation: whether that depends on OpenVINO's threads.

    The file is served once on one thread. If its outputs there are what the simulation computes (from the same
    quantized tensors), it is served :data:`RACE_RUNS` more times on :data:`SERVED_THREADS` threads, and the cause
    says so, and whether the outputs on more threads changed from run to run (a race in the plugin: measured on
    OpenVINO 2026.4 with an int8 stride-2 ``ConvTranspose``), and the remedy is serving it on one thread.
    """
    run: VerifyRun = args[2]
    try:  # where one thread parts from the simulation too, threads are not the cause: no more runs
        single = run_openvino_file(path, feeds, threads=1)
        if served_outputs(HostReport("openvino_onnx", "OpenVINO CPU"), single, tail, *args).diverging(run.tolerance):
            return
        again = [run_openvino_file(path, feeds, threads=SERVED_THREADS) for _ in range(RACE_RUNS)]
    except RuntimeError:
        return
    changed = sum(any(not np.array_equal(run[name], served[name]) for name in served if name in run) for run in again)
    how = (
        f"differently from run to run on {SERVED_THREADS} threads ({changed} of {RACE_RUNS} more runs gave other "
        "outputs: a race in the plugin)"
        if changed
        else f"differently on {SERVED_THREADS} threads"
    )
    parted = ", ".join(host.diverging(run.tolerance)[:5])
    host.cause = (
        f"OpenVINO's CPU plugin computes the file as written {how} at {parted}; on one thread it computes what the "
        "simulation computes"
    )
    host.remedy = "serve this file on one thread: core.compile_model(path, 'CPU', {'INFERENCE_NUM_THREADS': 1})"


def _rounding_before_add(model: onnx.ModelProto, table: QParamTable) -> dict[tuple[str, int], tuple[float, float]]:
    """The quantizer calls whose FakeQuantize reads a Conv, MatMul or Gemm and is read by an Add: their limits."""
    producers = {name: node for node in model.graph.node for name in node.output}
    users = consumers_of(model.graph)
    constants = _constant_values(model.graph)
    found: dict[tuple[str, int], tuple[float, float]] = {}
    for node in model.graph.node:
        if node.op_type != "FakeQuantize" or node.domain != FAKE_QUANTIZE_DOMAIN or node.input[0] not in table:
            continue
        producer = producers.get(node.input[0])
        if producer is not None and producer.op_type == "Add":  # a Linear on 3-d inputs: MatMul, then its bias
            layer = [producers.get(name) for name in producer.input if name not in constants]
            producer = layer[0] if len(layer) == 1 else None
        entry = table[node.input[0]]
        if producer is None or producer.op_type not in ("Conv", "MatMul", "Gemm") or entry.axis is not None:
            continue
        if any(user.op_type in ("Add", "Sum") for user in users.get(node.output[0], [])):
            found[entry.quantizer, int(entry.extra.get("call", 0))] = entry.float_range()
    return found


def _dropped_rounding(
    model: onnx.ModelProto, result: Any, run: VerifyRun, values: Mapping[str, np.ndarray]
) -> tuple[dict[str, TensorDiff], dict[str, TensorDiff]] | None:
    """Where the file as written parts from the simulation at its outputs: whether OpenVINO's CPU plugin left out
    the rounding of a FakeQuantize before an Add it fused into the layer in front (it clamps, but does not round,
    that layer's output; exposing a tensor undoes the fusion, so no copy shows it).

    If the outputs of the file equal those of the simulation with those roundings left out, returns them compared
    with it, and what leaving them out does to each quantized tensor (in its steps, each computed from the same
    values before it, as verify measures every tensor); else None.
    """
    unrounded = _rounding_before_add(model, result.table)
    if not unrounded:
        return None
    sim = simulate(run.model, run.inputs, None, unrounded)
    by_output = {out: entry for entry in result.table.values() for out in entry.extra.get("outputs", ())}
    outputs = {}
    for index, name in enumerate(result.output_names):
        if name not in values or index >= len(sim.outputs):
            return None
        diff = tensor_diff(name, by_output.get(name), sim.outputs[index], values[name])
        if diff.float_mismatch() or (diff.max_lsb_diff is not None and diff.max_lsb_diff > run.tolerance):
            return None
        outputs[name] = diff
    # each quantized tensor as the simulation computes it from the values before it with those roundings left out:
    # its own difference, as verify measures every tensor
    local = simulate(run.model, run.inputs, sim.quantized)
    effect = {}
    for tensor, entry in result.table.items():
        key = (entry.quantizer, int(entry.extra.get("call", 0)))
        if key in sim.quantized and key in local.quantized:
            diff = tensor_diff(tensor, entry, local.quantized[key], sim.quantized[key])
            if diff.exact_fraction < 1.0:
                effect[tensor] = diff
    return outputs, effect


def serve(result: Any, threads: int = 2) -> Callable[[Mapping[str, np.ndarray]], list[np.ndarray]]:
    """The FakeQuantize model on OpenVINO's CPU plugin, compiled once (f32 inference precision, as verified)."""
    import openvino as ov

    path, outputs = result.artifacts["openvino_onnx"], list(result.output_names)
    config: dict[str, object] = {"INFERENCE_NUM_THREADS": int(threads), "INFERENCE_PRECISION_HINT": "f32"}
    compiled = ov.Core().compile_model(str(path), "CPU", config)
    ports = {name: port for port in compiled.outputs for name in port.get_names()}
    missing = [name for name in outputs if name not in ports]
    if missing:
        raise ValueError(f"OpenVINO's compiled model has no outputs named {missing[:5]}")

    def run(feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        values = compiled({name: np.ascontiguousarray(value) for name, value in feeds.items()})
        return [np.asarray(values[ports[name]]) for name in outputs]

    return run
