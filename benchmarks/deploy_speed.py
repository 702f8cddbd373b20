"""Deployed int8 latency on onnxruntime, from graphs that verify on this host; convert_deploy's own time.

ResNet-18 and MobileNetV2 at 224 px (or the user's model: ``--model`` / ``--onnx``), batch 1 and
8, onnxruntime on the CPU with 2 intra-op threads and spinning off. In one run, interleaved: the
float ONNX model; mqbench's QDQ deployment as its standard QuantizeLinear/DequantizeLinear model
and as the QLinear integer graph (``deploy_to_qlinear=True``); mqbench's ONNX_QNN deployment (its
QLinear graph); and onnxruntime's own ``quantize_static`` (QDQ format, per-channel int8 weights,
uint8 activations, MinMax calibration on the same images).

A speedup is reported only for a graph that verifies on this host, on a few evaluation images:

* each mqbench graph against the simulation as onnxruntime serves it here (``verify_deploy``'s
  host verdict of the timed artifact, within the backend's tolerance);
* ``quantize_static``'s model, which has no simulation, against its own arithmetic (the same model
  with graph optimizations off), within 1 step of its output quantization (see check_ort_static).

A graph that does not verify keeps its latency, marked, and gets no speedup. Where this CPU's int8
kernels sum u8 x s8 pairs in saturating 16-bit registers (no VNNI: ``host_facts()``), a deployment
(or quantize_static) with a graph that does not verify is also timed with 7-bit weights (mqbench's
``reduce_range``, ``quantize_static(reduce_range=True)``), which cannot saturate. With ``--data``
(an ``.npz`` with ``x`` and optional ``labels``), calibration uses its first images and, given
labels, each graph's top-1 accuracy on the rest is reported. Also: convert_deploy's wall time for
ResNet-50 (224 px). ``--quick``: ResNet-18 at 64 px, 1 verification image, 3 repeats.

Run: ``.venv/bin/python benchmarks/deploy_speed.py [--quick] [--model package.module:factory
--input-shape 1,3,224,224 | --onnx model.onnx] [--data file.npz] [--output file.json]``; prints
``describe_host()`` and the table, and writes the JSON (``host``: ``host_facts()``; a row per graph
with its check, a row per graph and batch) to benchmarks/results/deploy_speed.json by default.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.util
import json
import logging
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime
import torch
from google.protobuf.message import DecodeError
from onnx import helper, numpy_helper
from onnxruntime.capi.onnxruntime_pybind11_state import Fail, InvalidArgument, InvalidGraph, RuntimeException
from torch import Tensor, nn

from _timing import print_table, time_interleaved, write_json
from mqbench.app.check import reduce_range_config
from mqbench.backends import resolve_backend
from mqbench.convert_deploy import DeployResult, convert_deploy
from mqbench.deploy.onnx_graph import initializer_map, ort_session, producers_of, save_model
from mqbench.deploy.reference import saturated_layers
from mqbench.deploy.verify import VerifyReport, verify_deploy
from mqbench.models import mobilenet_v2, resnet18, resnet50
from mqbench.nn.quantized.saturation import ORT_MLAS_AVX2
from mqbench.prepare_by_platform import prepare_by_platform
from mqbench.utils.host import describe_host, host_facts
from mqbench.utils.memory import keep_freed_memory
from mqbench.utils.state import enable_calibration, enable_quantization

MODELS = {"resnet18": resnet18, "mobilenet_v2": mobilenet_v2}
THREADS = 2
BATCHES = (1, 8)
ORT_STATIC = "ort quantize_static"
ORT_ERRORS = (Fail, InvalidArgument, InvalidGraph, RuntimeException)  # onnxruntime: a model it cannot run


@dataclass(frozen=True)
class Deployment:
    """One mqbench deployment and its timed graphs: artifact key -> row label."""

    label: str
    backend: str
    graphs: dict[str, str]


DEPLOYMENTS = (
    Deployment("mqbench QDQ", "qdq", {"onnx": "Q/DQ", "qlinear_onnx": "QLinear"}),
    Deployment("mqbench ONNX_QNN", "onnx_qnn", {"qlinear_onnx": ""}),
)


class InputError(ValueError):
    """The command line names something that cannot be used (reported as an argparse error)."""


# -- inputs ---------------------------------------------------------------------------------------
def sample_inputs(shape: Sequence[int], count: int) -> Tensor:
    """Natural-image statistics without downloads: crops of scikit-learn's two sample photos.

    For an image-like shape ``[N, 1 or 3, H, W]``: crops (at least 64 px, resized to H x W),
    normalized with ImageNet's mean and std (grey: their averages). Any other shape: standard normal.
    """
    from PIL import Image

    generator = torch.Generator().manual_seed(0)
    if len(shape) != 4 or shape[1] not in (1, 3):
        return torch.randn(count, *shape[1:], generator=generator)
    # the files of sklearn.datasets.load_sample_images, read without importing sklearn (seconds)
    spec = importlib.util.find_spec("sklearn")
    folder = Path(next(iter(spec.submodule_search_locations or ()))) / "datasets" / "images"
    photos = [
        torch.from_numpy(np.asarray(Image.open(folder / name).convert("RGB"), np.float32) / 255.0).permute(2, 0, 1)
        for name in ("china.jpg", "flower.jpg")
    ]
    height, width = shape[2:]
    zoom = max(1.0, 64 / min(height, width))
    crops = []
    for index in range(count):
        photo = photos[index % len(photos)]
        box_h, box_w = min(round(height * zoom), photo.shape[1]), min(round(width * zoom), photo.shape[2])
        top = int(torch.randint(0, photo.shape[1] - box_h + 1, (1,), generator=generator))
        left = int(torch.randint(0, photo.shape[2] - box_w + 1, (1,), generator=generator))
        crop = photo[None, :, top : top + box_h, left : left + box_w]
        if (box_h, box_w) != (height, width):
            crop = nn.functional.interpolate(crop, size=(height, width), mode="bilinear", antialias=True)
        crops.append(crop[0])
    images = torch.stack(crops)
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    if shape[1] == 1:
        images, mean, std = images.mean(1, keepdim=True), mean.mean(1, keepdim=True), std.mean(1, keepdim=True)
    return (images - mean) / std


def batch_of(images: Tensor, batch: int) -> np.ndarray:
    """``batch`` images, cycling through ``images``."""
    return images[torch.arange(batch) % len(images)].numpy()


def parse_shape(text: str) -> list[int]:
    try:
        shape = [int(part) for part in text.split(",")]
    except ValueError:
        raise InputError(f"--input-shape {text!r}: expected comma-separated integers, e.g. 1,3,224,224") from None
    if len(shape) < 2 or min(shape) < 1:
        raise InputError(f"--input-shape {text!r}: expected a batch and at least one more positive dimension")
    return shape


def load_data(path: str) -> tuple[Tensor, Tensor | None]:
    if not Path(path).is_file():
        raise InputError(f"--data {path!r}: no such file")
    try:
        with np.load(path) as data:
            arrays = {key: data[key] for key in data.files}
    except (OSError, ValueError) as error:
        raise InputError(f"--data {path!r}: not a readable .npz file ({error})") from None
    if "x" not in arrays or arrays["x"].ndim < 2 or len(arrays["x"]) < 2:
        raise InputError(f"--data {path!r}: needs an array 'x' of at least 2 samples (it has {sorted(arrays)})")
    x, labels = torch.from_numpy(arrays["x"].astype(np.float32)), arrays.get("labels")
    if labels is not None and labels.shape != (len(x),):
        raise InputError(f"--data {path!r}: 'labels' must have shape [{len(x)}], got {list(labels.shape)}")
    return x, None if labels is None else torch.from_numpy(labels.astype(np.int64))


def load_model(spec: str) -> nn.Module:
    """``package.module:factory``: a callable returning an nn.Module, or an nn.Module attribute."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise InputError(f"--model {spec!r}: expected package.module:factory")
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())  # a module beside the caller imports as with python -m
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as error:
        raise InputError(f"--model {spec!r}: cannot import {module_name!r} ({error})") from None
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise InputError(f"--model {spec!r}: {module_name!r} has no attribute {attribute!r}")
        target = getattr(target, part)
    if not isinstance(target, nn.Module) and callable(target):
        try:
            target = target()
        except TypeError as error:
            raise InputError(f"--model {spec!r}: {attribute}() failed ({error})") from None
    if not isinstance(target, nn.Module):
        raise InputError(f"--model {spec!r}: {attribute} is not an nn.Module nor returns one")
    return target.eval()


