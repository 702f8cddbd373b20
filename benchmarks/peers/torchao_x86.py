"""torchao's standard int8 recipe for x86 CPUs on one image classifier: pt2e with X86InductorQuantizer, compiled.

Runs in benchmarks/peers/.venv-torchao (``make_venv.sh torchao``), never in the project's venv, and does not
import mqbench: the float model comes as its ``torch.export`` program and the crops as tensors, both written by
``run.py``. The recipe is torchao's documented one: ``torch.export.export(model).module()``,
``prepare_pt2e(model, X86InductorQuantizer().set_global(get_default_x86_inductor_quantization_config()))``, one
pass over the calibration crops (one at a time), ``convert_pt2e``, then ``torch.compile`` with Inductor's
freezing on (which fuses the quantize / dequantize pairs into oneDNN int8 kernels). ``seconds`` is prepare,
calibration and convert; the compile, which the deployed model needs before its first call, is
``compile_seconds``.

torch.compile's model cannot leave this process, so this script also measures what ``run.py`` measures for the
other peers: top-1 agreement of the compiled model with the float logits on the evaluation crops (batch 1), and
its latency at batch 1 interleaved with the ONNX file given by ``--onnx`` on onnxruntime (2 threads, no
spinning), mqbench's artifact for the same CPU, so that both latencies come from one stretch of the machine.
"""

from __future__ import annotations

import json
import statistics
import time
from importlib.metadata import version
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
import torch._inductor.config as inductor_config
import torchao.quantization.pt2e.quantizer.x86_inductor_quantizer as x86
from peer_io import peer_parser, read_work
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e


def session(path: Path, threads: int) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def main() -> None:
    parser = peer_parser(__doc__)
    parser.add_argument("--onnx", type=Path, help="an ONNX file timed beside the compiled model")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    data = read_work(args)
    float_model = torch.export.load(args.work / "float.pt2").module()
    example = (data["calibration"][:1],)
    start = time.perf_counter()
    quantizer = x86.X86InductorQuantizer()
    quantizer.set_global(x86.get_default_x86_inductor_quantization_config())
    captured = torch.export.export(float_model, example).module()
    prepared = prepare_pt2e(captured, quantizer)
    with torch.no_grad():
        for batch in data["calibration"].split(1):  # the program was exported at batch 1 (a ViT's class token)
            prepared(batch)
    converted = convert_pt2e(prepared)
    seconds = time.perf_counter() - start
    inductor_config.freezing = True
    start = time.perf_counter()
    with torch.no_grad():
        compiled = torch.compile(converted)
        compiled(*example)
    compile_seconds = time.perf_counter() - start
    with torch.no_grad():
        outputs = torch.cat([compiled(sample[None]) for sample in data["evaluation"]])
    agreement = float((outputs.argmax(1) == data["reference"].argmax(1)).float().mean())
    record: dict[str, object] = {
        "peer": "torchao",
        "versions": {name: version(name) for name in ("torchao", "torch", "onnxruntime")},
        "recipe": "pt2e, X86InductorQuantizer default config, convert_pt2e, torch.compile (freezing)",
        "seconds": seconds,
        "compile_seconds": compile_seconds,
        "top1_agreement": agreement,
        "runtime": "torch.compile (Inductor, CPU)",
    }
    sample = data["evaluation"][:1]
    calls = {"torchao": lambda: compiled(sample)}
    if args.onnx is not None:
        onnx_session = session(args.onnx, args.threads)
        name = onnx_session.get_inputs()[0].name
        feed = {name: np.ascontiguousarray(sample.numpy())}
        calls["onnx"] = lambda: onnx_session.run(None, feed)
    times: dict[str, list[float]] = {name: [] for name in calls}
    with torch.no_grad():
        for _ in range(3):
            for call in calls.values():
                call()
        for _ in range(args.repeats):
            for name, call in calls.items():
                begin = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - begin)
    record["latency_ms"] = {name: 1000 * statistics.median(values) for name, values in times.items()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "torchao.json").write_text(json.dumps(record, indent=2))
    print(json.dumps(record))


if __name__ == "__main__":
    main()
