"""Side by side with each backend's vendor quantizer: the same models, the same crops, one run.

For each peer (NNCF for OpenVINO, ModelOpt for TensorRT, torchao for x86 CPUs) this script makes the peer's
scratch venv if it is missing (``make_venv.sh``), hands the peer the float model and the crops through files
(``.work/peers/<model>/``: the ``torch.export`` program ``float.pt2``, ``float.onnx``, the weights
``float_state.pt``, and ``data.pt`` with the
calibration crops, the evaluation crops and the float model's logits on them), runs the peer's script in its venv,
and quantizes the same model for the matching mqbench backend with its defaults (``prepare_by_platform``, then
``calibrate`` with the backend's ``ptq_recipe``) and deploys it (``convert_deploy``). Both deployed files are then
served on the runtime they share, in this process: top-1 agreement with the float model on every evaluation crop
(batch 1), and latency at batch 1, the two files' calls interleaved (median of the paired ratios as well).

* NNCF 3.4 (``nncf_openvino.py``: ``nncf.quantize`` defaults, an OpenVINO IR) beside the ``openvino`` backend's
  ``openvino_onnx`` file, both on OpenVINO's CPU plugin;
* ModelOpt 0.47 (``modelopt_tensorrt.py``: int8 Q/DQ ONNX for TensorRT) beside the ``tensorrt`` backend's Q/DQ
  ``onnx`` file, both on onnxruntime's CPU provider (no GPU here);
* torchao 0.18 (``torchao_x86.py``: pt2e with X86InductorQuantizer, ``torch.compile``) beside the ``onnx_qnn``
  backend's ``qlinear_onnx`` file on onnxruntime;
* AIMET 2.42 (``aimet_snpe.py``: cross-layer equalization, QuantSim with TF-enhanced ranges and the DSP
  configuration, encodings) beside the ``snpe`` backend; no SNPE runtime here, so both sides' own simulations.

torchao's compiled model cannot leave its process: its script measures its agreement and times it beside
mqbench's file on onnxruntime there. Quantize seconds are the peer's quantization call and mqbench's
``prepare_by_platform`` + ``calibrate`` (neither includes writing files).

Models: torchvision's ImageNet MobileNetV2 on photo crops (``--calibration`` crops of seed 1, ``--eval-crops`` of
seed 1000, as ``benchmarks/real_accuracy.py``), and the project's zoo ResNet-50 and ViT (trained on scikit-learn's
digits) on their calibration images and every held-out digit.

Run: .venv/bin/python benchmarks/peers/run.py [--peers nncf,modelopt,torchao] [--models mobilenet_v2,resnet50,vit]
Writes benchmarks/results/peers.json (or ``--output``).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from _timing import interleaved_samples, paired_ratio, print_table, write_json  # noqa: E402
from mqbench.advanced_ptq import calibrate  # noqa: E402
from mqbench.backends import PTQRecipe, resolve_backend  # noqa: E402
from mqbench.convert_deploy import convert_deploy  # noqa: E402
from mqbench.prepare_by_platform import prepare_by_platform  # noqa: E402
from mqbench.utils.host import describe_host, int8_pairs_saturate  # noqa: E402

WORK = HERE / ".work" / "peers"
BATCH = 32


@dataclass(frozen=True)
class Peer:
    name: str
    packages: tuple[str, ...]
    script: str
    backend: str  # the mqbench backend for the same hardware
    artifact: str  # the key of the mqbench file served beside the peer's
    # where both files are served: "openvino", "onnxruntime", "peer" (the peer's script times both), or
    # "simulation" (no runtime of the hardware here: each side's own simulation, no latency)
    runtime: str


PEERS = {
    "nncf": Peer(
        "nncf",
        ("torch", "nncf==3.4.*", f"openvino=={version('openvino')}"),
        "nncf_openvino.py",
        "openvino",
        "openvino_onnx",
        "openvino",
    ),
    "modelopt": Peer(
        "modelopt",
        ("torch", "nvidia-modelopt[onnx]==0.47.*", f"onnxruntime=={version('onnxruntime')}"),
        "modelopt_tensorrt.py",
        "tensorrt",
        "onnx",
        "onnxruntime",
    ),
    "torchao": Peer(
        "torchao",
        ("torch", "torchao==0.18.*", f"onnxruntime=={version('onnxruntime')}"),
        "torchao_x86.py",
        "onnx_qnn",
        "qlinear_onnx",
        "peer",
    ),
    "aimet": Peer(
        "aimet",
        ("torch", "TORCHVISION", "aimet-torch==2.42.0"),  # TORCHVISION: torchvision_without_extensions.py's copy
        "aimet_snpe.py",
        "snpe",
        "encodings",
        "simulation",
    ),
}
TORCHVISION = "torchvision==0.28.0"  # the release built against torch 2.13


@dataclass
class Task:
    name: str
    model: torch.nn.Module
    calibration: torch.Tensor
    evaluation: torch.Tensor


def load_task(name: str, args: argparse.Namespace) -> Task:
    if name == "mobilenet_v2":
        from mqbench.data import photo_crops, sample_photos
        from mqbench.models.pretrained import load_imagenet_mobilenet_v2

        photos = sample_photos(require_skimage=True)
        return Task(
            name,
            load_imagenet_mobilenet_v2().eval(),
            photo_crops(args.calibration, 1, photos=photos),
            photo_crops(args.eval_crops, 1000, photos=photos),
        )
    from mqbench.data import load_digits_split
    from mqbench.models.zoo import digits_rgb, zoo_model

    zoo = zoo_model(name)
    held_out = digits_rgb(load_digits_split()[1].images)  # every held-out digit (the zoo's own check takes 32)
    return Task(name, zoo.model.eval(), zoo.calibration, held_out)


def logits(model: torch.nn.Module, images: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([model(batch) for batch in images.split(BATCH)])


def write_work(task: Task) -> Path:
    """The files a peer reads: the float model as a ``torch.export`` program and as ONNX, and the crops."""
    folder = WORK / task.name
    folder.mkdir(parents=True, exist_ok=True)
    example = (task.calibration[:1],)
    torch.export.save(torch.export.export(task.model, example), folder / "float.pt2")
    torch.onnx.export(
        task.model,
        example,
        str(folder / "float.onnx"),
        input_names=["input"],
        output_names=["logits"],
        opset_version=17,
        dynamo=False,
    )
    torch.save(task.model.state_dict(), folder / "float_state.pt")  # for a peer that builds the model itself
    reference = logits(task.model, task.evaluation)
    torch.save(
        {"calibration": task.calibration, "evaluation": task.evaluation, "reference": reference}, folder / "data.pt"
    )
    return folder


def torchvision_copy() -> str:
    """torchvision's wheel for this torch without its compiled extensions (the registry's builds are CUDA ones)."""
    folder = WORK / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(folder / "cuda"), TORCHVISION], check=True
    )
    wheel = next((folder / "cuda").glob("torchvision-*.whl"))
    script = HERE / "torchvision_without_extensions.py"
    made = subprocess.run([sys.executable, str(script), str(wheel), str(folder)], check=True, capture_output=True)
    return made.stdout.decode().strip()


def ensure_venv(peer: Peer) -> Path:
    venv = HERE / f".venv-{peer.name}"
    if not (venv / "freeze.txt").exists():
        packages = [torchvision_copy() if name == "TORCHVISION" else name for name in peer.packages]
        print(f"making {venv.name}: {' '.join(packages)}", flush=True)
        subprocess.run(["bash", str(HERE / "make_venv.sh"), peer.name, *packages], check=True)
    return venv / "bin" / "python"


def run_peer(peer: Peer, folder: Path, extra: list[str]) -> dict[str, Any]:
    out = folder / peer.name
    command = [str(ensure_venv(peer)), str(HERE / peer.script), str(folder), str(out), *extra]
    completed = subprocess.run(command, capture_output=True, text=True)
    if completed.returncode != 0:
        tail = (completed.stdout + completed.stderr)[-3000:]
        raise RuntimeError(f"{peer.script} failed with status {completed.returncode}:\n{tail}")
    record = json.loads((out / f"{peer.name}.json").read_text())
    record["path"] = str(out / record["artifact"]) if "artifact" in record else None
    return record


def mqbench_side(
    task: Task, backend: str, folder: Path, recipe: PTQRecipe | None = None
) -> tuple[float, Any, torch.nn.Module]:
    start = time.perf_counter()
    quantized = prepare_by_platform(copy.deepcopy(task.model), backend)
    calibrate(quantized, list(task.calibration.split(BATCH)), recipe=recipe)
    seconds = time.perf_counter() - start
    output = folder / f"mqbench_{backend}{'' if recipe is None else '_vnni'}"
    result = convert_deploy(quantized, backend, dummy_input=task.calibration[:1], output_path=output)
    return seconds, result, quantized


# -- serving ---------------------------------------------------------------------------------------------------
def openvino_runner(path: str, threads: int, integer: bool = True) -> Callable[[np.ndarray], np.ndarray]:
    """The file compiled for OpenVINO's CPU plugin; ``integer=False`` turns its low-precision transformations
    off, so that each FakeQuantize is computed as written (what int8 kernels compute where their sums do not saturate,
    on a CPU with VNNI)."""
    import openvino as ov

    config = {"INFERENCE_NUM_THREADS": threads, "INFERENCE_PRECISION_HINT": "f32", "LP_TRANSFORMS_MODE": integer}
    compiled = ov.Core().compile_model(str(path), "CPU", config)
    request = compiled.create_infer_request()

    def run(x: np.ndarray) -> np.ndarray:
        return np.asarray(request.infer([x])[compiled.output(0)])

    return run


def onnxruntime_runner(path: str, threads: int) -> Callable[[np.ndarray], np.ndarray]:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name

    def run(x: np.ndarray) -> np.ndarray:
        return np.asarray(session.run(None, {name: x})[0])

    return run


RUNNERS = {"openvino": openvino_runner, "onnxruntime": onnxruntime_runner}


def agreement(run: Callable[[np.ndarray], np.ndarray], images: torch.Tensor, reference: torch.Tensor) -> float:
    outputs = np.concatenate([run(np.ascontiguousarray(image[None].numpy())) for image in images])
    return float((outputs.argmax(1) == reference.argmax(1).numpy()).mean())


def compare(peer: Peer, task: Task, folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    reference = torch.load(folder / "data.pt", weights_only=True)["reference"]
    seconds, result, quantized = mqbench_side(task, peer.backend, folder)
    mine = result.artifacts[peer.artifact]
    row: dict[str, Any] = {"backend": peer.backend, "mqbench": {"seconds": seconds, "artifact": mine}}
    extra = ["--onnx", mine] if peer.runtime == "peer" else []
    record = run_peer(peer, folder, extra)
    row["peer"] = record
    if peer.runtime == "simulation":
        row["runtime"] = "simulation"
        outputs = logits(quantized.eval(), task.evaluation)
        row["mqbench"]["top1_agreement"] = float((outputs.argmax(1) == reference.argmax(1)).float().mean())
        return row
    if peer.runtime == "peer":
        row["runtime"] = f"{record['runtime']} / onnxruntime"
        row["mqbench"]["top1_agreement"] = agreement(onnxruntime_runner(mine, args.threads), task.evaluation, reference)
        row["mqbench"]["latency_ms"] = record["latency_ms"].pop("onnx")
        record["latency_ms"] = record["latency_ms"]["torchao"]
        return row
    row["runtime"] = peer.runtime
    runners = {
        "peer": RUNNERS[peer.runtime](record["path"], args.threads),
        "mqbench": RUNNERS[peer.runtime](mine, args.threads),
    }
    for side, run in runners.items():
        (record if side == "peer" else row["mqbench"])["top1_agreement"] = agreement(run, task.evaluation, reference)
    if peer.runtime == "openvino":  # the files' own arithmetic, which a CPU with VNNI runs in int8 as well
        for side, path in (("peer", record["path"]), ("mqbench", mine)):
            exact = agreement(openvino_runner(path, args.threads, integer=False), task.evaluation, reference)
            (record if side == "peer" else row["mqbench"])["top1_agreement_exact"] = exact
        spec = resolve_backend(peer.backend)
        if spec.ptq_recipe.guard_pair_saturation and int8_pairs_saturate():
            # the file calibration makes on a host with VNNI (no 7-bit guard), as that host would serve it
            _, vnni, _ = mqbench_side(task, peer.backend, folder, replace(spec.ptq_recipe, guard_pair_saturation=False))
            served = openvino_runner(vnni.artifacts[peer.artifact], args.threads, integer=False)
            row["mqbench"]["top1_agreement_vnni_recipe"] = agreement(served, task.evaluation, reference)
    sample = np.ascontiguousarray(task.evaluation[:1].numpy())
    samples = interleaved_samples({side: (lambda run=run: run(sample)) for side, run in runners.items()}, args.repeats)
    record["latency_ms"] = 1000 * statistics.median(samples["peer"])
    row["mqbench"]["latency_ms"] = 1000 * statistics.median(samples["mqbench"])
    row["latency_ratio"] = paired_ratio(samples, "mqbench", "peer")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", default=",".join(PEERS))
    parser.add_argument("--models", default="mobilenet_v2,resnet50,vit")
    parser.add_argument("--calibration", type=int, default=64, help="MobileNetV2's calibration crops")
    parser.add_argument("--eval-crops", type=int, default=256, help="MobileNetV2's evaluation crops")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=50, help="latency calls of each file")
    parser.add_argument("--output", default="peers")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    peers = [PEERS[name] for name in args.peers.split(",")]
    rows: list[dict[str, Any]] = []
    for model in args.models.split(","):
        task = load_task(model, args)
        folder = write_work(task)
        for peer in peers:
            try:
                row = compare(peer, task, folder, args)
            except Exception as error:  # a peer that cannot do a model is a row that says why
                row = {"backend": peer.backend, "error": f"{type(error).__name__}: {error}"[-2000:]}
            row.update(model=model, peer_name=peer.name)
            rows.append(row)
            print(json.dumps(row, default=str)[:600], flush=True)
    table = []
    for row in rows:
        if "error" in row:
            table.append([row["model"], row["backend"], row["peer_name"], "failed: " + row["error"][:80], "", "", ""])
            continue
        peer, mine = row["peer"], row["mqbench"]
        exact = (
            f"{peer['top1_agreement_exact']:.3f} / {mine['top1_agreement_exact']:.3f}"
            if "top1_agreement_exact" in mine
            else "-"
        )
        if "top1_agreement_vnni_recipe" in mine:
            exact += f" ({mine['top1_agreement_vnni_recipe']:.3f} made on VNNI)"
        table.append(
            [
                row["model"],
                row["backend"],
                row["peer_name"],
                f"{peer['top1_agreement']:.3f} / {mine['top1_agreement']:.3f}",
                exact,
                f"{peer['seconds']:.1f} / {mine['seconds']:.1f}",
                f"{peer['latency_ms']:.2f} / {mine['latency_ms']:.2f} ({row['runtime']})"
                if "latency_ms" in mine
                else f"- ({row['runtime']})",
            ]
        )
    print(f"\n{describe_host()}")
    print_table(
        [
            "model",
            "backend",
            "peer",
            "top-1 agreement peer / mqbench",
            "as written (VNNI)",
            "quantize s peer / mqbench",
            "latency ms b1",
        ],
        table,
    )
    path = write_json(args.output, {"args": vars(args), "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