# -- the graphs and their checks ------------------------------------------------------------------
@dataclass
class Verdict:
    """A timed graph checked on this host: against the simulation, or against its own arithmetic."""

    verified: bool
    check: str  # what the graph was compared with
    lsb: float = 0.0  # the worst difference, in steps (LSBs) of the compared tensors
    tolerance: float = 0.0
    cause: str | None = None  # short, for the table
    detail: str | None = None
    remedy: str | None = None

    def mark(self) -> str:
        if self.verified:
            return "reference" if self.check == "reference" else f"ok ({self.lsb:.3g} LSB)"
        return f"does not verify: {self.lsb:.3g} LSB ({self.cause})"


@dataclass
class Graph:
    variant: str
    path: str
    verdict: Verdict
    reduce_range: bool = False
    deploy_s: float | None = None  # convert_deploy's seconds for the deployment it belongs to
    top1: float | None = None


@dataclass
class Workload:
    name: str
    model: nn.Module | None  # None: a float ONNX model given by the user
    float_path: str | None
    input_name: str
    shape: list[int]
    calibration: Tensor
    evaluation: Tensor  # verification (the first few), accuracy, timing
    labels: Tensor | None
    batches: tuple[int, ...]
    source: str


def float_onnx(model: nn.Module, shape: Sequence[int], path: Path) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model,
            (torch.zeros(*shape),),
            str(path),
            dynamo=False,
            opset_version=17,
            input_names=["x"],
            dynamic_axes={"x": {0: "batch"}},
        )
    return save_model(onnx.load(str(path)), path)


