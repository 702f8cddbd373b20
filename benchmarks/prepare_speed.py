"""Speed of prepare_by_platform and of the models it produces, in one run, with two threads.

1. QAT step of ResNet-18 (batch 16, 112x112, random data and labels, SGD: forward,
   cross-entropy, backward, step) prepared for Tensorrt in train mode (QAT, BN folding),
   calibrated on one batch, vs the float model's step: target <= 1.3x. PyTorch's own FX
   QAT (torch.ao prepare_qat_fx, fbgemm default QAT qconfig mapping) is measured the
   same way as a reference (expected around 1.35x).
2. Calibration forward (observers on, fake quant off, MinMax observers, no_grad) of
   ResNet-18 prepared in eval mode vs the float eval forward: target <= 1.5x.
3. prepare_by_platform(resnet50().eval(), Tensorrt) wall time: target < 1 s (median).
4. Scaling: prepare time of a Conv2d(8, 8, 3)+BatchNorm2d+ReLU sequential net of
   100 / 1,000 / 5,000 conv layers (eval mode, Tensorrt), per layer; the per-layer time
   at 5,000 over that at 100 should stay near 1 (flagged above 2x). Each size runs in a
   child process with a 120 s limit per prepare, so a blow-up is reported, not waited out.

All comparisons interleave repeats and take medians. Prints a table and writes
benchmarks/results/prepare_speed.json.

Run: .venv/bin/python benchmarks/prepare_speed.py [--repeats N]
"""

from __future__ import annotations

import argparse
import copy
import multiprocessing as mp
import os
import statistics
import time
import warnings
from collections.abc import Callable

import torch
from torch import nn

from _timing import print_table, time_interleaved, write_json
from mqbench.models import resnet18, resnet50
from mqbench.prepare_by_platform import BackendType, prepare_by_platform
from mqbench.utils.memory import keep_freed_memory
from mqbench.utils.state import enable_calibration, enable_quantization

THREADS = 2
BATCH, SIZE = 16, 112
MINMAX = {"extra_qconfig_dict": {"a_observer": "MinMaxObserver", "w_observer": "MinMaxObserver"}}
SCALING_SIZES = (100, 1_000, 5_000)
SCALING_LIMIT_S = 120.0  # one prepare slower than this is reported as impractical
SCALING_BUDGET_S = 20.0  # further runs of one size only while its total stays under this
SCALING_FLAG = 2.0

QAT_TARGET = 1.3
CALIBRATION_TARGET = 1.5
RESNET50_TARGET_S = 1.0


def _quiet_torch_ao() -> None:
    warnings.filterwarnings("ignore", message=r"torch\.ao\.quantization is deprecated", category=DeprecationWarning)
    warnings.filterwarnings("ignore", message=r"Please use quant_min and quant_max", category=UserWarning)


def sgd_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    def run() -> None:
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()

    return run


def no_grad_forward(model: nn.Module, x: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        with torch.no_grad():
            model(x)

    return run


def measure_qat(x: torch.Tensor, y: torch.Tensor, repeats: int) -> dict[str, float]:
    float_model = resnet18().train()
    mq_model = prepare_by_platform(float_model, BackendType.Tensorrt)  # train mode -> QAT, BN folding
    enable_calibration(mq_model)
    with torch.no_grad():
        mq_model(x)
    enable_quantization(mq_model)
    mq_model.train()

    # torch.ao is imported for this reference only; the package itself does not use it
    from torch.ao.quantization import get_default_qat_qconfig_mapping
    from torch.ao.quantization.quantize_fx import prepare_qat_fx

    ao_model = prepare_qat_fx(copy.deepcopy(float_model), get_default_qat_qconfig_mapping("fbgemm"), (x,))
    ao_model.train()  # PyTorch's default QAT recipe: observers and fake quant both on

    return time_interleaved(
        {
            "float": sgd_step(float_model, x, y),
            "mqbench": sgd_step(mq_model, x, y),
            "torch.ao": sgd_step(ao_model, x, y),
        },
        repeats,
        warmup=2,
    )


def measure_calibration(x: torch.Tensor, repeats: int) -> dict[str, float]:
    float_model = resnet18().eval()
    mq_model = prepare_by_platform(float_model, BackendType.Tensorrt, prepare_custom_config_dict=MINMAX)
    enable_calibration(mq_model)
    return time_interleaved(
        {"float": no_grad_forward(float_model, x), "mqbench": no_grad_forward(mq_model, x)}, repeats, warmup=2
    )


def measure_resnet50_prepare(repeats: int) -> float:
    model = resnet50().eval()
    times = time_interleaved({"prepare": lambda: prepare_by_platform(model, BackendType.Tensorrt)}, repeats, warmup=1)
    return times["prepare"]


def conv_net(layers: int) -> nn.Sequential:
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()]
    return nn.Sequential(*blocks).eval()


