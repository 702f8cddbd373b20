"""Checking a ``qlinear_onnx`` artifact: its arithmetic by the integer reference, then onnxruntime on this host."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import onnx
from onnx import helper

from mqbench.deploy.comparison import (
    REDUCE_RANGE_REMEDY,
    UINT8_WEIGHTS_REMEDY,
    ArtifactReport,
    HostReport,
    VerifyRun,
    compare,
    host_verdict,
    may_saturate,
    run_as_loaded,
)
from mqbench.deploy.onnx_graph import ort_session
from mqbench.deploy.qlinear.build import exposed_tensors
from mqbench.deploy.qlinear_qdq import qlinear_as_qdq
from mqbench.deploy.reference import saturated_layers
from mqbench.nn.quantized.saturation import ORT_QLINEAR_AVX2

__all__ = ["serve", "verify"]


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


def verify(result: Any, feeds: Mapping[str, np.ndarray], run: VerifyRun) -> ArtifactReport:
    """The integer graph: its arithmetic by the integer reference, then onnxruntime's integer ops on this host."""
    model = onnx.load(result.artifacts["qlinear_onnx"])
    integer = exposed_tensors(model, result.table)  # tensor -> (integer tensor name, scale, zero point)
    names = list(dict.fromkeys([name for name, _, _ in integer.values()] + list(result.output_names)))
    # what the file means (exact int32 accumulation), recording where a CPU without VNNI would saturate
    record = (ORT_QLINEAR_AVX2,) if run.host and run.predict is not False and may_saturate(result.table) else ()
    predictions, raw = saturated_layers(qlinear_as_qdq(model), feeds, record, names)
    values, exposed = _dequantize_integers(raw, integer, result)
    report = compare(
        ArtifactReport("qlinear_onnx", "integer reference"), values, result.table, exposed, run, result.output_names
    )
    if run.host:
        extended = onnx.ModelProto.FromString(model.SerializeToString())
        present = {v.name for v in extended.graph.output}
        extended.graph.output.extend(helper.make_empty_tensor_value_info(n) for n in names if n not in present)
        session = ort_session(extended)
        wanted = [v.name for v in extended.graph.output]
        raw = dict(zip(wanted, session.run(wanted, dict(feeds)), strict=True))
        # the outputs as a user's session serves the file: exposing tensors can stop a fusion that changes them
        raw.update(run_as_loaded(result.artifacts["qlinear_onnx"], feeds, optimize=True))
        values, exposed = _dequantize_integers(raw, integer, result)
        host = HostReport("qlinear_onnx", "onnxruntime (integer ops)")
        host = compare(host, values, result.table, exposed, run, result.output_names)
        remedy = f"{REDUCE_RANGE_REMEDY}, {UINT8_WEIGHTS_REMEDY}"
        predicted = predictions.get(ORT_QLINEAR_AVX2.runtime, {})
        report.host = host_verdict(host, predicted, ORT_QLINEAR_AVX2, remedy, run.tolerance)
    return report


def serve(result: Any) -> Callable[[Mapping[str, np.ndarray]], list[np.ndarray]]:
    """The integer graph on onnxruntime's integer kernels (graph optimizations on)."""
    session = ort_session(onnx.load(result.artifacts["qlinear_onnx"]))
    return lambda feeds: list(session.run(None, dict(feeds)))