def deploy(
    model: nn.Module, backend: str, images: Tensor, folder: Path, reduce_range: bool
) -> tuple[nn.Module, DeployResult, float]:
    """Prepare, calibrate on ``images``, deploy with the QLinear graph too; convert_deploy's seconds."""
    config = reduce_range_config(resolve_backend(backend), None) if reduce_range else None
    qmodel = prepare_by_platform(model, backend, config)
    enable_calibration(qmodel)
    with torch.no_grad():
        for start in range(0, len(images), 16):
            qmodel(images[start : start + 16])
    enable_quantization(qmodel)
    start = time.perf_counter()
    shape = {"x": [1, *images.shape[1:]]}
    result = convert_deploy(
        qmodel, backend, shape, output_path=folder, deploy_to_qlinear=True, dynamic_axes={"x": {0: "batch"}}
    )
    return qmodel, result, time.perf_counter() - start


def mqbench_verdict(report: VerifyReport, key: str) -> Verdict:
    """The artifact's arithmetic and this host's onnxruntime serving it, both within the backend's tolerance."""
    art, tolerance, host = report.artifacts[key], report.tolerance, report.artifacts[key].host
    check = f"simulation: {key!r} as onnxruntime serves it here"
    if art.diverging(tolerance):
        cause = f"artifact arithmetic, from {art.diverging(tolerance)[0]}"
        return Verdict(False, check, art.max_lsb_diff, tolerance, cause)
    if host is None or not host.diverging(tolerance):
        return Verdict(True, check, max(art.max_lsb_diff, host.max_lsb_diff if host else 0.0), tolerance)
    saturating = report.host_facts.get("int8_pairs_saturate") and host.predicted
    cause = f"int16 pair saturation, {len(host.predicted)} layer(s)" if saturating else "runtime vs arithmetic"
    return Verdict(False, check, host.max_lsb_diff, tolerance, cause, host.cause, host.remedy)