def _scaling_worker(layers: int, runs: int, conn) -> None:
    """Child process: build the net once, then send the seconds of each prepare as it finishes."""
    torch.set_num_threads(THREADS)
    warmup = conv_net(50)
    for _ in range(2):  # one-time costs (lazy imports, caches, allocator) paid here, not in the first timed run
        prepare_by_platform(warmup, BackendType.Tensorrt)
    model = conv_net(layers)
    conn.send(("ready", 0.0))
    total = 0.0
    for _ in range(runs):
        start = time.perf_counter()
        prepare_by_platform(model, BackendType.Tensorrt)
        elapsed = time.perf_counter() - start
        total += elapsed
        conn.send(("run", elapsed))
        if total + elapsed > SCALING_BUDGET_S:
            break
    conn.send(("done", total))


def measure_scaling(layers: int, runs: int) -> dict[str, object]:
    """Median prepare seconds for one size; status "timed_out" when one prepare exceeds SCALING_LIMIT_S."""
    context = mp.get_context("spawn")
    parent, child = context.Pipe(duplex=False)
    process = context.Process(target=_scaling_worker, args=(layers, runs, child), daemon=True)
    process.start()
    child.close()
    samples: list[float] = []
    status = "ok"
    try:
        if not parent.poll(SCALING_LIMIT_S):  # building the net should never take this long either
            status = "timed_out"
        else:
            parent.recv()  # "ready"
            while True:
                if not parent.poll(SCALING_LIMIT_S):
                    status = "timed_out"
                    break
                kind, value = parent.recv()
                if kind == "done":
                    break
                samples.append(value)
    except EOFError:  # the child died (an exception, or out of memory)
        status = "ok" if samples else "failed"
    finally:
        process.join(timeout=None if status == "ok" else 0)
        if process.is_alive():
            process.terminate()
            process.join()
    median = statistics.median(samples) if samples else None
    return {
        "layers": layers,
        "runs": len(samples),
        "seconds": samples,
        "median_s": median,
        "per_layer_ms": None if median is None else median / layers * 1e3,
        "status": status,
        "exitcode": process.exitcode,
    }


def fmt_s(seconds: float) -> str:
    return f"{seconds:.3f} s" if seconds >= 1 else f"{seconds * 1e3:.1f} ms"


