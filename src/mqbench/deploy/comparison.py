"""What verification compares: the simulation's quantized tensors against a runtime's, as reports.

The pieces every artifact's runner uses (:data:`~mqbench.deploy.writers.FORMATS`): run the
simulation with each quantizer's output replaced by the runtime's value for that tensor (so a
difference is that layer's own), measure each tensor in LSBs of its quantizer, and, for this
host's runtime, record the 16-bit pair-saturation prediction with its cause and remedy.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import numpy as np
import onnx
import torch
from onnx import helper
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from mqbench.deploy.onnx_graph import ort_session
from mqbench.deploy.reference import saturated_layers
from mqbench.fake_quantize.quantize_base import QuantizeBase
from mqbench.grids import grid_of
from mqbench.nn.quantized.saturation import ONEDNN_AVX2, ORT_MLAS_AVX2, PairSaturation
from mqbench.qparams import QParamTable, TensorQParams
from mqbench.utils.host import host_facts

__all__ = [
    "FLOAT_ATOL",
    "FLOAT_RTOL",
    "REDUCE_RANGE_REMEDY",
    "UINT8_WEIGHTS_REMEDY",
    "ArtifactReport",
    "HostReport",
    "Simulation",
    "TensorDiff",
    "VerifyRun",
    "compare",
    "explain_ties",
    "feeds_for",
    "host_like",
    "host_verdict",
    "may_saturate",
    "run_as_loaded",
    "run_ort",
    "same_values",
    "simulate",
    "simulation_copy",
    "tensor_diff",
]


FLOAT_RTOL = 1e-3  # a float network output's tolerance, relative to its largest |value|
FLOAT_ATOL = 1e-3  # ... and the smallest range it is measured against (an all-zero output)
# A value this close to a rounding tie, in steps of its grid, may round the other way in another runtime's arithmetic
# (its own summation order, its own tanh or exp): a tanh value 1.5e-5 steps from a tie rounded the other way in
# OpenVINO's CPU plugin; 0.01 steps is about 650x that, and holds 2% of uniformly spread values.
TIE_STEPS = 0.01
MAX_TIE_FLIPS = 32  # near ties explained, one simulation each: the closest ones where there are more


@dataclass(frozen=True)
class TensorDiff:
    """How one tensor of a runtime compares with the simulation."""

    name: str
    quantizer: str
    numel: int
    max_abs_diff: float
    max_lsb_diff: float | None  # None: a float tensor with no quantizer to measure LSBs by
    exact_fraction: float
    magnitude: float = 0.0  # the largest |value| of the simulation's tensor
    # a float tensor: the largest difference beyond what near-tie roundings of the quantized tensors it is computed
    # from, which the runtime does not expose, can explain (None: not measured; see explain_ties)
    unexplained: float | None = None
    # a quantized tensor beyond the tolerance: the LSBs beyond what near-tie roundings of the tensors it is computed
    # from can explain (None: not measured; see explain_ties)
    unexplained_lsb: float | None = None
    # NaN or inf values: (in the runtime's tensor, in the simulation's); the differences above are of the finite rest
    nonfinite: tuple[int, int] = (0, 0)
    # a constant (a weight): no arithmetic order or rounding tie can put runtime and simulation on different levels, so
    # half an LSB is wrong (less is the simulation's own float arithmetic, e.g. a folded BatchNorm's division)
    constant: bool = False

    def float_mismatch(self) -> bool:
        """For a float tensor (no quantizer): off by more than float32 arithmetic explains.

        Runtime and simulation compute it from the same quantized values (the runtime's, forced into
        the simulation), in float32 with their own summation orders: that parts them by a few units in
        the 7th significant digit of the largest partial sums, far below ``FLOAT_RTOL`` of the tensor's
        range. A wrong deployment (an output clipped, a sign lost) is off by a visible part of it.
        """
        off = self.max_abs_diff if self.unexplained is None else self.unexplained
        return self.max_lsb_diff is None and off > FLOAT_RTOL * max(self.magnitude, FLOAT_ATOL)

    def beyond(self, tolerance: float) -> bool:
        """A quantized tensor off by more than ``tolerance`` LSBs, past what near ties explain where measured."""
        off = self.max_lsb_diff if self.unexplained_lsb is None else self.unexplained_lsb
        return off is not None and off > tolerance

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
    missing: list[str] = field(default_factory=list)  # network outputs the runtime did not give
    changed: list[str] = field(default_factory=list)  # a parameter file's tensors whose quantization is not simulated

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
        """Quantized tensors (graph order) that differ from the simulation by more than ``tolerance`` LSBs,
        then network outputs that differ from it when computed from the runtime's own quantized tensors
        (a quantized output by more than ``tolerance`` LSBs, a float one beyond float32 rounding). First, any
        tensor or output holding NaN or inf in the runtime's result or the simulation's (also end to end)."""
        tensors = [
            name
            for name, d in self.per_tensor.items()
            if d.max_lsb_diff is not None and (d.max_lsb_diff >= 0.5 if d.constant else d.beyond(tolerance))
        ]
        outputs = [
            f"output {name!r} (off by {d.max_abs_diff:.3g} on values up to {d.magnitude:.3g})"
            for name, d in self.local_outputs.items()
            if d.float_mismatch() or (d.max_lsb_diff is not None and d.max_lsb_diff > tolerance)
        ]
        missing = [f"output {name!r} (missing)" for name in self.missing]
        nonfinite = [
            f"{kind} {name!r} ({d.nonfinite[0]} non-finite value(s) in the runtime's result, {d.nonfinite[1]} in the "
            "simulation's: NaN or inf is never a verified result)"
            for kind, values in (("tensor", self.per_tensor), ("output", {**self.local_outputs, **self.outputs}))
            for name, d in values.items()
            if any(d.nonfinite)
        ]
        changed = [f"quantization of {tensor}" for tensor in self.changed]
        finite = [name for name in tensors if not any(self.per_tensor[name].nonfinite)]
        return [*nonfinite, *finite, *outputs, *missing, *changed]


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


# -- the simulation -------------------------------------------------------------------------------
@dataclass
class Simulation:
    outputs: list[np.ndarray]
    quantized: dict[tuple[str, int], np.ndarray]  # (quantizer name, call index) -> output
    received: dict[tuple[str, int], np.ndarray] = field(default_factory=dict)  # -> input, where asked for


Forced = Mapping[tuple[str, int], np.ndarray]


def simulation_copy(qmodel: nn.Module) -> nn.Module:
    model = copy.deepcopy(qmodel).eval()
    for module in model.modules():
        if isinstance(module, QuantizeBase):
            module.disable_observer()
    return model


def simulate(
    model: nn.Module,
    inputs: Sequence[Any],
    forced: Forced | None = None,
    unrounded: Mapping[tuple[str, int], tuple[float, float]] | None = None,
    receive: Collection[tuple[str, int]] = (),
) -> Simulation:
    """Run the simulation (eval mode, observers off) recording every enabled quantizer's output.

    With ``forced``, each quantizer's output is recorded and then replaced by the runtime's value
    for that tensor, so the next layers start from what the runtime computed: each tensor's
    difference is then that layer's own, not an accumulation of earlier ones. ``unrounded`` names
    quantizer calls that clamp their input to ``(low, high)`` without rounding it (what a runtime that
    drops a quantizer's rounding computes). The inputs of the quantizer calls in ``receive`` are recorded too.
    """
    records: dict[tuple[str, int], np.ndarray] = {}
    received: dict[tuple[str, int], np.ndarray] = {}
    calls: dict[str, int] = defaultdict(int)
    handles = []
    for name, module in model.named_modules():
        if isinstance(module, QuantizeBase):

            def hook(mod: nn.Module, args: Any, output: Tensor, name: str = name) -> Tensor | None:
                key = (name, calls[name])
                calls[name] += 1
                if key in receive:
                    received[key] = args[0].detach().float().numpy().copy()
                if unrounded is not None and key in unrounded:
                    output = args[0].detach().float().clamp(*unrounded[key]).to(output.dtype)
                records[key] = output.detach().float().numpy().copy()
                if forced is not None and key in forced and forced[key].size == output.numel():
                    # A copy (an in-place op after the quantizer must not write into the runtime's values), laid out
                    # in memory as the simulation's own tensor (a ``view`` after it may need that layout).
                    value = torch.from_numpy(np.array(forced[key], order="C")).reshape(output.shape)  # (writable)
                    return torch.empty_like(output).copy_(value)
                return output if unrounded is not None and key in unrounded else None

            handles.append(module.register_forward_hook(hook))
    try:
        with torch.no_grad():  # on copies: a model that writes into its inputs must not change the caller's
            copies = pytree.tree_map_only(Tensor, torch.clone, tuple(inputs))
            flat, _ = pytree.tree_flatten(model(*copies))
    finally:
        for handle in handles:
            handle.remove()
    return Simulation([t.detach().float().numpy() for t in flat if isinstance(t, Tensor)], records, received)


# -- comparisons ----------------------------------------------------------------------------------
def tensor_diff(name: str, entry: TensorQParams | None, sim: np.ndarray, got: np.ndarray) -> TensorDiff:
    got = np.asarray(got, dtype=np.float32)
    if got.shape != sim.shape:
        if got.size != sim.size:
            raise ValueError(f"tensor {name!r}: runtime shape {list(got.shape)} vs simulation {list(sim.shape)}")
        got = got.reshape(sim.shape)
    finite = np.isfinite(got) & np.isfinite(sim)
    nonfinite = (int(got.size - np.isfinite(got).sum()), int(sim.size - np.isfinite(sim).sum()))
    delta = np.abs(got.astype(np.float64) - sim.astype(np.float64), where=finite, out=np.zeros(sim.shape))
    lsb = None
    if entry is not None:
        grid = grid_of(entry.grid)
        # Both sides are values of the grid: a whole number of steps apart, up to float32 rounding.
        steps = np.abs(grid.steps(entry, got) - grid.steps(entry, sim))
        lsb = float(np.round(np.max(steps, where=finite, initial=0.0), 2))
    exact = float(np.mean(got == sim)) if sim.size else 1.0
    magnitude = float(np.abs(sim).max(where=np.isfinite(sim), initial=0.0))
    return TensorDiff(
        name,
        entry.quantizer if entry else "",
        int(sim.size),
        float(delta.max(initial=0.0)),
        lsb,
        exact,
        magnitude,
        nonfinite=nonfinite,
        constant=entry is not None and entry.kind == "weight",
    )


def feeds_for(result: Any, inputs: Sequence[Tensor]) -> dict[str, np.ndarray]:
    """Input arrays keyed by the deployment's input names, in the element types the model declares.

    Token ids stay integers; a float tensor takes the model's float type.
    """
    model = onnx.load(result.artifacts["deploy_onnx"], load_external_data=False)
    declared = {v.name: v.type.tensor_type.elem_type for v in model.graph.input}
    feeds = {}
    for name, tensor in zip(result.input_names, inputs, strict=True):
        if isinstance(tensor, Tensor):
            # numpy has no bfloat16: the values go in as float32 (the deployment's float type below)
            array = (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).detach().cpu().numpy()
        else:
            array = np.asarray(tensor)
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
class VerifyRun:
    """The simulation model, the inputs and the free-running simulation (for the end-to-end outputs)."""

    model: nn.Module
    inputs: list[Any]  # the model's positional arguments (tensors, or dicts / tuples / lists of them)
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
            if may_saturate(result.table) or _activation_products(model):
                self.predictions, _ = saturated_layers(model, feeds, (ORT_MLAS_AVX2, ONEDNN_AVX2))
        return self.predictions.get(saturation.runtime, {})


_Report = TypeVar("_Report", bound=ArtifactReport)


def same_values(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def host_like(report: ArtifactReport, host: HostReport) -> HostReport:
    """The host's comparison where its values equal the artifact's, bit for bit (no second simulation)."""
    host.per_tensor, host.outputs, host.local_outputs = report.per_tensor, report.outputs, report.local_outputs
    return host


def _runtime_values(
    values: Mapping[str, np.ndarray], table: QParamTable, exposed: Mapping[str, str]
) -> tuple[dict[str, tuple[str, int]], dict[tuple[str, int], np.ndarray]]:
    """Tensor -> its quantizer call, and each call -> the runtime's value of its tensor (where exposed)."""
    keys = {tensor: (entry.quantizer, int(entry.extra.get("call", 0))) for tensor, entry in table.items()}
    return keys, {keys[t]: values[exposed[t]] for t in table if t in exposed and exposed[t] in values}


def compare(
    report: _Report,
    values: Mapping[str, np.ndarray],
    table: QParamTable,
    exposed: Mapping[str, str],
    run: VerifyRun,
    output_names: Sequence[str],
) -> _Report:
    keys, forced = _runtime_values(values, table, exposed)
    sim = simulate(run.model, run.inputs, forced)
    for tensor, entry in table.items():
        key = keys[tensor]
        name = exposed.get(tensor)
        if name is None or name not in values or key not in sim.quantized:
            continue
        report.per_tensor[tensor] = tensor_diff(tensor, entry, sim.quantized[key], values[name])
    by_output = {out: entry for entry in table.values() for out in entry.extra.get("outputs", ())}
    report.missing = [name for name in output_names if name not in values]
    if len(output_names) != len(run.free.outputs):
        report.missing.append(f"{len(run.free.outputs)} outputs simulated, {len(output_names)} deployed")
    for index, name in enumerate(output_names):
        if name in values and index < len(sim.outputs):
            report.local_outputs[name] = tensor_diff(name, by_output.get(name), sim.outputs[index], values[name])
    for index, name in enumerate(output_names):
        if name in values and index < len(run.free.outputs):
            report.outputs[name] = tensor_diff(name, by_output.get(name), run.free.outputs[index], values[name])
    return report


def _flips(entry: TensorQParams, received: np.ndarray, value: np.ndarray) -> list[tuple[float, int, float]]:
    """(distance to the tie in steps, flat index, the other rounding's value) of each element of ``value`` that lies
    near a rounding tie (on a per-tensor or a per-channel linear grid)."""
    if entry.grid != "linear" or received.size != value.size:
        return []
    scale = np.asarray(entry.scale, np.float64).reshape(-1)
    zero_point = np.asarray(entry.zero_point, np.float64).reshape(-1)
    if entry.axis is not None:  # one scale per channel along the axis: broadcast over the received tensor
        axis = entry.axis % max(received.ndim, 1)
        if received.ndim <= axis or received.shape[axis] != scale.size or zero_point.size != scale.size:
            return []
        view = [1] * received.ndim
        view[axis] = -1
        scale = np.broadcast_to(scale.reshape(view), received.shape).reshape(-1)
        zero_point = np.broadcast_to(zero_point.reshape(view), received.shape).reshape(-1)
    else:
        scale, zero_point = scale[:1], zero_point[:1]
    steps = received.reshape(-1).astype(np.float64) / scale + zero_point
    low = np.floor(steps)
    near = np.abs(steps - low - 0.5) < TIE_STEPS
    level = np.round(value.reshape(-1).astype(np.float64) / scale) + zero_point
    other = np.where(level == low, low + 1, np.where(level == low + 1, low, np.nan))
    ok = near & np.isfinite(other) & (other >= entry.quant_min) & (other <= entry.quant_max)
    distance = np.abs(steps - low - 0.5)
    shifted = (other - zero_point) * scale
    return [(float(distance[i]), int(i), float(shifted[i])) for i in np.flatnonzero(ok)]


def tail_quantized(
    model: onnx.ModelProto, outputs: Sequence[str], exposed: Mapping[str, str], table: QParamTable
) -> list[str]:
    """The quantized activations (``exposed``: tensor -> its quantized value's name in ``model``) that the network
    ``outputs`` are computed from with none of them between. Weights are constants, checked by the file's formula:
    a runtime that shows one may show it folded with what follows (and compute the layer so)."""
    quantized = [name for tensor, name in exposed.items() if table[tensor].kind != "weight"]
    producers = {name: node for node in model.graph.node for name in node.output}
    stops = set(quantized)
    found: dict[str, None] = {}
    seen: set[str] = set()
    stack = list(outputs)
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        if name in stops:
            found[name] = None
        elif name in producers:
            stack.extend(producers[name].input)
    return list(found)


def served_outputs(
    report: _Report,
    served: Mapping[str, np.ndarray],
    tail: Mapping[str, np.ndarray],
    table: QParamTable,
    exposed: Mapping[str, str],
    run: VerifyRun,
    output_names: Sequence[str],
) -> _Report:
    """``report`` comparing the network outputs of a file as a runtime serves it (``served``: nothing exposed) with
    the simulation fed the quantized tensors they are computed from (``tail``: from a copy that exposes only those,
    so that the runtime fuses the rest as in the file); a near tie that the file rounds the other way is explained
    as in :func:`explain_ties`."""
    values = {**tail, **served}
    shown = {tensor: name for tensor, name in exposed.items() if name in values}
    compare(report, values, table, shown, run, output_names)
    if report.diverging(run.tolerance):
        explain_ties(report, values, table, shown, run, output_names)
    return report


def explain_ties(
    report: _Report,
    values: Mapping[str, np.ndarray],
    table: QParamTable,
    exposed: Mapping[str, str],
    run: VerifyRun,
    output_names: Sequence[str],
) -> _Report:
    """Measure, for each float output of ``report.local_outputs`` and each quantized tensor that differs by more
    than ``run.tolerance`` LSBs, the difference that near-tie roundings of the quantized tensors it is computed from
    cannot explain (``TensorDiff.unexplained``, in the output's units; ``TensorDiff.unexplained_lsb``).

    Where a runtime computes a file whose intermediate tensors it does not show (exposing one changes what it
    fuses), the outputs are compared with the simulation fed the quantized tensors of a copy that shows them. A
    value within ``TIE_STEPS`` of a rounding tie may round the other way in the file itself (in a shown tensor, or
    in an activation no copy shows, which the simulation computes); each such element, the ``MAX_TIE_FLIPS``
    closest to their ties where there are more, is flipped in one more simulation, and a tensor may differ by the
    sum of the flips that move it up, or of those that move it down, beyond float32 rounding. Or, by one more
    simulation that flips every near tie of the activations no copy shows at once, a tensor computed element by
    element from one of them (an Add of a fused layer's output, which onnxruntime serves as one kernel) may take
    that value instead, each element the closer of the two; a quantized tensor's own rounding may add
    ``run.tolerance`` LSBs (an input's step carried through is more than one of the output's where the output's
    grid is the finer).
    """
    keys, forced = _runtime_values(values, table, exposed)
    activations = {tensor: key for tensor, key in keys.items() if key in forced or table[tensor].kind != "weight"}
    base = simulate(run.model, run.inputs, forced, receive=set(activations.values()))
    flips, unshown = [], dict(forced)
    for tensor, key in activations.items():
        # a tensor the runtime does not show is the simulation's own, and may round either way in the file
        held = forced[key] if key in forced else base.quantized.get(key)
        if held is None or key not in base.received:
            continue
        found = _flips(table[tensor], base.received[key], held)
        flips += [(distance, key, index, value, held) for distance, index, value in found]
        if found and key not in forced:
            unshown[key] = np.array(held, copy=True)
            unshown[key].reshape(-1)[[index for _, index, _ in found]] = [value for _, _, value in found]
    targets = _tie_targets(report, values, table, exposed, keys, base, output_names, run.tolerance)
    if not targets or (not flips and len(unshown) == len(forced)):
        return report
    flips = sorted(flips, key=lambda flip: flip[0])[:MAX_TIE_FLIPS]  # the closest ties: the likeliest to part
    up = {target: np.zeros_like(measured[0]) for target, measured in targets.items()}
    down = {target: np.zeros_like(measured[0]) for target, measured in targets.items()}
    for _, key, index, value, held in flips:
        changed = dict(forced)
        changed[key] = np.array(held, copy=True)
        changed[key].reshape(-1)[index] = value
        for target, moved in _tie_values(simulate(run.model, run.inputs, changed), targets).items():
            delta = moved - targets[target][0]
            up[target] += np.maximum(delta, 0.0)
            down[target] += np.maximum(-delta, 0.0)
    together = _tie_values(simulate(run.model, run.inputs, unshown), targets) if len(unshown) > len(forced) else {}
    for target, (held, got, entry, _) in targets.items():
        # either some of the closest flips, or every hidden tensor's near ties at once: the closer, element by element
        one = np.maximum(got - held - up[target], 0.0) + np.maximum(held - got - down[target], 0.0)
        other = together.get(target, held)
        every = np.maximum(got - np.maximum(held, other), 0.0) + np.maximum(np.minimum(held, other) - got, 0.0)
        beyond = float(np.minimum(one, every).max(initial=0.0))
        name = target[1]
        if entry is None:
            report.local_outputs[name] = replace(report.local_outputs[name], unexplained=beyond)
        else:
            lsb = round(beyond / float(np.asarray(entry.scale).reshape(-1)[0]), 2)
            report.per_tensor[name] = replace(report.per_tensor[name], unexplained_lsb=lsb)
    return report


_Target = tuple[str, str]  # ("output", its name) or ("tensor", a quantized tensor)
# (the simulation's value, the runtime's, the quantizer (None: a float output), where a simulation holds it)
_Measured = tuple[np.ndarray, np.ndarray, "TensorQParams | None", "int | tuple[str, int]"]


def _tie_targets(
    report: _Report,
    values: Mapping[str, np.ndarray],
    table: QParamTable,
    exposed: Mapping[str, str],
    keys: Mapping[str, tuple[str, int]],
    base: Simulation,
    output_names: Sequence[str],
    tolerance: float,
) -> dict[_Target, _Measured]:
    """What :func:`explain_ties` measures: each float output, and each quantized activation on one linear grid
    that differs by more than ``tolerance`` LSBs."""
    targets: dict[_Target, _Measured] = {}
    for index, name in enumerate(output_names):
        diff = report.local_outputs.get(name)
        if diff is None or diff.max_lsb_diff is not None or index >= len(base.outputs) or name not in values:
            continue
        held = base.outputs[index].astype(np.float64)
        targets["output", name] = (held, np.asarray(values[name], np.float64).reshape(held.shape), None, index)
    for tensor, diff in report.per_tensor.items():
        entry = table[tensor]
        if diff.constant or diff.max_lsb_diff is None or diff.max_lsb_diff <= tolerance:
            continue
        own = base.quantized.get(keys[tensor])
        if own is None or entry.axis is not None or entry.grid != "linear" or exposed.get(tensor) not in values:
            continue
        got = np.asarray(values[exposed[tensor]], np.float64).reshape(own.shape)
        targets["tensor", tensor] = (own.astype(np.float64), got, entry, keys[tensor])
    return targets


def _tie_values(sim: Simulation, targets: Mapping[_Target, _Measured]) -> dict[_Target, np.ndarray]:
    """Each target's value in ``sim``: an output, or a quantized tensor as its quantizer computed it (before the
    runtime's value replaced it)."""
    found = {}
    for target, (held, _, _, where) in targets.items():
        value = sim.outputs[where] if isinstance(where, int) else sim.quantized.get(where)
        if value is not None:
            found[target] = value.astype(np.float64).reshape(held.shape)
    return found


# -- the host verdict ------------------------------------------------------------------------------
REDUCE_RANGE_REMEDY = (
    'prepare with prepare_custom_config_dict={"reduce_range": True} (7-bit weights in [-64, 63], and the same '
    "for the right operand of products of two activations, which cannot saturate; the simulation follows), "
    "or serve on a CPU with VNNI"
)
UINT8_WEIGHTS_REMEDY = 'or deploy with qlinear_weight_type="uint8" (u8 x u8 kernels do not saturate; slower)'


def may_saturate(table: QParamTable) -> bool:
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


def host_verdict(
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
def run_ort(
    model: onnx.ModelProto,
    feeds: Mapping[str, np.ndarray],
    names: Sequence[str],
    optimize: bool,
    typed: bool = True,
) -> dict[str, np.ndarray]:
    """``model``'s outputs and the tensors ``names`` on onnxruntime (float32 ones; ``typed=False``: of any type)."""
    # The extra outputs are added to the caller's model for as long as the session is built (no copy).
    outputs = model.graph.output
    kept = len(outputs)
    present = {v.name for v in outputs}
    for name in dict.fromkeys(names):
        if name not in present:
            outputs.append(
                helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None)
                if typed
                else helper.make_empty_tensor_value_info(name)
            )
    try:
        wanted = [v.name for v in outputs]
        session = ort_session(model, optimize=optimize)
    finally:
        del outputs[kept:]
    return dict(zip(wanted, session.run(wanted, dict(feeds)), strict=True))


def run_as_loaded(path: str, feeds: Mapping[str, np.ndarray], optimize: bool) -> dict[str, np.ndarray]:
    """The network outputs of the file at ``path`` as a user's onnxruntime session computes them: the file
    as written, no tensor exposed (exposing intermediate tensors can change what the runtime fuses)."""
    session = ort_session(path, optimize=optimize)
    names = [output.name for output in session.get_outputs()]
    return dict(zip(names, session.run(names, dict(feeds)), strict=True))
