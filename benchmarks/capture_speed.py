"""Capture with torch.export against torch.fx, in one run, with two threads.

1. Capture + prepare wall time, ``capture="export"`` over ``capture="fx"``: ResNet-50 (eval, Tensorrt,
   224x224 example input) and a BERT-style encoder (``bert_tiny`` with 4 layers of width 128, Tensorrt_NLP,
   token ids and mask of 4 x 64). Both captures give the same prepared model here (tests check it); export
   traces the model's Python with fake tensors and then turns its ATen graph back into module calls, so it
   costs more. Reported, no target.
2. The QAT step (batch 16, 112x112, SGD: forward, cross-entropy, backward, step) of ResNet-18 prepared for
   Tensorrt in train mode from an export capture, over the float model's step: target <= 1.2x. The
   fx-captured QAT step is measured beside it.

Repeats are interleaved and the ratios are medians of per-repeat ratios. Prints a table and writes
benchmarks/results/capture_speed.json.

Run: .venv/bin/python benchmarks/capture_speed.py [--repeats N]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
from torch import nn

from _timing import interleaved_samples, paired_ratio, print_table, write_json
from mqbench.models import bert_tiny, resnet18, resnet50
from mqbench.prepare_by_platform import prepare_by_platform
from mqbench.utils.state import enable_calibration, enable_quantization
from prepare_speed import sgd_step

THREADS = 2
QAT_TARGET = 1.2
BATCH, SIZE = 16, 112


def _preparing(model: nn.Module, backend: str, capture: str, example: object):
    config = {"capture": capture, "example_inputs": example}
    return lambda: prepare_by_platform(model, backend, config)


def prepare_times(repeats: int) -> list[dict[str, object]]:
    torch.manual_seed(0)
    ids = torch.randint(0, 1000, (4, 64))
    cases = {
        "resnet50 / tensorrt": (resnet50().eval(), "tensorrt", (torch.randn(1, 3, 224, 224),)),
        "bert (4x128) / tensorrt_nlp": (
            bert_tiny(dim=128, depth=4, heads=4, max_len=64).eval(),
            "tensorrt_nlp",
            {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
        ),
    }
    rows = []
    for name, (model, backend, example) in cases.items():
        functions = {capture: _preparing(model, backend, capture, example) for capture in ("fx", "export")}
        samples = interleaved_samples(functions, repeats, warmup=1)
        fx_s, export_s = statistics.median(samples["fx"]), statistics.median(samples["export"])
        rows.append(
            {
                "case": name,
                "fx_s": round(fx_s, 3),
                "export_s": round(export_s, 3),
                "export_over_fx": round(paired_ratio(samples, "export", "fx"), 2),
            }
        )
    return rows


def qat_step(repeats: int) -> dict[str, object]:
    torch.manual_seed(0)
    x, y = torch.randn(BATCH, 3, SIZE, SIZE), torch.randint(0, 1000, (BATCH,))
    float_model = resnet18().train()
    prepared = {}
    for capture in ("fx", "export"):
        qmodel = prepare_by_platform(float_model, "tensorrt", {"capture": capture, "example_inputs": (x,)})
        enable_calibration(qmodel)
        with torch.no_grad():
            qmodel(x)
        enable_quantization(qmodel)
        prepared[capture] = qmodel.train()
    functions = {
        "float": sgd_step(float_model, x, y),
        "fx": sgd_step(prepared["fx"], x, y),
        "export": sgd_step(prepared["export"], x, y),
    }
    samples = interleaved_samples(functions, repeats, warmup=2)
    export_ratio = paired_ratio(samples, "export", "float")
    return {
        "float_step_s": round(statistics.median(samples["float"]), 4),
        "export_over_float": round(export_ratio, 3),
        "fx_over_float": round(paired_ratio(samples, "fx", "float"), 3),
        "export_over_fx": round(paired_ratio(samples, "export", "fx"), 3),
        "target": QAT_TARGET,
        "meets_target": export_ratio <= QAT_TARGET,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(THREADS)
    warnings.simplefilter("ignore")
    started = time.time()
    prepare = prepare_times(args.repeats)
    print_table(
        ["case", "fx s", "export s", "export / fx"],
        [[r["case"], r["fx_s"], r["export_s"], r["export_over_fx"]] for r in prepare],
    )
    qat = qat_step(args.repeats)
    print()
    print_table(
        ["QAT step (ResNet-18, 16x112x112)", "float s", "export / float", "fx / float", "target"],
        [["tensorrt", qat["float_step_s"], qat["export_over_float"], qat["fx_over_float"], f"<= {QAT_TARGET}"]],
    )
    path = write_json(
        "capture_speed",
        {"prepare": prepare, "qat_step": qat, "repeats": args.repeats, "seconds": round(time.time() - started)},
    )
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