def ort_quantize_static(float_path: str, images: Tensor, path: Path, input_name: str, reduce_range: bool) -> str:
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.batches = iter([{input_name: images[i : i + 1].numpy()} for i in range(len(images))])

        def get_next(self):  # type: ignore[no-untyped-def]
            return next(self.batches, None)

    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)  # quantize_static logs its advice (pre-processing, bias layout) on the root logger
    try:
        quantize_static(
            float_path,
            str(path),
            Reader(),
            quant_format=QuantFormat.QDQ,
            per_channel=True,
            reduce_range=reduce_range,
            activation_type=QuantType.QUInt8,
            weight_type=QuantType.QInt8,
        )
    finally:
        root.setLevel(level)
    return str(path)


def _last_quantized(model: onnx.ModelProto, output: str) -> list[onnx.NodeProto]:
    """The activation DequantizeLinear nodes (one constant scale) from which ``output`` is computed in float."""
    producers, initializers = producers_of(model.graph), initializer_map(model.graph)
    found, seen, stack = [], set(), [output]
    while stack:
        node = producers.get(stack.pop())
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        source = producers.get(node.input[0]) if node.op_type == "DequantizeLinear" else None
        if source is not None and source.op_type == "QuantizeLinear":
            scale = initializers.get(node.input[1])
            found += [node] if scale is not None and numpy_helper.to_array(scale).size == 1 else []
        elif node.op_type != "DequantizeLinear":  # a weight's DequantizeLinear is a constant
            stack += [name for name in node.input if name and name not in initializers]
    return found


def _one_step_bound(model: onnx.ModelProto, feeds: dict[str, np.ndarray], output: str) -> float | None:
    """How far ``output`` moves when its last quantized tensors move by one step (see check_ort_static)."""
    nodes = _last_quantized(model, output)
    if not nodes:
        return None
    initializers = initializer_map(model.graph)
    names = [node.output[0] for node in nodes]
    probe = onnx.ModelProto.FromString(model.SerializeToString())
    probe.graph.output.extend(helper.make_empty_tensor_value_info(name) for name in names)
    base, *tensors = ort_session(probe, optimize=False).run([output, *names], feeds)
    # the same graph with an offset added to each of those tensors, fed as extra inputs
    moved = onnx.ModelProto.FromString(model.SerializeToString())
    for name, tensor in zip(names, tensors, strict=True):
        for node in moved.graph.node:
            node.input[:] = [f"{name}::moved" if i == name else i for i in node.input]
        index = next(i for i, n in enumerate(moved.graph.node) if name in n.output)
        moved.graph.node.insert(index + 1, helper.make_node("Add", [name, f"{name}::step"], [f"{name}::moved"]))
        moved.graph.input.append(helper.make_tensor_value_info(f"{name}::step", onnx.TensorProto.FLOAT, tensor.shape))
    session, rng, bound = ort_session(moved, optimize=False), np.random.default_rng(0), 0.0
    for pattern in ("up", "down", "random"):
        offsets = {}
        for node, tensor in zip(nodes, tensors, strict=True):
            sign = rng.choice([-1.0, 1.0], size=tensor.shape) if pattern == "random" else (pattern == "up") * 2.0 - 1
            step = float(numpy_helper.to_array(initializers[node.input[1]]).reshape(()))
            offsets[f"{node.output[0]}::step"] = np.broadcast_to(sign * step, tensor.shape).astype(np.float32)
        (shifted,) = session.run([output], {**feeds, **offsets})
        bound = max(bound, float(np.max(np.abs(shifted.astype(np.float64) - base), initial=0.0)))
    return bound


