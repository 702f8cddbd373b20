"""Mixed precision against uniform widths at equal model size, and sensitivity rankings against measured drops.

For each zoo model trained here (ResNet-18, MobileNetV2 on the digits; Academic backend, MinMax
calibration on 128 training images, per-channel weights, 8-bit activations, the backend's
first/last layers at 8 bits):

1. Uniform weights at 6, 4, 3 and 2 bits: test accuracy (450 held-out digits) and the size of the
   quantized weights. Then ``search_mixed_precision`` with candidate weight widths 8/6/4/3/2 under
   each uniform row's size as its budget: the mix at exactly that size, its accuracy.
2. Sensitivity rankings (ResNet-18, each layer's weights alone at 2 bits): the measured test
   accuracy drop per layer against five scores computed on the calibration images (the search's
   output error, the loss change, HAWQ, Fisher, Taylor): Spearman's rank correlation.

Prints tables, writes benchmarks/results/mixed_precision.json and docs/images/mixed_precision_pareto.png.
Run: .venv/bin/python benchmarks/mixed_precision.py
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
from scipy.stats import spearmanr
from torch import nn

from _timing import write_json
from mqbench.advanced_ptq import calibrate
from mqbench.custom_quantizer.bits import set_quantizer_bits
from mqbench.data import load_digits_split
from mqbench.functional import bits_of_range
from mqbench.mix_precision import layer_sensitivity, search_mixed_precision
from mqbench.models.zoo import digits_rgb, zoo_model
from mqbench.prepare_by_platform import prepare_by_platform
from mqbench.utils.host import describe_host
from mqbench.utils.state import disable_all, enable_quantization

MODELS = {"resnet18": "ResNet-18", "mobilenet_v2": "MobileNetV2"}
UNIFORM = (6, 4, 3, 2)
CANDIDATES = {"weight": (8, 6, 4, 3, 2), "activation": (8,)}
PLOT = Path(__file__).resolve().parents[1] / "docs" / "images" / "mixed_precision_pareto.png"


def config(w_bits: int) -> dict[str, Any]:
    return {
        "extra_qconfig_dict": {
            "w_observer": "MinMaxObserver",
            "a_observer": "MinMaxObserver",
            "w_fakequantize": "FixedFakeQuantize",
            "a_fakequantize": "FixedFakeQuantize",
            "w_qscheme": {"bit": w_bits, "symmetry": False, "per_channel": True, "pot_scale": False},
            "a_qscheme": {"bit": 8, "symmetry": False, "per_channel": False, "pot_scale": False},
        }
    }


@torch.no_grad()
def accuracy(model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> float:
    return 100.0 * float((model(images).argmax(1) == labels).float().mean())


def calibrated(model: nn.Module, settings: dict[str, Any], batches: list[torch.Tensor]) -> nn.Module:
    return calibrate(prepare_by_platform(model, "academic", settings), batches)


def weight_bytes(qmodel: nn.Module) -> float:
    total = 0.0
    for module in qmodel.modules():
        quantizer = getattr(module, "weight_fake_quant", None)
        if quantizer is not None:
            bits = bits_of_range(int(quantizer.quant_min), int(quantizer.quant_max))
            total += module.weight.numel() * bits / 8
    return total


def pareto_rows(name: str, batches: list[torch.Tensor], test: torch.Tensor, labels: torch.Tensor) -> list[dict]:
    zoo = zoo_model(name)
    rows = []
    for bits in UNIFORM:
        uniform = calibrated(zoo.model, config(bits), batches)
        size = weight_bytes(uniform)
        mixed = search_mixed_precision(
            zoo.model,
            "academic",
            batches,
            lambda m: accuracy(m, test, labels),
            CANDIDATES,
            {"size_bytes": size},
            config(8),
        )
        widths = [w for w, _ in mixed.bits.values()]
        rows.append(
            {
                "uniform_bits": bits,
                "size_bytes": size,
                "uniform_accuracy": accuracy(uniform, test, labels),
                "mixed_size_bytes": mixed.size_bytes,
                "mixed_accuracy": mixed.accuracy,
                "mixed_widths": {w: widths.count(w) for w in sorted(set(widths), reverse=True)},
            }
        )
        print(
            f"  {MODELS[name]} W{bits}A8: uniform {rows[-1]['uniform_accuracy']:.2f}% vs mixed "
            f"{mixed.accuracy:.2f}% at {size / 1e6:.3f} MB",
            flush=True,
        )
    return rows


def rankings(batches: list[torch.Tensor], train_labels: torch.Tensor, test: torch.Tensor, labels: torch.Tensor) -> dict:
    zoo = zoo_model("resnet18")
    qmodel = calibrated(zoo.model, config(8), batches)
    names = [n for n, m in qmodel.named_modules() if hasattr(m, "weight_fake_quant")]
    named = dict(qmodel.named_modules())
    disable_all(qmodel)
    base = accuracy(qmodel, test, labels)
    measured = {}
    for layer in names:
        quantizer = named[layer].weight_fake_quant
        set_quantizer_bits(quantizer, 2)
        quantizer.enable_fake_quant(True)
        measured[layer] = base - accuracy(qmodel, test, labels)
        quantizer.enable_fake_quant(False)
        set_quantizer_bits(quantizer, 8)
    enable_quantization(qmodel)
    pairs = [(b, train_labels[i * len(b) : (i + 1) * len(b)]) for i, b in enumerate(batches)]
    scores = {
        method: layer_sensitivity(qmodel, pairs, nn.CrossEntropyLoss(), method, bits=2)
        for method in ("loss", "hessian", "fisher", "taylor")
    }
    search = search_mixed_precision(
        zoo.model, "academic", batches, None, {"weight": (8, 2), "activation": (8,)}, None, config(8)
    )
    scores["output error (search)"] = {
        layer.name: search.sensitivity.get(layer.weight, {}).get(2, 0.0) for layer in search.layers
    }
    movable = [n for n in names if n in scores["output error (search)"] and scores["output error (search)"][n] > 0]
    result = {"measured_drop": measured, "spearman": {}}
    for method, values in scores.items():
        layers = [n for n in movable if n in values]
        rho = spearmanr([values[n] for n in layers], [measured[n] for n in layers]).statistic
        result["spearman"][method] = float(rho)
        print(f"  {method:24s} Spearman {rho:+.3f} over {len(layers)} layers", flush=True)
    return result


def plot(results: dict[str, list[dict]]) -> None:
    figure, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 3.6))
    for axis, (name, rows) in zip(axes, results.items(), strict=True):
        sizes = [r["size_bytes"] / 1e6 for r in rows]
        axis.plot(sizes, [r["uniform_accuracy"] for r in rows], "o--", label="uniform W(b)A8")
        axis.plot(sizes, [r["mixed_accuracy"] for r in rows], "s-", label="mixed (search at that size)")
        for r, x in zip(rows, sizes, strict=True):
            axis.annotate(
                f"W{r['uniform_bits']}", (x, r["uniform_accuracy"]), textcoords="offset points", xytext=(4, -10)
            )
        axis.set_title(MODELS[name])
        axis.set_xlabel("quantized weights, MB")
        axis.set_ylabel("test accuracy, %")
        axis.grid(alpha=0.3)
        axis.legend()
    figure.tight_layout()
    PLOT.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(PLOT, dpi=110)


def main() -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(2)
    print(describe_host())
    train, test_split = load_digits_split()
    images = digits_rgb(train.images)
    batches = [images[i : i + 32] for i in range(0, 128, 32)]
    test, labels = digits_rgb(test_split.images), test_split.labels
    results = {name: pareto_rows(name, batches, test, labels) for name in MODELS}
    print("\n| model | weights | size MB | uniform acc % | mixed acc % (same size) | mixed widths (layers) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, rows in results.items():
        for r in rows:
            widths = ", ".join(f"W{w}: {n}" for w, n in r["mixed_widths"].items())
            print(
                f"| {MODELS[name]} | W{r['uniform_bits']}A8 | {r['size_bytes'] / 1e6:.3f} | "
                f"{r['uniform_accuracy']:.2f} | {r['mixed_accuracy']:.2f} | {widths} |"
            )
    print("\nSensitivity rankings, ResNet-18, one layer's weights at 2 bits:")
    ranking = rankings(batches, train.labels[:128], test, labels)
    plot(results)
    write_json("mixed_precision", {"pareto": results, "rankings": ranking, "candidates": CANDIDATES})


if __name__ == "__main__":
    main()
