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

import copy
import math
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import onnx
import torch
from onnx import helper
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from mqbench.backends import resolve_backend
from mqbench.deploy.functions import deploy_functions
from mqbench.deploy.onnx_graph import ort_session
from mqbench.deploy.qdq import insert_qdq
from mqbench.deploy.qlinear import exposed_tensors
from mqbench.deploy.qlinear_qdq import qlinear_as_qdq
from mqbench.deploy.reference import run_reference, saturated_layers
from mqbench.deploy.writers import READERS
from mqbench.deploy.writers.openvino import fake_quantize_as_onnx, fake_quantize_outputs, run_openvino
from mqbench.fake_quantize.quantize_base import QuantizeBase
from mqbench.nn.quantized.saturation import ONEDNN_AVX2, ORT_MLAS_AVX2, ORT_QLINEAR_AVX2, PairSaturation
from mqbench.qparams import QParamTable, TensorQParams
from mqbench.utils.host import host_facts

__all__ = ["ArtifactReport", "HostReport", "TensorDiff", "VerifyReport", "simulate", "verify_deploy"]


@dataclass(frozen=True)
class TensorDiff:
    """How one tensor of a runtime compares with the simulation."""

    name: str
    quantizer: str
    numel: int
    max_abs_diff: float
    max_lsb_diff: float | None  # None: a float tensor with no quantizer to measure LSBs by
    exact_fraction: float

    def row(self) -> str:
        lsb = "-" if self.max_lsb_diff is None else f"{self.max_lsb_diff:.3g}"
        return f"{self.name[:48]:<48} {self.max_abs_diff:>11.3g} {lsb:>8} {self.exact_fraction:>9.2%}"


@dataclass
class ArtifactReport:
    """One artifact on its runtime: every quantized tensor it exposes and every output."""

    artifact: str
    runtime: str
    per_tensor: dict[str, TensorDiff] = field(default_factory=dict)
    outputs: dict[str, TensorDiff] = field(default_factory=dict)  # end to end
    local_outputs: dict[str, TensorDiff] = field(default_factory=dict)  # from the runtime's own quantized tensors
    host: HostReport | None = None  # this host's runtime as it serves the artifact (None: no separate serving path)

    @property
    def max_abs_diff(self) -> float:
        return max((d.max_abs_diff for d in self.outputs.values()), default=0.0)

    @property
    def max_lsb_diff(self) -> float:
        """The largest per-tensor difference in LSBs (each tensor computed from the runtime's own inputs)."""
        values = [d.max_lsb_diff for d in self.per_tensor.values()]
        return max((v for v in values if v is not None), default=0.0)

    @property
    def output_max_lsb_diff(self) -> float | None:
        """End to end: the largest difference of a quantized network output, in its LSBs (None: no such output)."""
        values = [d.max_lsb_diff for d in self.outputs.values() if d.max_lsb_diff is not None]
        return max(values) if values else None

    @property
    def exact_fraction(self) -> float:
        """End to end: the fraction of network output elements that are bit-exact."""
        total = sum(d.numel for d in self.outputs.values())
        exact = sum(d.exact_fraction * d.numel for d in self.outputs.values())
        return exact / total if total else 1.0

    @property
    def tensor_exact_fraction(self) -> float:
        """Fraction of the elements of every quantized tensor that are bit-exact."""
        total = sum(d.numel for d in self.per_tensor.values())
        exact = sum(d.exact_fraction * d.numel for d in self.per_tensor.values())
        return exact / total if total else 1.0

    @property
    def first_divergence(self) -> str | None:
        """The first quantized tensor (graph order) that is not bit-exact."""
        for name, diff in self.per_tensor.items():
            if diff.exact_fraction < 1.0:
                return name
        return None

    def diverging(self, tolerance: float) -> list[str]:
        """Quantized tensors (graph order) that differ from the simulation by more than ``tolerance`` LSBs."""
        return [
            name for name, d in self.per_tensor.items() if d.max_lsb_diff is not None and d.max_lsb_diff > tolerance
        ]