def check_ort_static(path: str, feeds: dict[str, np.ndarray], saturate: bool) -> Verdict:
    """``quantize_static``'s model as served vs its own arithmetic (graph optimizations off).

    Unoptimized, onnxruntime runs each QuantizeLinear/DequantizeLinear pair as written, float ops on
    dequantized values: the model's arithmetic, the same on every host. Served (optimized), the pairs
    fuse into int8 kernels. A quantized output (a DequantizeLinear's, one scale) may differ by 1 step
    of its quantization (the fused requantization rounds differently). An output computed in float
    after the last quantized tensors gets the bound that 1 step of those implies: on the same inputs,
    the unoptimized model runs with them moved by +1 step in every element, by -1 step, and by random
    signs; the largest change of the output is its bound (``bound / max|output|``, the relative bound,
    is kept in the JSON), and the served output may differ by at most that. An output that no
    quantized tensor reaches is float throughout: it may differ by float reassociation, 1e-4 relative.
    """
    model = onnx.load(path)
    outputs = [v.name for v in model.graph.output]
    reference = ort_session(model, optimize=False).run(outputs, feeds)
    served = ort_session(model).run(outputs, feeds)
    producers, initializers = producers_of(model.graph), initializer_map(model.graph)
    worst, relative = 0.0, {}
    for name, got, want in zip(outputs, served, reference, strict=True):
        node = producers.get(name)
        scale = initializers.get(node.input[1]) if node is not None and node.op_type == "DequantizeLinear" else None
        size = max(float(np.max(np.abs(want), initial=0.0)), float(np.finfo(np.float32).tiny))
        if scale is not None:
            allowed = float(np.max(numpy_helper.to_array(scale)))
        else:
            bound = _one_step_bound(model, feeds, name)
            allowed = max(bound if bound is not None else 1e-4 * size, 1e-6 * size)  # 1e-6: float rounding
            relative[name] = allowed / size
        delta = float(np.max(np.abs(got.astype(np.float64) - want), initial=0.0))
        worst = max(worst, round(delta / allowed, 2))
    check = "own arithmetic: optimized vs unoptimized"
    if worst <= 1:
        return Verdict(
            True, check, worst, 1, detail=f"relative bound of float outputs: {relative}" if relative else None
        )
    predicted = _predicted_saturation(model, feeds) if saturate else {}
    if not predicted:
        return Verdict(False, check, worst, 1, "optimized vs unoptimized", "not explained by pair saturation")
    detail = (
        "onnxruntime's int8 kernels on this CPU (no VNNI) sum each two u8 x s8 products in a saturating 16-bit "
        f"register; the saturation model predicts {', '.join(list(predicted)[:5])}"
    )
    remedy = "quantize_static(..., reduce_range=True) (7-bit weights), or serve on a CPU with VNNI"
    return Verdict(False, check, worst, 1, f"int16 pair saturation, {len(predicted)} layer(s)", detail, remedy)


def _predicted_saturation(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, float]:
    try:
        predictions, _ = saturated_layers(model, feeds, (ORT_MLAS_AVX2,))
    except ValueError:  # ops the integer reference does not run (e.g. a contrib domain): no prediction
        return {}
    return predictions.get(ORT_MLAS_AVX2.runtime, {})


def mqbench_graphs(
    work: Workload, model: nn.Module, deployment: Deployment, folder: Path, checked: Tensor, reduce_range: bool
) -> list[Graph]:
    """One deployment of ``model``; each of its timed graphs verified on ``checked`` as served here."""
    tag = " 7-bit" if reduce_range else ""
    where = folder / f"{work.name}_{deployment.backend}{tag.strip()}"
    qmodel, result, seconds = deploy(model, deployment.backend, work.calibration, where, reduce_range)
    report = verify_deploy(qmodel, result, checked, artifacts=list(deployment.graphs))
    graphs = []
    for key, suffix in deployment.graphs.items():
        variant = f"{deployment.label}{tag}" + (f": {suffix}" if suffix else "")
        graphs.append(Graph(variant, result.artifacts[key], mqbench_verdict(report, key), reduce_range, seconds))
    return graphs


def ort_graphs(work: Workload, float_path: str, folder: Path, checked: Tensor, reduce_range: bool) -> list[Graph]:
    """onnxruntime's quantize_static on ``float_path``, checked against its own arithmetic on ``checked``."""
    variant = ORT_STATIC + (" 7-bit" if reduce_range else "")
    target = folder / f"{work.name}_ort{'_7bit' if reduce_range else ''}.onnx"
    path = ort_quantize_static(float_path, work.calibration, target, work.input_name, reduce_range)
    saturate = bool(host_facts()["int8_pairs_saturate"])
    return [Graph(variant, path, check_ort_static(path, {work.input_name: checked.numpy()}, saturate), reduce_range)]


