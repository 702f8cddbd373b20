"""Post-training quantization accuracy: MQBench's PTQ benchmark table on models trained here.

Vision (the zoo's ResNet-18, MobileNetV2 and ViT, trained on scikit-learn's digits): each model is
prepared for the Academic backend (per-channel asymmetric weights, per-tensor asymmetric
activations, first and last layer 8-bit, as MQBench's PTQ benchmark), calibrated on a small
random subset of the training images (``--calibration``, 64 by default: few samples is what
separates the methods, the clean digits alone do not) and scored on the 450 held-out test images.
Methods, as MQBench's configs define them:

* MinMax: MinMaxObserver weights and activations, rounding to nearest.
* MSE: MSEObserver weights, EMAMSEObserver activations (Lp norm p = 2.4), rounding to nearest;
  "+ CLE" equalizes weight ranges first, "+ BC" corrects the biases afterwards.
* AdaRound: learned rounding, layer by layer, activations fixed after calibration.
* BRECQ: learned rounding, block by block, activation scales learned (QDropFakeQuantize, p = 1).
* QDrop: as BRECQ with QDropFakeQuantize activations (quantization dropped with p = 0.5).

Each cell is the mean and spread (population standard deviation) over ``--seeds`` seeds (the
calibration subset, the reconstruction's random draws). Bit widths W8A8, W4A8, W4A4, W3A3, W2A4.
``--trainings N`` also trains each model N times (the zoo's recipe with training seeds 0 ... N-1,
seed 0 being the zoo's own model; each cached like it): the cells then spread over trainings x
seeds, and the float row is the mean over the trainings.

Transformer (all-MiniLM-L6-v2, real weights, on the held-out standard-library docstrings): mean
cosine of quantized to float sentence embeddings and nearest-neighbour agreement, for W8A8 on
TensorRT NLP (its default recipe, without the outlier migration, with MQBench's 8-bit residual
adds, and with the attention products left in float) and W4A8 on Academic NLP (rounding to
nearest vs block reconstruction, ``--minilm-iters`` iterations per unit, over ``--seeds`` seeds).

Prints the tables and writes benchmarks/results/ptq_accuracy.json.
Run: .venv/bin/python benchmarks/ptq_accuracy.py [--seeds 3] [--iters 300] [--models resnet18,...]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import time
import warnings
from typing import Any

import torch

from _timing import write_json
from mqbench.advanced_ptq import bias_correction, calibrate, cross_layer_equalization, ptq_reconstruction
from mqbench.backends import ParamsTable, Placement
from mqbench.data import load_digits_split
from mqbench.models.zoo import VISION_MODELS, build_zoo_model, digits_rgb
from mqbench.prepare_by_platform import prepare_by_platform
from mqbench.utils.host import describe_host

BITS = {"W8A8": (8, 8), "W4A8": (4, 8), "W4A4": (4, 4), "W3A3": (3, 3), "W2A4": (2, 4)}
METHODS = ("MinMax", "MSE", "MSE + CLE", "MSE + BC", "AdaRound", "BRECQ", "QDrop")
CLASSIFIERS = tuple(name for name, recipe in VISION_MODELS.items() if recipe.steps)  # the digit classifiers
RECONSTRUCTION = {  # MQBench's adaround / brecq / qdrop configs, iterations from --iters
    "AdaRound": {"pattern": "layer", "prob": 1.0, "a_fakequantize": "FixedFakeQuantize"},
    "BRECQ": {"pattern": "block", "prob": 1.0, "a_fakequantize": "QDropFakeQuantize"},
    "QDrop": {"pattern": "block", "prob": 0.5, "a_fakequantize": "QDropFakeQuantize"},
}
MODEL_NAMES = {"resnet18": "ResNet-18", "mobilenet_v2": "MobileNetV2", "vit": "ViT"}


def qconfig(method: str, w_bits: int, a_bits: int) -> dict[str, Any]:
    minmax = method == "MinMax"
    recon = RECONSTRUCTION.get(method)
    norm = {} if minmax else {"p": 2.4}
    return {
        "extra_qconfig_dict": {
            "w_observer": "MinMaxObserver" if minmax else "MSEObserver",
            "a_observer": "MinMaxObserver" if minmax else "EMAMSEObserver",
            "w_fakequantize": "AdaRoundFakeQuantize" if recon else "FixedFakeQuantize",
            "a_fakequantize": recon["a_fakequantize"] if recon else "FixedFakeQuantize",
            "w_qscheme": {"bit": w_bits, "symmetry": False, "per_channel": True, "pot_scale": False, **norm},
            "a_qscheme": {"bit": a_bits, "symmetry": False, "per_channel": False, "pot_scale": False, **norm},
        }
    }


@functools.cache
def trained(name: str, training: int) -> torch.nn.Module:
    """Zoo model ``name`` trained with training seed ``training`` (0: the zoo's own)."""
    return build_zoo_model(name, dataclasses.replace(VISION_MODELS[name], seed=training)).model


@torch.no_grad()
def accuracy(model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor) -> float:
    correct = sum(
        int((model(images[i : i + 150]).argmax(1) == labels[i : i + 150]).sum()) for i in range(0, len(labels), 150)
    )
    return 100.0 * correct / len(labels)


def run_vision(
    name: str, training: int, method: str, bits: str, seed: int, args: argparse.Namespace, data: dict
) -> float:
    w_bits, a_bits = BITS[bits]
    generator = torch.Generator().manual_seed(seed)
    pick = torch.randperm(len(data["train"]), generator=generator)[: args.calibration]
    images = data["train"][pick]
    batches = [images[i : i + args.batch] for i in range(0, len(images), args.batch)]
    torch.manual_seed(seed)
    qmodel = prepare_by_platform(trained(name, training), "academic", qconfig(method, w_bits, a_bits))
    if method == "MSE + CLE":
        cross_layer_equalization(qmodel)
    calibrate(qmodel, batches)
    if method == "MSE + BC":
        bias_correction(qmodel, batches)
    if method in RECONSTRUCTION:
        recipe = RECONSTRUCTION[method]
        config = {
            "pattern": recipe["pattern"],
            "prob": recipe["prob"],
            "max_count": args.iters,
            "warm_up": 0.2,
            "weight": 0.01,
            "b_range": [20, 2],
            "scale_lr": 4e-5,
            "seed": seed,
            "progress": False,
        }
        ptq_reconstruction(qmodel, batches, config)
    return accuracy(qmodel, data["test"], data["labels"])


def spread(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.pstdev(values) if len(values) > 1 else 0.0


def vision_tables(args: argparse.Namespace, save: Any) -> dict[str, Any]:
    train, test = load_digits_split()
    data = {"train": digits_rgb(train.images), "test": digits_rgb(test.images), "labels": test.labels}
    models = args.models.split(",")
    results: dict[str, Any] = {"float": {}, "cells": {}}
    for name in models:
        floats = [accuracy(trained(name, t), data["test"], data["labels"]) for t in range(args.trainings)]
        results["float"][name] = statistics.fmean(floats)
        results.setdefault("float_per_training", {})[name] = floats
    for bits in args.bits.split(","):
        for method in args.methods.split(","):
            for name in models:
                started = time.perf_counter()
                values = [
                    run_vision(name, training, method, bits, seed, args, data)
                    for training in range(args.trainings)
                    for seed in range(args.seeds)
                ]
                mean, std = spread(values)
                results["cells"][f"{bits}/{method}/{name}"] = {"values": values, "mean": mean, "std": std}
                save(results)  # every finished cell is on disk
                took = time.perf_counter() - started
                print(f"  {bits} {method:9s} {name:12s} {mean:6.2f} +- {std:4.2f}  ({took:.0f} s)", flush=True)
    return results


def print_vision(results: dict[str, Any], args: argparse.Namespace) -> None:
    models = args.models.split(",")
    header = " | ".join(MODEL_NAMES.get(m, m) for m in models)
    floats = " | ".join(f"{results['float'][m]:.2f}" for m in models)
    print(f"\n| Method | {header} |\n|---|" + "---|" * len(models))
    print(f"| Float | {floats} |")
    for bits in args.bits.split(","):
        for method in args.methods.split(","):
            cells = [results["cells"].get(f"{bits}/{method}/{m}") for m in models]
            text = " | ".join(f"{c['mean']:.2f} ± {c['std']:.2f}" if c else "-" for c in cells)
            print(f"| {bits} {method} | {text} |")


def minilm_table(args: argparse.Namespace) -> dict[str, Any]:
    from mqbench.models.sentence_embedding import (
        embedding_agreement,
        load_minilm,
        sentence_embeddings,
        stdlib_docstrings,
        tokenized_batches,
    )

    model, tokenizer = load_minilm()
    texts = stdlib_docstrings()
    calibration = tokenized_batches(tokenizer, texts[0::5][:128])
    held_out = tokenized_batches(tokenizer, [t for i, t in enumerate(texts) if i % 5])
    reference = sentence_embeddings(model, held_out)
    config = {"capture": "export", "example_inputs": calibration[0]}  # torch.export: transformers 4.x and 5.x
    int8_residual = dataclasses.replace(
        ParamsTable["tensorrt_nlp"],
        placement=Placement(inputs_of={"linear", "matmul", "add"}, add_needs_activations=True),
    )
    linear_only = dataclasses.replace(ParamsTable["tensorrt_nlp"], placement=Placement(inputs_of={"linear"}))
    w4a8 = {
        "extra_qconfig_dict": {
            "w_observer": "MSEObserver",
            "a_observer": "MinMaxObserver",
            "w_fakequantize": "AdaRoundFakeQuantize",
            "a_fakequantize": "FixedFakeQuantize",
            "w_qscheme": {"bit": 4, "symmetry": True, "per_channel": True, "pot_scale": False},
            "a_qscheme": {"bit": 8, "symmetry": True, "per_channel": False, "pot_scale": False},
        }
    }
    rows: dict[str, Any] = {}

    def measure(label: str, backend: Any, extra: dict | None, smooth: bool | None, seed: int | None = None) -> None:
        started = time.perf_counter()
        qmodel = prepare_by_platform(model, backend, {**config, **(extra or {})})
        calibrate(qmodel, calibration, smooth=smooth)
        if seed is not None:
            recipe = {"pattern": "block", "max_count": args.minilm_iters, "weight": 0.01, "prob": 1.0, "seed": seed}
            ptq_reconstruction(qmodel, calibration, {**recipe, "progress": False})
        agreement = embedding_agreement(reference, sentence_embeddings(qmodel, held_out))
        rows[label] = {**dataclasses.asdict(agreement), "seconds": time.perf_counter() - started}
        print(f"  {label}: {agreement}")

    measure("W8A8 tensorrt_nlp, default recipe", "tensorrt_nlp", None, None)
    measure("W8A8 tensorrt_nlp, no outlier migration", "tensorrt_nlp", None, False)
    measure("W8A8 tensorrt_nlp, MQBench's 8-bit residual adds", int8_residual, None, False)
    measure("W8A8 tensorrt_nlp, default recipe, attention products in float", linear_only, None, None)
    measure("W4A8 academic_nlp, rounding to nearest", "academic_nlp", w4a8, False)
    for seed in range(args.seeds):
        measure(f"W4A8 academic_nlp, block reconstruction, seed {seed}", "academic_nlp", w4a8, False, seed=seed)
    print(f"\nall-MiniLM-L6-v2, {len(reference)} held-out docstrings, 128 calibration sentences\n")
    print("| Setting | mean cosine | min cosine | top-1 neighbour agreement |\n|---|---|---|---|")
    for label, row in rows.items():
        print(f"| {label} | {row['mean_cosine']:.4f} | {row['min_cosine']:.4f} | {row['neighbour_agreement']:.3f} |")
    seeded = [row for label, row in rows.items() if "seed" in label]
    if len(seeded) > 1:
        cells = [spread([row[key] for row in seeded]) for key in ("mean_cosine", "min_cosine", "neighbour_agreement")]
        means = " | ".join(f"{mean:.4f} ± {std:.4f}" for mean, std in cells)
        print(f"| W4A8 academic_nlp, block reconstruction, {len(seeded)} seeds | {means} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet18,mobilenet_v2,vit")
    parser.add_argument("--bits", default=",".join(BITS))
    parser.add_argument("--methods", default=",".join(METHODS), help=f"any of {', '.join(METHODS)}")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--trainings", type=int, default=1, help="trainings of each model (training seeds 0...N-1)")
    parser.add_argument("--iters", type=int, default=300, help="reconstruction iterations per unit")
    parser.add_argument("--calibration", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--minilm-iters", type=int, default=400, help="reconstruction iterations per MiniLM unit")
    parser.add_argument("--skip-vision", action="store_true")
    parser.add_argument("--skip-minilm", action="store_true")
    parser.add_argument("--output", default="ptq_accuracy", help="name of the JSON file in benchmarks/results")
    args = parser.parse_args()
    for option, valid in (("--models", CLASSIFIERS), ("--bits", tuple(BITS)), ("--methods", METHODS)):
        unknown = sorted(set(getattr(args, option[2:]).split(",")) - set(valid))
        if unknown:
            parser.error(f"{option}: unknown {', '.join(map(repr, unknown))}; choose from {', '.join(valid)}")
    for option in ("seeds", "trainings", "iters", "calibration", "batch", "minilm_iters"):
        if getattr(args, option) < 1:
            parser.error(f"--{option.replace('_', '-')} must be at least 1, got {getattr(args, option)}")
    torch.set_num_threads(2)
    warnings.filterwarnings("ignore")
    print(describe_host())
    payload: dict[str, Any] = {"settings": vars(args)}
    if not args.skip_vision:
        payload["vision"] = vision_tables(args, lambda partial: write_json(args.output, {**payload, "vision": partial}))
        print_vision(payload["vision"], args)
    if not args.skip_minilm:
        payload["minilm"] = minilm_table(args)
    write_json(args.output, payload)


if __name__ == "__main__":
    main()
