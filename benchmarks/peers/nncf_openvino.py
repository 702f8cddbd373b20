"""NNCF's standard post-training recipe for OpenVINO on one image classifier or text encoder: quantize, save the IR.

Runs in benchmarks/peers/.venv-nncf (``make_venv.sh nncf``), never in the project's venv, and does not import
mqbench: the model comes as the float model's ``torch.export`` program and the crops as tensors, both written by
``run.py``. The recipe is NNCF's documented default for a CNN on OpenVINO: ``ov.convert_model`` of the float
model, then ``nncf.quantize(model, nncf.Dataset(samples))`` with every argument left at its default (preset
PERFORMANCE: symmetric int8, per-channel weights; activations at the mean over samples of each sample's
min / max; fast bias correction; target device ANY). The calibration samples are the crops one at a time, as
NNCF's examples feed a data loader of batch 1. A text encoder (``float.onnx`` with token inputs) gets NNCF's
transformer preset, ``nncf.quantize(model, dataset, model_type=nncf.ModelType.TRANSFORMER)`` (preset MIXED:
asymmetric activations; SmoothQuant; the ops NNCF leaves float in transformers), calibrated on one sentence at a
time without its padding. ``seconds`` is ``nncf.quantize`` alone.

Writes ``<out>/nncf.xml`` / ``.bin`` and ``<out>/nncf.json``; ``run.py`` serves the IR beside mqbench's artifact.
"""

from __future__ import annotations

import json
import time
from importlib.metadata import version

import nncf
import openvino as ov
import torch
from peer_io import peer_parser, read_work


def main() -> None:
    args = peer_parser(__doc__).parse_args()
    data = read_work(args)
    calibration = data["calibration"]
    options = {}
    if isinstance(calibration, dict):  # a text encoder: token inputs by name, each sentence without its padding
        float_model = ov.convert_model(args.work / "float.onnx")
        lengths = calibration["attention_mask"].sum(1).tolist()
        samples = [
            {name: tensor[row : row + 1, :length].numpy() for name, tensor in calibration.items()}
            for row, length in enumerate(lengths)
        ]
        options["model_type"] = nncf.ModelType.TRANSFORMER
    else:
        float_model = ov.convert_model(torch.export.load(args.work / "float.pt2"))
        samples = [sample[None].numpy() for sample in calibration]
    start = time.perf_counter()
    quantized = nncf.quantize(float_model, nncf.Dataset(samples), **options)
    seconds = time.perf_counter() - start
    args.out.mkdir(parents=True, exist_ok=True)
    ov.save_model(quantized, args.out / "nncf.xml", compress_to_fp16=False)
    record = {
        "peer": "nncf",
        "versions": {name: version(name) for name in ("nncf", "openvino", "torch")},
        "recipe": "ov.convert_model, nncf.quantize(model, nncf.Dataset(samples one at a time)) with its defaults"
        + (", model_type=TRANSFORMER" if options else ""),
        "seconds": seconds,
        "artifact": "nncf.xml",
        "runtime": "openvino",
    }
    (args.out / "nncf.json").write_text(json.dumps(record, indent=2))
    print(json.dumps(record))


if __name__ == "__main__":
    main()