def build_graphs(work: Workload, folder: Path, verify_count: int) -> list[Graph]:
    """Every graph of ``work``, each checked on this host.

    On a CPU whose int8 kernels saturate 16-bit pair sums, a family (a deployment, or quantize_static)
    with a graph that does not verify is built again with 7-bit weights, which cannot saturate, so
    that the table keeps a verified int8 figure beside the failing one.
    """
    float_path = work.float_path or float_onnx(work.model, work.shape, folder / f"{work.name}_float.onnx")
    graphs = [Graph("float", float_path, Verdict(True, "reference"))]
    checked = work.evaluation[:verify_count]
    families: list[Callable[[bool], list[Graph]]] = []
    if work.model is not None:
        families += [functools.partial(mqbench_graphs, work, work.model, d, folder, checked) for d in DEPLOYMENTS]
    families.append(functools.partial(ort_graphs, work, float_path, folder, checked))
    for family in families:
        eight_bit = family(False)
        graphs += eight_bit
        if host_facts()["int8_pairs_saturate"] and not all(graph.verdict.verified for graph in eight_bit):
            graphs += family(True)
    return graphs


def time_graphs(work: Workload, graphs: list[Graph], repeats: int) -> list[dict[str, Any]]:
    sessions = {graph.variant: ort_session(graph.path, THREADS) for graph in graphs}
    for graph in graphs if work.labels is not None else ():
        correct, chunk, session = 0, max(work.batches), sessions[graph.variant]  # a fixed batch: that one
        for start in range(0, len(work.evaluation), chunk):
            part, labels = work.evaluation[start : start + chunk], work.labels[start : start + chunk]
            logits = np.asarray(session.run(None, {work.input_name: batch_of(part, chunk)})[0])[: len(part)]
            correct += int((logits.reshape(len(part), -1).argmax(1) == labels.numpy()).sum())
        graph.top1 = correct / len(work.evaluation)
    # "x ort static" is against quantize_static's 8-bit model if it verifies, else its 7-bit one
    verified = {graph.variant for graph in graphs if graph.verdict.verified}
    baseline = next((v for v in (ORT_STATIC, f"{ORT_STATIC} 7-bit") if v in verified), None)
    rows = []
    for batch in work.batches:
        x = batch_of(work.evaluation, batch)
        calls = {name: (lambda s=s, x=x: s.run(None, {work.input_name: x})) for name, s in sessions.items()}
        median = time_interleaved(calls, repeats)
        for graph in graphs:
            seconds, ok = median[graph.variant], graph.verdict.verified
            rows.append(
                {
                    "model": work.name,
                    "batch": batch,
                    "variant": graph.variant,
                    "ms": seconds * 1e3,
                    "verified": ok,
                    "check": graph.verdict.mark(),
                    "speedup_vs_float": median["float"] / seconds if ok else None,
                    "vs_quantize_static": median[baseline] / seconds if ok and baseline else None,
                    "quantize_static_baseline": baseline,
                    "top1": graph.top1,
                }
            )
    return rows


