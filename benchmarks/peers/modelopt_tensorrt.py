"""ModelOpt's standard int8 recipe for TensorRT on one image classifier or text encoder: a Q/DQ ONNX file.

Runs in benchmarks/peers/.venv-modelopt (``make_venv.sh modelopt``), never in the project's venv, and does not
import mqbench: the float model comes as ONNX and the crops as tensors, both written by ``run.py``. The recipe is
``modelopt.onnx.quantization.quantize(float.onnx, quantize_mode="int8", calibration_data=crops)`` with its
defaults (entropy calibration of the activations, per-channel symmetric weights, Q/DQ in front of the ops
TensorRT runs in int8), except two settings this host needs: ``calibration_eps=["cpu"]`` (no GPU here) and
``high_precision_dtype="fp32"`` (its default casts the ops left unquantized to fp16, which TensorRT runs on a GPU
but onnxruntime's CPU kernels mostly do not; the int8 ops are the same either way). ``seconds`` is ``quantize``.
A text encoder's calibration data is its token inputs by name (one padded batch of the calibration sentences).

Writes ``<out>/modelopt.onnx`` and ``<out>/modelopt.json``; ``run.py`` serves the file on onnxruntime beside
mqbench's TensorRT Q/DQ file.
"""

from __future__ import annotations

import json
import time
from importlib.metadata import version

from modelopt.onnx.quantization import quantize
from peer_io import peer_parser, read_work


def main() -> None:
    args = peer_parser(__doc__).parse_args()
    data = read_work(args)
    args.out.mkdir(parents=True, exist_ok=True)
    output = args.out / "modelopt.onnx"
    calibration = data["calibration"]
    if isinstance(calibration, dict):  # a text encoder's token inputs by name
        calibration = {name: tensor.numpy() for name, tensor in calibration.items()}
    else:
        calibration = calibration.numpy()
    start = time.perf_counter()
    quantize(
        str(args.work / "float.onnx"),
        quantize_mode="int8",
        calibration_data=calibration,
        calibration_eps=["cpu"],
        high_precision_dtype="fp32",
        output_path=str(output),
        log_level="WARNING",
    )
    seconds = time.perf_counter() - start
    record = {
        "peer": "modelopt",
        "versions": {name: version(name) for name in ("nvidia-modelopt", "onnxruntime", "onnx", "torch")},
        "recipe": "modelopt.onnx.quantization.quantize(quantize_mode='int8') defaults; CPU calibration, fp32 rest",
        "seconds": seconds,
        "artifact": output.name,
        "runtime": "onnxruntime",
    }
    (args.out / "modelopt.json").write_text(json.dumps(record, indent=2))
    print(json.dumps(record))


if __name__ == "__main__":
    main()
