"""Reconstruction cost: one iteration against the unit's own float forward and backward, and the cache's memory.

For one unit of each type (a single layer, a ResNet basic block, a MobileNetV2 inverted residual,
a ViT attention block and MLP block), on the zoo models, the model is prepared for the Academic
backend with MQBench's QDrop recipe (AdaRoundFakeQuantize weights, QDropFakeQuantize activations,
W4A4, prob 0.5) and calibrated; then, interleaved on the same cached batch, the median time of

* one reconstruction iteration (soft-rounded forward, loss with the rounding regulariser,
  backward, the Adam steps), and
* the unit's float forward and backward (gradients for its weights and its input, as
  backpropagation through a network computes them; no optimizer),

and their ratio (target <= 2.5). The cache's size is reported against the number of calibration
samples: the values a unit reads and writes, in the quantized and the float model, per sample.

Prints a table and writes benchmarks/results/ptq_speed.json.
Run: .venv/bin/python benchmarks/ptq_speed.py [--batch 32] [--repeats 30]
"""

from __future__ import annotations

import argparse
import random
import warnings

import torch

from _timing import time_interleaved, write_json
from mqbench.advanced_ptq import ReconstructionConfig, calibrate, find_units
from mqbench.advanced_ptq.reconstruction import UnitCache, UnitReconstruction, float_copy
from mqbench.models.zoo import zoo_model
from mqbench.prepare_by_platform import prepare_by_platform
from mqbench.utils.host import describe_host
from mqbench.utils.memory import keep_freed_memory

RECIPE = {
    "extra_qconfig_dict": {
        "w_observer": "MSEObserver",
        "a_observer": "EMAMSEObserver",
        "w_fakequantize": "AdaRoundFakeQuantize",
        "a_fakequantize": "QDropFakeQuantize",
        "w_qscheme": {"bit": 4, "symmetry": False, "per_channel": True, "pot_scale": False, "p": 2.4},
        "a_qscheme": {"bit": 4, "symmetry": False, "per_channel": False, "pot_scale": False, "p": 2.4},
    }
}
# unit type -> (zoo model, the first layer of the unit)
CASES = {
    "layer (ResNet-18 conv1)": ("resnet18", "conv1", "layer"),
    "ResNet basic block": ("resnet18", "layer2_0_downsample_0", "block"),
    "MobileNetV2 inverted residual": ("mobilenet_v2", "features_3_conv_0_0", "block"),
    "ViT attention": ("vit", "blocks_0_attn_q", "block"),
    "ViT MLP": ("vit", "blocks_0_mlp_0", "block"),
}


def prepared(name: str, batch: int) -> tuple[torch.fx.GraphModule, list[torch.Tensor]]:
    zoo = zoo_model(name)
    model = prepare_by_platform(zoo.model, "academic", RECIPE)
    batches = [zoo.calibration[i : i + batch] for i in range(0, len(zoo.calibration), batch)]
    return calibrate(model, batches), batches


def measure(label: str, batch: int, repeats: int) -> dict[str, object]:
    name, first_layer, pattern = CASES[label]
    model, batches = prepared(name, batch)
    (unit,) = [u for u in find_units(model, pattern) if u.layers[0] == first_layer]
    config = ReconstructionConfig.from_mapping({"pattern": pattern, "prob": 0.5, "max_count": 10**6})
    fp_model = float_copy(model)
    cache = UnitCache(model, fp_model, batches, torch.device("cpu"))
    work = UnitReconstruction(model, fp_model, unit, cache, config, random.Random(0))
    step = iter(range(10**6))
    times = time_interleaved(
        {"iteration": lambda: work.step(next(step)), "float": lambda: work.float_step(0)}, repeats=repeats
    )

    def nbytes(values: tuple[object, ...]) -> int:
        return sum(t.numel() * t.element_size() for t in values if isinstance(t, torch.Tensor))

    # inputs and outputs of the unit, each in the quantized and the float model
    per_sample = 2 * (nbytes(work.quant_inputs[0]) + nbytes(work.targets[0])) / len(batches[0])
    work.finish()
    return {
        "model": name,
        "layers": len(unit.layers),
        "iteration_ms": times["iteration"] * 1e3,
        "float_fwd_bwd_ms": times["float"] * 1e3,
        "ratio": times["iteration"] / times["float"],
        "cache_kib_per_sample": per_sample / 1024,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    keep_freed_memory()
    torch.manual_seed(0)
    print(describe_host())
    rows = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for label in CASES:
            rows[label] = measure(label, args.batch, args.repeats)
    samples = (128, 1024, 10_000)
    print(
        f"| unit (batch {args.batch}) | layers | iteration ms | float fwd+bwd ms | ratio (target <= 2.5) | "
        + " | ".join(f"cache MiB at {n} samples" for n in samples)
        + " |"
    )
    print("| --- " * (5 + len(samples)) + "|")
    for label, row in rows.items():
        cache = " | ".join(f"{row['cache_kib_per_sample'] * n / 1024:.1f}" for n in samples)
        print(
            f"| {label} | {row['layers']} | {row['iteration_ms']:.2f} | {row['float_fwd_bwd_ms']:.2f} | "
            f"{row['ratio']:.2f} | {cache} |"
        )
    write_json("ptq_speed", {"batch": args.batch, "repeats": args.repeats, "units": rows})


if __name__ == "__main__":
    main()