@dataclass
class HostReport(ArtifactReport):
    """An artifact as this host's runtime serves it (graph optimizations on, the CPU's own int8 kernels).

    ``predicted``: the layers that a CPU without VNNI computes differently on these inputs, by the
    16-bit pair-saturation model (:mod:`mqbench.nn.quantized.saturation`), on any host, with the
    fraction of each layer's accumulator that changes. Where tensors part from the simulation,
    ``cause`` says why and ``remedy`` what removes it.
    """

    predicted: dict[str, float] = field(default_factory=dict)
    cause: str | None = None
    remedy: str | None = None
    served: bool = True  # this runtime is how the artifact is served: its verdict counts in ``passed``


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

    def failures(self) -> list[str]:
        """One line per failed verdict: artifact, verdict, worst tensors; for the host also cause and remedy."""
        lines = []
        for key, art in self.artifacts.items():
            bad = art.diverging(self.tolerance)
            if bad:
                lines.append(
                    f"{key}: artifact arithmetic on {art.runtime} differs by {art.max_lsb_diff:.3g} LSB "
                    f"(tolerance {self.tolerance:g}) at {', '.join(bad[:5])}"
                )
            host = art.host
            if host is not None and host.served and host.diverging(self.tolerance):
                bad = host.diverging(self.tolerance)
                lines.append(
                    f"{key}: {host.runtime} on this host differs by {host.max_lsb_diff:.3g} LSB at {len(bad)} "
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
                lines.append(
                    f"{label:<16} {row.runtime[:22]:<22} {row.max_abs_diff:>11.3g} {row.max_lsb_diff:>8.3g} "
                    f"{row.exact_fraction:>9.2%} {row.tensor_exact_fraction:>8.2%}"
                )
            if art.host is not None and art.host.predicted:
                shown = ", ".join(list(art.host.predicted)[:4]) + (" ..." if len(art.host.predicted) > 4 else "")
                lines.append(f"{'':<16} without VNNI {len(art.host.predicted)} layer(s) would saturate: {shown}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


# -- the simulation -------------------------------------------------------------------------------
@dataclass
class Simulation:
    outputs: list[np.ndarray]
    quantized: dict[tuple[str, int], np.ndarray]  # (quantizer name, call index) -> output


Forced = Mapping[tuple[str, int], np.ndarray]


def _simulation_copy(qmodel: nn.Module) -> nn.Module:
    model = copy.deepcopy(qmodel).eval()
    for module in model.modules():
        if isinstance(module, QuantizeBase):
            module.disable_observer()
    return model


def simulate(model: nn.Module, inputs: Sequence[Tensor], forced: Forced | None = None) -> Simulation:
    """Run the simulation (eval mode, observers off) recording every enabled quantizer's output.

    With ``forced``, each quantizer's output is recorded and then replaced by the runtime's value
    for that tensor, so the next layers start from what the runtime computed: each tensor's
    difference is then that layer's own, not an accumulation of earlier ones.
    """
    records: dict[tuple[str, int], np.ndarray] = {}
    calls: dict[str, int] = defaultdict(int)
    handles = []
    for name, module in model.named_modules():
        if isinstance(module, QuantizeBase):

            def hook(mod: nn.Module, args: Any, output: Tensor, name: str = name) -> Tensor | None:
                key = (name, calls[name])
                calls[name] += 1
                records[key] = output.detach().float().numpy().copy()
                if forced is not None and key in forced and forced[key].size == output.numel():
                    # A copy: an in-place op after the quantizer must not write into the runtime's values.
                    return torch.tensor(forced[key], dtype=output.dtype).reshape(output.shape)
                return None

            handles.append(module.register_forward_hook(hook))
    try:
        with torch.no_grad():
            flat, _ = pytree.tree_flatten(model(*inputs))
    finally:
        for handle in handles:
            handle.remove()
    return Simulation([t.detach().float().numpy() for t in flat if isinstance(t, Tensor)], records)


# -- comparisons ----------------------------------------------------------------------------------
def _log_index(values: np.ndarray, entry: TensorQParams) -> np.ndarray:
    z = round(16 * math.log2(max(float(entry.data_max or 0.0), float(np.finfo(np.float32).tiny)))) - 127
    magnitude = np.abs(values.astype(np.float64))
    with np.errstate(divide="ignore"):
        k = np.where(magnitude > 0, np.round(16 * np.log2(np.maximum(magnitude, 1e-300))) - z + 1, 0)
    return np.sign(values) * k


def _diff(name: str, entry: TensorQParams | None, sim: np.ndarray, got: np.ndarray) -> TensorDiff:
    got = np.asarray(got, dtype=np.float32)
    if got.shape != sim.shape:
        if got.size != sim.size:
            raise ValueError(f"tensor {name!r}: runtime shape {list(got.shape)} vs simulation {list(sim.shape)}")
        got = got.reshape(sim.shape)
    delta = np.abs(got.astype(np.float64) - sim.astype(np.float64))
    lsb = None
    if entry is not None:
        if entry.grid == "log":
            lsb = float(np.max(np.abs(_log_index(got, entry) - _log_index(sim, entry)), initial=0.0))
        else:
            scale = entry.scale.astype(np.float64)
            if entry.axis is not None and sim.ndim:
                shape = [1] * sim.ndim
                shape[entry.axis % sim.ndim] = -1
                scale = scale.reshape(shape)
            # Both sides are float32 products (q - z) * s: a whole number of steps up to float32 rounding.
            lsb = float(np.round(np.max(delta / scale, initial=0.0), 2))
    exact = float(np.mean(got == sim)) if sim.size else 1.0
    return TensorDiff(name, entry.quantizer if entry else "", int(sim.size), float(delta.max(initial=0.0)), lsb, exact)


def _with_outputs(model: onnx.ModelProto, names: Sequence[str]) -> onnx.ModelProto:
    model = onnx.ModelProto.FromString(model.SerializeToString())
    present = {v.name for v in model.graph.output}
    for name in names:
        if name not in present:
            model.graph.output.append(helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
            present.add(name)
    return model


def _feeds(result: Any, inputs: Sequence[Tensor]) -> dict[str, np.ndarray]:
    """Input arrays keyed by the deployment's input names, in the element types the model declares.

    Token ids stay integers; a float tensor takes the model's float type.
    """
    model = onnx.load(result.artifacts["deploy_onnx"], load_external_data=False)
    declared = {v.name: v.type.tensor_type.elem_type for v in model.graph.input}
    feeds = {}
    for name, tensor in zip(result.input_names, inputs, strict=True):
        array = tensor.detach().cpu().numpy() if isinstance(tensor, Tensor) else np.asarray(tensor)
        elem = declared.get(name)
        if elem:
            wanted = helper.tensor_dtype_to_np_dtype(elem)
            if array.dtype != wanted:
                if array.dtype.kind == "f" and wanted.kind in "iub":
                    raise ValueError(
                        f"input {name!r}: the deployment takes {wanted} (e.g. token ids), got a {array.dtype} tensor"
                    )
                array = array.astype(wanted)
        feeds[name] = array
    return feeds


@dataclass
class _Run:
    """The simulation model, the inputs and the free-running simulation (for the end-to-end outputs)."""

    model: nn.Module
    inputs: list[Tensor]
    free: Simulation
    host: bool  # also run each artifact as this host's runtime serves it
    tolerance: float
    served_on_cpu: bool  # the backend's Q/DQ model is served by onnxruntime (its host verdict counts)
    predict: bool | None  # the saturation prediction: always, never, or (None) where the host verdict parts
    predictions: dict[str, dict[str, float]] | None = None  # runtime -> layer -> fraction, on the Q/DQ model

    def wants_prediction(self, host: ArtifactReport) -> bool:
        return bool(self.predict or (self.predict is None and host.diverging(self.tolerance)))

    def predicted(self, result: Any, feeds: Mapping[str, np.ndarray], saturation: PairSaturation) -> dict[str, float]:
        """The layers of the Q/DQ model that ``saturation``'s kernels would change (one reference run for all)."""

        if self.predictions is None:
            self.predictions = {}
            model = onnx.load(result.artifacts["onnx"])
            if _may_saturate(result.table) or _activation_products(model):
                self.predictions, _ = saturated_layers(model, feeds, (ORT_MLAS_AVX2, ONEDNN_AVX2))
        return self.predictions.get(saturation.runtime, {})


_Report = TypeVar("_Report", bound=ArtifactReport)


def _same_values(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def _host_like(report: ArtifactReport, host: HostReport) -> HostReport:
    """The host's comparison where its values equal the artifact's, bit for bit (no second simulation)."""
    host.per_tensor, host.outputs, host.local_outputs = report.per_tensor, report.outputs, report.local_outputs
    return host


def _compare(
    report: _Report,
    values: Mapping[str, np.ndarray],
    table: QParamTable,
    exposed: Mapping[str, str],
    run: _Run,
    output_names: Sequence[str],
) -> _Report:
    keys = {tensor: (entry.quantizer, int(entry.extra.get("call", 0))) for tensor, entry in table.items()}
    forced = {keys[t]: values[exposed[t]] for t in table if t in exposed and exposed[t] in values}
    sim = simulate(run.model, run.inputs, forced)
    for tensor, entry in table.items():
        key = keys[tensor]
        name = exposed.get(tensor)
        if name is None or name not in values or key not in sim.quantized:
            continue
        report.per_tensor[tensor] = _diff(tensor, entry, sim.quantized[key], values[name])
    by_output = {out: entry for entry in table.values() for out in entry.extra.get("outputs", ())}
    for index, name in enumerate(output_names):
        if name in values and index < len(sim.outputs):
            report.local_outputs[name] = _diff(name, by_output.get(name), sim.outputs[index], values[name])
    for index, name in enumerate(output_names):
        if name in values and index < len(run.free.outputs):
            report.outputs[name] = _diff(name, by_output.get(name), run.free.outputs[index], values[name])
    return report


# -- the host verdict ------------------------------------------------------------------------------
_REDUCE_RANGE = (
    'prepare with prepare_custom_config_dict={"reduce_range": True} (7-bit weights in [-64, 63], and the same '
    "for the right operand of products of two activations, which cannot saturate; the simulation follows), "
    "or serve on a CPU with VNNI"
)
_UINT8_WEIGHTS = 'or deploy with qlinear_weight_type="uint8" (u8 x u8 kernels do not saturate; slower)'


def _may_saturate(table: QParamTable) -> bool:
    """Some weight has integers beyond 7 bits: only then can a pair of u8 x s8 products leave int16."""
    return any(
        entry.kind == "weight" and entry.grid == "linear" and max(-entry.quant_min, entry.quant_max) > 64
        for entry in table.values()
    )


def _activation_products(model: onnx.ModelProto) -> bool:
    """A MatMul of two values computed at run time (attention), which OpenVINO's int8 kernels may saturate."""
    constants = {init.name for init in model.graph.initializer}
    producers = {output: node for node in model.graph.node for output in node.output}

    def computed(name: str) -> bool:
        node = producers.get(name)
        if node is not None and node.op_type == "DequantizeLinear":
            return node.input[0] not in constants
        return name not in constants

    return any(node.op_type == "MatMul" and all(map(computed, node.input[:2])) for node in model.graph.node)


def _host_verdict(
    report: HostReport, predicted: dict[str, float], saturation: PairSaturation, remedy: str, tolerance: float
) -> HostReport:
    """Record the prediction of pair saturation and, where tensors part, the cause and the remedy."""
    facts = host_facts()
    report.predicted = dict(predicted)
    bad = report.diverging(tolerance)
    if not bad:
        return report
    if facts["int8_pairs_saturate"] and report.predicted:
        shown = ", ".join(list(report.predicted)[:5])
        report.cause = (
            f"{saturation.runtime}'s int8 kernels on this CPU (no VNNI: {' '.join(facts['isa'])}) sum each two "
            f"u8 x s8 products in a saturating 16-bit register; the saturation model predicts "
            f"{len(report.predicted)} layer(s): {shown}"
        )
        report.remedy = remedy
    else:
        report.cause = (
            f"{report.runtime} as served differs from the artifact's arithmetic at {', '.join(bad[:5])}; "
            "16-bit pair saturation does not explain it on this host"
        )
    return report


# -- runners --------------------------------------------------------------------------------------
def _run_ort(
    model: onnx.ModelProto, feeds: Mapping[str, np.ndarray], names: Sequence[str], optimize: bool
) -> dict[str, np.ndarray]:
    model = _with_outputs(model, names)
    session = ort_session(model, optimize=optimize)
    wanted = [v.name for v in model.graph.output]
    return dict(zip(wanted, session.run(wanted, dict(feeds)), strict=True))


def _verify_qdq(result: Any, feeds: Mapping[str, np.ndarray], run: _Run) -> ArtifactReport:
    model = onnx.load(result.artifacts["onnx"])
    names = list(result.dequantized.values()) + list(result.output_names)
    args = (result.table, result.dequantized, run, result.output_names)
    written = _run_ort(model, feeds, names, optimize=False)
    report = _compare(ArtifactReport("onnx", "onnxruntime (as written)"), written, *args)
    if run.host:
        values = _run_ort(model, feeds, names, optimize=True)
        host = HostReport("onnx", "onnxruntime (optimized)", served=run.served_on_cpu)
        host = _host_like(report, host) if _same_values(values, written) else _compare(host, values, *args)
        predicted = run.predicted(result, feeds, ORT_MLAS_AVX2) if run.wants_prediction(host) else {}
        report.host = _host_verdict(host, predicted, ORT_MLAS_AVX2, _REDUCE_RANGE, run.tolerance)
    return report


def _reader(backend: str, key: str) -> Callable[..., Any] | None:
    """A step's own reader (register_deploy_function(..., reader=...)), else the built-in one."""

    return deploy_functions.reader(backend, key) or READERS.get(key)


def _verify_parameter_file(key: str, result: Any, feeds: Mapping[str, np.ndarray], run: _Run) -> ArtifactReport:

    float_model = onnx.load(result.artifacts["deploy_onnx"])
    reader = _reader(result.backend, key)
    if reader is None:
        raise ValueError(f"no reader checks {key!r}")
    read = reader(result.artifacts[key], resolve_backend(result.backend), float_model)
    entries: dict[str, TensorQParams] = {}
    for tensor, entry in result.table.items():
        source = read.get(tensor)
        if source is None and entry.kind == "activation":
            raise ValueError(f"{key}: the file has no entry for quantized tensor {tensor!r}")
        if source is None:  # a format without weights (TensorRT's calibration cache): the deployment's
            entries[tensor] = entry
            continue
        # Values from the file; the placement (who reads the quantized value) from the deployment.
        entries[tensor] = source.with_changes(consumers=entry.consumers, quantizer=entry.quantizer, extra=entry.extra)
    table = QParamTable(entries)
    rebuilt, dequantized = insert_qdq(float_model, table)
    values = _run_ort(rebuilt, feeds, list(dequantized.values()) + list(result.output_names), optimize=False)
    report = ArtifactReport(key, "onnxruntime (rebuilt)")
    return _compare(report, values, table, dequantized, run, result.output_names)


def _dequantize_integers(
    raw: Mapping[str, np.ndarray], integer: Mapping[str, tuple[str, Any, Any]], result: Any
) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """The QLinear graph's integer tensors as real values (tensor -> name in the returned values)."""
    values = {name: raw[name] for name in result.output_names if name in raw}
    exposed = {}
    for tensor, (name, scale, zero_point) in integer.items():
        entry = result.table[tensor]
        q = np.asarray(raw[name]).astype(np.float64)
        s = np.asarray(scale, np.float64)
        z = np.asarray(zero_point, np.float64)
        if entry.axis is not None and q.ndim:
            shape = [1] * q.ndim
            shape[entry.axis % q.ndim] = -1
            s, z = s.reshape(shape), z.reshape(shape)
        values[f"{tensor}::dequantized"] = ((q - z) * s).astype(np.float32)
        exposed[tensor] = f"{tensor}::dequantized"
    return values, exposed


def _verify_qlinear(result: Any, feeds: Mapping[str, np.ndarray], run: _Run) -> ArtifactReport:

    model = onnx.load(result.artifacts["qlinear_onnx"])
    integer = exposed_tensors(model, result.table)  # tensor -> (integer tensor name, scale, zero point)
    names = list(dict.fromkeys([name for name, _, _ in integer.values()] + list(result.output_names)))
    # what the file means (exact int32 accumulation), recording where a CPU without VNNI would saturate
    record = (ORT_QLINEAR_AVX2,) if run.host and run.predict is not False and _may_saturate(result.table) else ()
    predictions, raw = saturated_layers(qlinear_as_qdq(model), feeds, record, names)
    values, exposed = _dequantize_integers(raw, integer, result)
    report = _compare(
        ArtifactReport("qlinear_onnx", "integer reference"), values, result.table, exposed, run, result.output_names
    )
    if run.host:
        extended = onnx.ModelProto.FromString(model.SerializeToString())
        present = {v.name for v in extended.graph.output}
        extended.graph.output.extend(helper.make_empty_tensor_value_info(n) for n in names if n not in present)
        session = ort_session(extended)
        wanted = [v.name for v in extended.graph.output]
        raw = dict(zip(wanted, session.run(wanted, dict(feeds)), strict=True))
        values, exposed = _dequantize_integers(raw, integer, result)
        host = HostReport("qlinear_onnx", "onnxruntime (integer ops)")
        host = _compare(host, values, result.table, exposed, run, result.output_names)
        remedy = f"{_REDUCE_RANGE}, {_UINT8_WEIGHTS}"
        predicted = predictions.get(ORT_QLINEAR_AVX2.runtime, {})
        report.host = _host_verdict(host, predicted, ORT_QLINEAR_AVX2, remedy, run.tolerance)
    return report


def _verify_openvino(result: Any, feeds: Mapping[str, np.ndarray], run: _Run) -> ArtifactReport:

    path = result.artifacts["openvino_onnx"]
    model = onnx.load(path)
    exposed = fake_quantize_outputs(model, result.table)  # tensor -> FakeQuantize output name
    names = list(result.output_names) + list(exposed.values())
    args = (result.table, exposed, run, result.output_names)
    values = _run_ort(fake_quantize_as_onnx(model), feeds, names, optimize=False)
    report = _compare(ArtifactReport("openvino_onnx", "FakeQuantize formula"), values, *args)
    if run.host:
        values = run_openvino(path, dict(feeds), names)
        host = _compare(HostReport("openvino_onnx", "OpenVINO CPU"), values, *args)
        predicted = run.predicted(result, feeds, ONEDNN_AVX2) if run.wants_prediction(host) else {}
        report.host = _host_verdict(host, predicted, ONEDNN_AVX2, _REDUCE_RANGE, run.tolerance)
    return report


def _verify_reference(result: Any, feeds: Mapping[str, np.ndarray], run: _Run) -> ArtifactReport:

    model = onnx.load(result.artifacts["onnx"])
    names = list(dict.fromkeys([*result.dequantized.values(), *result.output_names]))
    values = run_reference(model, dict(feeds), names)
    report = ArtifactReport("reference", "integer reference")
    return _compare(report, values, result.table, result.dequantized, run, result.output_names)


_RUNNERS: dict[str, Callable[[Any, Mapping[str, np.ndarray], _Run], ArtifactReport]] = {
    "onnx": _verify_qdq,
    "qlinear_onnx": _verify_qlinear,
    "openvino_onnx": _verify_openvino,
}


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
    inputs: Tensor | Sequence[Tensor] | Mapping[str, Tensor],
    artifacts: Sequence[str] | None = None,
    reference: bool = False,
    host: bool = True,
    predict: bool | None = None,
) -> VerifyReport:
    """Compare every runnable artifact of ``result`` (a DeployResult) with ``qmodel``'s simulation on ``inputs``.

    ``artifacts`` limits the keys checked (default: every artifact with a runtime or a reader);
    ``reference=True`` also runs the integer reference executor on the Q/DQ model; ``host=False``
    skips the host verdicts (each artifact's arithmetic alone). ``predict`` runs the saturation
    model (which layers a CPU without VNNI would compute differently): True always, False never,
    None (default) where a host verdict parts from the simulation, to explain it (the QLinear
    graph's prediction comes with its arithmetic and is always given). Inputs keep their dtype
    (token ids stay int64); float inputs take the deployment's float type.
    """

    if isinstance(inputs, Tensor):
        args: list[Tensor] = [inputs]
    elif isinstance(inputs, Mapping):
        args = [inputs[name] for name in result.input_names]
    else:
        args = list(inputs)
    if len(args) != len(result.input_names):
        raise ValueError(f"the deployment has inputs {result.input_names}; got {len(args)} input tensor(s)")
    feeds = _feeds(result, args)
    _check_shapes(result, feeds)
    model = _simulation_copy(qmodel)
    spec = resolve_backend(result.backend)
    run = _Run(model, args, simulate(model, args), host, spec.lsb_tolerance, spec.served_on_cpu, predict)
    readable = [k for k in result.artifacts if k in _RUNNERS or _reader(result.backend, k) is not None]
    keys = readable if artifacts is None else list(artifacts)
    reports: dict[str, ArtifactReport] = {}
    for key in keys:
        if key not in result.artifacts:
            raise ValueError(f"the deployment has no {key!r} artifact; it has {sorted(result.artifacts)}")
        if key in _RUNNERS:
            reports[key] = _RUNNERS[key](result, feeds, run)
        elif _reader(result.backend, key) is not None:
            reports[key] = _verify_parameter_file(key, result, feeds, run)
        else:
            raise ValueError(f"no runtime or reader checks {key!r}")
    if reference:
        reports["reference"] = _verify_reference(result, feeds, run)
    return VerifyReport(result.backend, reports, host_facts(), spec.lsb_tolerance)