def verdict(value: float, target: float) -> str:
    return "yes" if value <= target else "NO"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7, help="QAT step repeats; the others scale from it")
    args = parser.parse_args()
    repeats = max(1, args.repeats)
    torch.set_num_threads(THREADS)
    keep_freed_memory()
    torch.manual_seed(0)
    _quiet_torch_ao()
    start = time.perf_counter()
    load_before = os.getloadavg()

    x = torch.randn(BATCH, 3, SIZE, SIZE)
    y = torch.randint(0, 1000, (BATCH,))
    qat = measure_qat(x, y, repeats)
    calibration = measure_calibration(x, 2 * repeats)
    resnet50_s = measure_resnet50_prepare(max(3, (repeats + 1) // 2))
    scaling = [measure_scaling(n, runs) for n, runs in zip(SCALING_SIZES, (max(5, repeats), 3, 1), strict=True)]

    rows: list[list[object]] = []
    records: list[dict[str, object]] = []

    def add(quantity: str, value: str, baseline: str, ratio: float | None, target: str, met: bool | None, **extra):
        rows.append(
            [
                quantity,
                value,
                baseline,
                "-" if ratio is None else f"{ratio:.2f}x",
                target,
                "n/a" if met is None else ("yes" if met else "NO"),
            ]
        )
        records.append({"quantity": quantity, "ratio": ratio, "target": target, "met": met, **extra})

    qat_ratio = qat["mqbench"] / qat["float"]
    add(
        "QAT step ResNet-18 b16 112px, Tensorrt vs float",
        fmt_s(qat["mqbench"]),
        fmt_s(qat["float"]),
        qat_ratio,
        f"<= {QAT_TARGET}x",
        qat_ratio <= QAT_TARGET,
        mqbench_s=qat["mqbench"],
        baseline_s=qat["float"],
    )
    ao_ratio = qat["torch.ao"] / qat["float"]
    add(
        "  reference: torch.ao prepare_qat_fx (fbgemm) vs float",
        fmt_s(qat["torch.ao"]) + " (torch.ao)",
        fmt_s(qat["float"]),
        ao_ratio,
        "~1.35x expected",
        None,
        torch_ao_s=qat["torch.ao"],
        baseline_s=qat["float"],
    )
    add(
        "  mqbench QAT step vs torch.ao QAT step",
        fmt_s(qat["mqbench"]),
        fmt_s(qat["torch.ao"]) + " (torch.ao)",
        qat["mqbench"] / qat["torch.ao"],
        "-",
        None,
        mqbench_s=qat["mqbench"],
        torch_ao_s=qat["torch.ao"],
    )
    calibration_ratio = calibration["mqbench"] / calibration["float"]
    add(
        "calibration forward ResNet-18 (MinMax, no_grad) vs float",
        fmt_s(calibration["mqbench"]),
        fmt_s(calibration["float"]),
        calibration_ratio,
        f"<= {CALIBRATION_TARGET}x",
        calibration_ratio <= CALIBRATION_TARGET,
        mqbench_s=calibration["mqbench"],
        baseline_s=calibration["float"],
    )
    add(
        "prepare_by_platform(resnet50().eval(), Tensorrt)",
        fmt_s(resnet50_s),
        "-",
        None,
        f"< {RESNET50_TARGET_S:.0f} s",
        resnet50_s < RESNET50_TARGET_S,
        mqbench_s=resnet50_s,
    )
    base = scaling[0]
    base_per_layer = base["per_layer_ms"]
    for result in scaling:
        n, per_layer = result["layers"], result["per_layer_ms"]
        label = f"prepare {n:,}-layer conv net, per layer"
        if per_layer is None:
            add(
                label,
                f"> {SCALING_LIMIT_S:.0f} s: impractical"
                if result["status"] == "timed_out"
                else f"failed (exit code {result['exitcode']})",
                "-",
                None,
                "-",
                False,
                **result,
            )
            continue
        label += f" (total {fmt_s(result['median_s'])}, {result['runs']} run{'s' if result['runs'] > 1 else ''})"
        if result is base or base_per_layer is None:
            add(label, f"{per_layer:.3f} ms", "-", None, "-", None, **result)
            continue
        growth = per_layer / base_per_layer
        is_last = n == SCALING_SIZES[-1]
        add(
            label,
            f"{per_layer:.3f} ms",
            f"{base_per_layer:.3f} ms (100 layers)",
            growth,
            f"<= {SCALING_FLAG:.0f}x (~1 = linear)" if is_last else "-",
            growth <= SCALING_FLAG if is_last else None,
            **result,
        )

    print_table(["quantity", "mqbench", "baseline", "ratio", "target", "met"], rows)
    last = scaling[-1]
    if last["status"] == "timed_out":
        print(f"\n{last['layers']:,} layers: one prepare took over {SCALING_LIMIT_S:.0f} s; stopped (impractical).")
    elif base_per_layer is not None and last["per_layer_ms"] / base_per_layer > SCALING_FLAG:
        print(
            f"\nFLAG: per-layer prepare time grows {last['per_layer_ms'] / base_per_layer:.2f}x from 100 to "
            f"{last['layers']:,} layers (super-linear)."
        )
    elapsed = time.perf_counter() - start
    load_after = os.getloadavg()
    print(
        f"\nload average (1 min) {load_before[0]:.1f} at start, {load_after[0]:.1f} at end, on "
        f"{os.cpu_count()} CPUs: above ~{THREADS} other processes compete and the ratios get noisier"
    )
    path = write_json(
        "prepare_speed",
        {
            "setup": {"batch": BATCH, "input": [3, SIZE, SIZE], "threads": THREADS, "backend": "tensorrt"},
            "repeats": repeats,
            "results": records,
            "wall_s": elapsed,
            "load_average_1min": {"start": load_before[0], "end": load_after[0]},
        },
    )
    print(f"\nwrote {path} ({elapsed:.0f} s)")


if __name__ == "__main__":
    main()