# -- workloads from the command line --------------------------------------------------------------
def _workload_inputs(
    args: argparse.Namespace, data: tuple[Tensor, Tensor | None] | None, shape: list[int], what: str
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Calibration (the first images), evaluation (the rest, if any) and its labels."""
    images, labels = data if data is not None else (sample_inputs(shape, args.calibration + 8), None)
    if list(images.shape[1:]) != shape[1:]:
        raise InputError(f"--data: samples of shape {list(images.shape[1:])}, but {what} takes {shape[1:]}")
    if len(images) <= args.calibration:
        return images, images, labels
    return (
        images[: args.calibration],
        images[args.calibration :],
        None if labels is None else labels[args.calibration :],
    )


def model_workload(args: argparse.Namespace, data: tuple[Tensor, Tensor | None] | None) -> Workload:
    model = load_model(args.model)
    if args.input_shape is None and data is None:
        raise InputError("--model needs --input-shape (e.g. 1,3,224,224) or --data")
    shape = parse_shape(args.input_shape) if args.input_shape else [1, *data[0].shape[1:]]
    calibration, evaluation, labels = _workload_inputs(args, data, shape, f"--input-shape {shape}")
    try:
        with torch.no_grad():
            model(calibration[:1])
    except (RuntimeError, ValueError, TypeError, IndexError) as error:
        first = (str(error).strip() or type(error).__name__).splitlines()[0]
        raise InputError(f"--model {args.model!r} does not take input of shape {shape}: {first}") from None
    name = args.model.rpartition(":")[2]
    return Workload(name, model, None, "x", shape, calibration, evaluation, labels, BATCHES, args.model)


def onnx_workload(args: argparse.Namespace, data: tuple[Tensor, Tensor | None] | None) -> Workload:
    path = Path(args.onnx)
    if not path.is_file():
        raise InputError(f"--onnx {args.onnx!r}: no such file")
    try:
        model = onnx.load(str(path))
    except DecodeError:
        raise InputError(f"--onnx {args.onnx!r}: not an ONNX model") from None
    initializers = {init.name for init in model.graph.initializer}
    inputs = [v for v in model.graph.input if v.name not in initializers]
    if len(inputs) != 1 or inputs[0].type.tensor_type.elem_type != onnx.TensorProto.FLOAT:
        raise InputError(f"--onnx {args.onnx!r}: one float32 input expected, the model has {[v.name for v in inputs]}")
    name = inputs[0].name
    dims = [d.dim_value or None for d in inputs[0].type.tensor_type.shape.dim]  # None: dynamic
    if args.input_shape or data is not None:
        shape = parse_shape(args.input_shape) if args.input_shape else [dims[0] or 1, *data[0].shape[1:]]
    elif None in dims[1:]:
        raise InputError(f"--onnx {args.onnx!r}: input {name!r} has dynamic dimensions; give --input-shape")
    else:
        shape = [dims[0] or 1, *dims[1:]]
    if len(dims) != len(shape) or any(d is not None and d != s for d, s in zip(dims[1:], shape[1:], strict=False)):
        shown = [d or "dynamic" for d in dims]
        raise InputError(f"--onnx {args.onnx!r}: input {name!r} has shape {shown}, not {shape}")
    calibration, evaluation, labels = _workload_inputs(args, data, shape, f"--onnx {args.onnx!r}")
    batches = (dims[0],) if dims[0] else BATCHES
    try:
        ort_session(str(path), THREADS).run(None, {name: batch_of(calibration, batches[0])})
    except ORT_ERRORS as error:
        raise InputError(f"--onnx {args.onnx!r} does not run on input of shape {shape}: {error}") from None
    return Workload(path.stem, None, str(path), name, shape, calibration, evaluation, labels, batches, str(path))


def builtin_workloads(args: argparse.Namespace) -> list[Workload]:
    size = 64 if args.quick else 224
    shape = [1, 3, size, size]
    calibration, evaluation, _ = _workload_inputs(args, None, shape, "")
    models = {"resnet18": resnet18} if args.quick else MODELS
    return [
        Workload(name, factory(num_classes=1000).eval(), None, "x", shape, calibration, evaluation, None, BATCHES, name)
        for name, factory in models.items()
    ]


# -- report ---------------------------------------------------------------------------------------
def print_results(rows: list[dict[str, Any]], graphs: dict[str, list[Graph]], with_top1: bool) -> None:
    headers = ["model", "batch", "variant", "ms", "x float", "x ort static", "check"] + ["top-1"] * with_top1
    table = []
    for row in rows:
        cells = [
            row["model"],
            row["batch"],
            row["variant"],
            f"{row['ms']:.2f}" + " (unverified)" * (not row["verified"]),
        ]
        cells += [f"{row[k]:.2f}" if row[k] is not None else "-" for k in ("speedup_vs_float", "vs_quantize_static")]
        cells += [row["check"]] + ([f"{row['top1']:.2%}"] if with_top1 else [])
        table.append(cells)
    print_table(headers, table)
    for baseline in sorted({row["quantize_static_baseline"] for row in rows} - {None, ORT_STATIC}):
        print(f"x ort static: against {baseline} (the 8-bit model does not verify on this host)")
    for name, items in graphs.items():
        for graph in items:
            if not graph.verdict.verified:
                print(f"\n{name} {graph.variant} does not verify: {graph.verdict.detail}")
                if graph.verdict.remedy:
                    print(f"  remedy: {graph.verdict.remedy}")


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = argparse.ArgumentParser(prog="deploy_speed.py", description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--quick", action="store_true", help="ResNet-18 at 64 px, 1 verification image, 3 repeats")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", help="package.module:factory, a callable returning an nn.Module, or an nn.Module")
    source.add_argument("--onnx", help="a float ONNX model: timed as is and quantized with quantize_static")
    parser.add_argument("--input-shape", help="the model's input shape with batch, e.g. 1,3,224,224")
    parser.add_argument("--data", help=".npz with 'x' (samples) and optional 'labels' (class indices)")
    parser.add_argument("--calibration", type=int, default=8, help="calibration images (the first of --data)")
    parser.add_argument("--verify-images", type=int, default=2, help="evaluation images each graph is checked on")
    parser.add_argument("--output", help="JSON path (default benchmarks/results/deploy_speed.json)")
    args = parser.parse_args(argv)
    if min(args.repeats, args.calibration, args.verify_images) < 1:
        parser.error("--repeats, --calibration and --verify-images must be positive")
    if (args.input_shape or args.data) and not (args.model or args.onnx):
        parser.error("--input-shape and --data belong to --model or --onnx")
    return parser, args


def main(argv: Sequence[str] | None = None) -> Path:
    parser, args = parse_args(argv)
    try:
        data = load_data(args.data) if args.data else None
        source = model_workload if args.model else onnx_workload if args.onnx else None
        workloads = [source(args, data)] if source else builtin_workloads(args)
    except InputError as error:
        parser.error(str(error))
    keep_freed_memory()
    onnxruntime.set_default_logger_severity(3)  # errors only: not its notes on unused initializers
    torch.manual_seed(0)
    torch.set_num_threads(THREADS)
    facts = host_facts()
    print(describe_host(facts))
    repeats, verify_count = (3, 1) if args.quick else (args.repeats, args.verify_images)
    rows: list[dict[str, Any]] = []
    graphs: dict[str, list[Graph]] = {}
    deploy_seconds: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for work in workloads:
            graphs[work.name] = build_graphs(work, Path(scratch), verify_count)
            rows += time_graphs(work, graphs[work.name], repeats)
            for graph in graphs[work.name]:
                deployment = graph.variant.split(":")[0].removeprefix("mqbench ")  # one convert_deploy for its graphs
                if graph.deploy_s is not None:
                    deploy_seconds[f"{work.name} {deployment}"] = graph.deploy_s
        if not (args.quick or source):
            big, images = resnet50(num_classes=1000).eval(), workloads[0].calibration
            deploy_seconds["resnet50 QDQ"] = deploy(big, "qdq", images, Path(scratch) / "r50", False)[2]
    print()
    print_results(rows, graphs, any(work.labels is not None for work in workloads))
    if deploy_seconds:
        print("\nconvert_deploy wall time (export, strip, Q/DQ, QLinear graph, writers):")
        for key, seconds in deploy_seconds.items():
            print(f"  {key:<32}{seconds:>7.2f} s")
    models = [
        {
            "model": work.name,
            "source": work.source,
            "input_shape": work.shape,
            "calibration_images": len(work.calibration),
            "evaluation_images": len(work.evaluation),
            "verification_images": min(verify_count, len(work.evaluation)),
        }
        for work in workloads
    ]
    graph_rows = [
        {
            "model": name,
            "variant": graph.variant,
            **asdict(graph.verdict),
            "reduce_range": graph.reduce_range,
            "convert_deploy_s": graph.deploy_s,
            "top1": graph.top1,
        }
        for name, items in graphs.items()
        for graph in items
    ]
    payload = {
        "host": facts,  # host_facts(), as every benchmark JSON has it
        "host_description": describe_host(facts),
        "threads": THREADS,
        "repeats": repeats,
        "quick": args.quick,
        "data": args.data or "sample photo crops (standard normal for shapes that are not images)",
        "models": models,
        "graphs": graph_rows,
        "latency": rows,
        "convert_deploy_s": deploy_seconds,
    }
    if args.output is None:
        path = write_json("deploy_speed", payload)
    else:
        path = Path(args.output)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(payload, indent=2))
    print(f"\nwrote {path}")
    return path


if __name__ == "__main__":
    main()
