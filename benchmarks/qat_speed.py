"""QAT step cost against the float step per default fake quantizer, and the cost of DDP's synchronisation.

1. For every pair of (weight, activation) fake quantizers that a backend uses by default
   (LearnableFakeQuantize: TensorRT and most others; NNIEFakeQuantize; TqtFakeQuantize: Vitis;
   FixedFakeQuantize: STPU), ResNet-18 is prepared in training mode (BN folding) for the first
   backend using it, calibrated on one batch, and one SGD step (forward, cross-entropy, backward,
   step; batch 16, 112x112, 2 threads) is timed against the float model's step, interleaved; the
   ratio is the median over repeats of QAT step / float step within the repeat: target <= 1.2x.
   Measured twice in the run: first with the C library's default allocator, then with freed
   memory kept in the heap as ``mqbench qat`` runs (:func:`mqbench.utils.memory.keep_freed_memory`,
   which cannot be undone within a process).
2. DDP: two processes under ``torch.distributed.run`` (gloo, one thread each), the TensorRT QAT
   model with its BatchNorm synchronised as ``mqbench qat`` does; per rank, a step of the
   DistributedDataParallel-wrapped model against a step of the same model without any
   synchronisation (plain BatchNorm, no gradient all-reduce), interleaved: the overhead of
   synchronising gradients and batch statistics (freed memory kept, as ``mqbench qat`` runs).

Prints a table and writes benchmarks/results/qat_speed.json.
Run: .venv/bin/python benchmarks/qat_speed.py [--repeats 15] [--skip-ddp]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import torch
from torch import nn

from _timing import interleaved_samples, paired_ratio, time_interleaved, write_json
from mqbench.backends import ParamsTable
from mqbench.custom_quantizer.qconfig import resolve_qconfig
from mqbench.models import resnet18
from mqbench.prepare_by_platform import prepare_by_platform
from mqbench.utils.host import describe_host
from mqbench.utils.memory import keep_freed_memory
from mqbench.utils.state import enable_calibration, enable_quantization
from prepare_speed import sgd_step

BATCH, SIZE, THREADS = 16, 112, 2
TARGET = 1.2


def qat_model(backend: str, x: torch.Tensor) -> nn.Module:
    torch.manual_seed(0)
    model = prepare_by_platform(resnet18(num_classes=10).train(), backend)
    model.eval()
    enable_calibration(model)
    with torch.no_grad():
        model(x)
    enable_quantization(model)
    return model.train()


def default_pairs() -> dict[str, str]:
    """(weight / activation quantizer names) -> the first backend that uses them by default."""
    pairs: dict[str, str] = {}
    for name, spec in ParamsTable.items():
        if spec.weight is None:
            continue  # no default: the user's qconfig decides
        qconfig = resolve_qconfig(spec, None)
        pairs.setdefault(f"{qconfig.weight.cls.__name__} / {qconfig.activation.cls.__name__}", name)
    return pairs


def measure_steps(repeats: int) -> dict[str, dict[str, float | str]]:
    torch.manual_seed(0)
    x, y = torch.randn(BATCH, 3, SIZE, SIZE), torch.randint(0, 10, (BATCH,))
    float_model = resnet18(num_classes=10).train()
    rows: dict[str, dict[str, float | str]] = {}
    for pair, backend in default_pairs().items():
        model = qat_model(backend, x)
        samples = interleaved_samples({"float": sgd_step(float_model, x, y), "qat": sgd_step(model, x, y)}, repeats, 2)
        times = {name: statistics.median(values) for name, values in samples.items()}
        rows[pair] = {"backend": backend, "qat_ms": 1e3 * times["qat"], "float_ms": 1e3 * times["float"]}
        rows[pair]["ratio"] = paired_ratio(samples, "qat", "float")
        rows[pair]["ratio_of_medians"] = times["qat"] / times["float"]
        print(f"  {pair:48s} ({backend}): {rows[pair]['ratio']:.2f}x", flush=True)
    return rows


def ddp_worker(repeats: int, output: str) -> None:
    """Runs in each of the torchrun processes."""
    import torch.distributed as dist

    from mqbench.app.distributed import Processes, synchronise_batch_norm

    torch.set_num_threads(1)
    keep_freed_memory()
    processes = Processes.from_env()
    torch.manual_seed(0)
    x, y = torch.randn(BATCH // 2, 3, SIZE, SIZE), torch.randint(0, 10, (BATCH // 2,))
    plain = qat_model("tensorrt", x)
    synced = synchronise_batch_norm(copy.deepcopy(plain))
    wrapped = nn.parallel.DistributedDataParallel(synced, find_unused_parameters=True)
    times = time_interleaved({"plain": sgd_step(plain, x, y), "ddp": sgd_step(wrapped, x, y)}, repeats, 2)
    gathered: list[dict[str, float] | None] = [None] * processes.world_size
    dist.all_gather_object(gathered, times)
    if processes.main:
        Path(output).write_text(json.dumps(gathered))
    processes.close()


def measure_ddp(repeats: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as folder:
        output = Path(folder) / "ddp.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
        command += [__file__, "--ddp-worker", "--repeats", str(repeats), "--worker-output", str(output)]
        environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parent)}
        subprocess.run(command, check=True, env=environment, capture_output=True, timeout=1200)
        ranks = json.loads(output.read_text())
    plain = max(r["plain"] for r in ranks)
    ddp = max(r["ddp"] for r in ranks)
    return {"plain_ms": 1e3 * plain, "ddp_ms": 1e3 * ddp, "overhead": ddp / plain - 1.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--skip-ddp", action="store_true")
    parser.add_argument("--ddp-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker-output", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    if args.ddp_worker:
        ddp_worker(args.repeats, args.worker_output)
        return
    torch.set_num_threads(THREADS)
    print(describe_host())
    print("C library's default allocator:")
    default = measure_steps(args.repeats)
    kept = keep_freed_memory()
    print("freed memory kept in the heap, as mqbench qat runs:" if kept else "allocator setting unavailable here:")
    steps = measure_steps(args.repeats)
    payload: dict[str, object] = {
        "batch": BATCH,
        "size": SIZE,
        "threads": THREADS,
        "steps": steps,
        "steps_default_allocator": default,
        "freed_memory_kept": kept,
    }
    print(
        "\n| default quantizers (weight / activation) | backend | QAT step ms | float step ms "
        f"| ratio (target <= {TARGET}) | ratio, default allocator |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for pair, row in steps.items():
        print(
            f"| {pair} | {row['backend']} | {row['qat_ms']:.1f} | {row['float_ms']:.1f} | {row['ratio']:.2f} "
            f"| {default[pair]['ratio']:.2f} |"
        )
    if not args.skip_ddp:
        ddp = measure_ddp(args.repeats)
        payload["ddp"] = ddp
        print(
            f"\nDDP, 2 processes (gloo, 1 thread each, batch {BATCH // 2} per process, TensorRT QAT ResNet-18): "
            f"step {ddp['ddp_ms']:.1f} ms vs {ddp['plain_ms']:.1f} ms unsynchronised, "
            f"overhead {100 * ddp['overhead']:.1f}%"
        )
    write_json("qat_speed", payload)


if __name__ == "__main__":
    main()
