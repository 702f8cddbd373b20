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
digits) on their calibration images and every held-out digit; all-MiniLM-L6-v2 (``minilm``, against NNCF's
transformer preset and ModelOpt) on the standard library's docstrings, scored by the mean cosine of its sentence
embeddings with the float model's.

Run: .venv/bin/python benchmarks/peers/run.py [--peers nncf,modelopt,torchao,aimet] [--models mobilenet_v2,...,minilm]
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
from mqbench.advanced_ptq.calibration import recipe_of  # noqa: E402
from mqbench.backends import PTQRecipe  # noqa: E402
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
    text_backend: str | None = None  # the mqbench backend beside the peer on a text encoder (None: images only)


PEERS = {
    "nncf": Peer(
        "nncf",
        ("torch", "nncf==3.4.*", f"openvino=={version('openvino')}"),
        "nncf_openvino.py",
        "openvino",
        "openvino_onnx",
        "openvino",
        "openvino",
    ),
    "modelopt": Peer(
        "modelopt",
        ("torch", "nvidia-modelopt[onnx]==0.47.*", f"onnxruntime=={version('onnxruntime')}"),
        "modelopt_tensorrt.py",
        "tensorrt",
        "onnx",
        "onnxruntime",
        "tensorrt_nlp",
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
    calibration: Any  # images [N, 3, H, W], or a text encoder's token batches (dicts of input_ids, ...)
    evaluation: Any  # images, or one token dict per sentence (batch 1, unpadded)
    peer_calibration: Any = None  # a text encoder's calibration sentences as one padded batch, for the peers


class LastHiddenState(torch.nn.Module):
    """A Hugging Face encoder with positional token inputs and one output, as the peers take it from ONNX."""

    def __init__(self, encoder: torch.nn.Module) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor):
        return self.encoder(
            input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
        ).last_hidden_state


def load_text_task(args: argparse.Namespace) -> Task:
    """all-MiniLM-L6-v2 on the standard library's docstrings: every fifth one calibrates, the rest evaluate."""
    from mqbench.models.sentence_embedding import load_minilm, stdlib_docstrings, tokenized_batches

    encoder, tokenizer = load_minilm()
    texts = stdlib_docstrings()
    calibration = texts[0::5][: args.sentences]
    held_out = [text for i, text in enumerate(texts) if i % 5]
    padded = tokenizer(calibration, padding=True, truncation=True, return_tensors="pt")
    return Task(
        "minilm",
        LastHiddenState(encoder).eval(),  # both sides quantize the same function (no pooler head)
        tokenized_batches(tokenizer, calibration),
        tokenized_batches(tokenizer, held_out, batch_size=1),
        {key: padded[key] for key in TOKENS},
    )


TOKENS = ("input_ids", "attention_mask", "token_type_ids")


def is_text(task: Task) -> bool:
    return task.peer_calibration is not None


def load_task(name: str, args: argparse.Namespace) -> Task:
    if name == "minilm":
        return load_text_task(args)
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


def logits(model: torch.nn.Module, images: Any) -> torch.Tensor:
    """An image classifier's logits, or a text encoder's sentence embeddings (mean-pooled, normalised)."""
    if isinstance(images, list):
        from mqbench.models.sentence_embedding import sentence_embeddings

        return sentence_embeddings(model, images)
    with torch.no_grad():
        return torch.cat([model(batch) for batch in images.split(BATCH)])


def write_work(task: Task) -> Path:
    """The files a peer reads: the float model as a ``torch.export`` program and as ONNX, and the crops."""
    folder = WORK / task.name
    folder.mkdir(parents=True, exist_ok=True)
    if is_text(task):
        return write_text_work(task, folder)
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


def write_text_work(task: Task, folder: Path) -> Path:
    """A text encoder for the peers: ONNX with token inputs (batch and sequence dynamic), the calibration
    sentences as one padded batch, each held-out sentence alone, and the float sentence embeddings."""
    example = tuple(task.evaluation[0][key] for key in TOKENS)
    axes = {name: {0: "batch", 1: "sequence"} for name in TOKENS} | {"last_hidden_state": {0: "batch", 1: "sequence"}}
    torch.onnx.export(
        task.model,
        example,
        str(folder / "float.onnx"),
        input_names=list(TOKENS),
        output_names=["last_hidden_state"],
        dynamic_axes=axes,
        opset_version=17,
        dynamo=False,
    )
    reference = logits(task.model, task.evaluation)
    data = {"calibration": task.peer_calibration, "evaluation": task.evaluation, "reference": reference}
    torch.save(data, folder / "data.pt")
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
    if is_text(task):  # keyword token inputs, captured with torch.export
        batches, example = task.calibration, task.calibration[0]
        config: dict[str, Any] | None = {"capture": "export", "example_inputs": example}
    else:
        batches, example, config = list(task.calibration.split(BATCH)), task.calibration[:1], None
    start = time.perf_counter()
    quantized = prepare_by_platform(copy.deepcopy(task.model), backend, config)
    calibrate(quantized, batches, recipe=recipe)
    seconds = time.perf_counter() - start
    output = folder / f"mqbench_{backend}{'' if recipe is None else '_vnni'}"
    result = convert_deploy(quantized, backend, dummy_input=example, output_path=output)
    return seconds, result, quantized


# -- serving ---------------------------------------------------------------------------------------------------
Runner = Callable[[tuple[np.ndarray, ...]], np.ndarray]  # the model's inputs in order -> its first output


def openvino_runner(path: str, threads: int, integer: bool = True) -> Runner:
    """The file compiled for OpenVINO's CPU plugin; ``integer=False`` turns its low-precision transformations
    off, so that each FakeQuantize is computed as written (what int8 kernels compute where their sums do not saturate,
    on a CPU with VNNI)."""
    import openvino as ov

    config = {"INFERENCE_NUM_THREADS": threads, "INFERENCE_PRECISION_HINT": "f32", "LP_TRANSFORMS_MODE": integer}
    compiled = ov.Core().compile_model(str(path), "CPU", config)
    request = compiled.create_infer_request()

    def run(inputs: tuple[np.ndarray, ...]) -> np.ndarray:
        return np.asarray(request.infer(list(inputs))[compiled.output(0)])

    return run


def onnxruntime_runner(path: str, threads: int) -> Runner:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    names = [item.name for item in session.get_inputs()]

    def run(inputs: tuple[np.ndarray, ...]) -> np.ndarray:
        return np.asarray(session.run(None, dict(zip(names, inputs, strict=True)))[0])

    return run


RUNNERS = {"openvino": openvino_runner, "onnxruntime": onnxruntime_runner}


def samples_of(evaluation: Any) -> list[tuple[np.ndarray, ...]]:
    """Each evaluation sample as a runtime's inputs (batch 1)."""
    if isinstance(evaluation, list):
        return [tuple(np.ascontiguousarray(item[key].numpy()) for key in TOKENS) for item in evaluation]
    return [(np.ascontiguousarray(image[None].numpy()),) for image in evaluation]


def agreement(run: Runner, evaluation: Any, reference: torch.Tensor) -> float:
    """Top-1 agreement with the float logits, or a text encoder's mean cosine with the float sentence embeddings
    (its output mean-pooled over the attention mask, then normalised)."""
    samples = samples_of(evaluation)
    if isinstance(evaluation, list):
        cosines = []
        for inputs, expected in zip(samples, reference, strict=True):
            hidden, mask = run(inputs)[0], inputs[1][0][:, None].astype(np.float64)
            pooled = (hidden * mask).sum(0) / mask.sum()
            cosines.append(float(pooled @ expected.double().numpy() / np.linalg.norm(pooled)))
        return statistics.fmean(cosines)
    outputs = np.concatenate([run(inputs) for inputs in samples])
    return float((outputs.argmax(1) == reference.argmax(1).numpy()).mean())


def compare(peer: Peer, task: Task, folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    reference = torch.load(folder / "data.pt", weights_only=True)["reference"]
    backend = peer.text_backend if is_text(task) else peer.backend
    assert backend is not None, f"{peer.name} is compared on image classifiers only"
    seconds, result, quantized = mqbench_side(task, backend, folder)
    mine = result.artifacts[peer.artifact]
    row: dict[str, Any] = {"backend": backend, "mqbench": {"seconds": seconds, "artifact": mine}}
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
        recipe = recipe_of(quantized)  # the backend's recipe for this model (a transformer's has its own)
        if recipe.guard_pair_saturation and int8_pairs_saturate():
            # the file calibration makes on a host with VNNI (no 7-bit guard), as that host would serve it
            _, vnni, _ = mqbench_side(task, backend, folder, replace(recipe, guard_pair_saturation=False))
            served = openvino_runner(vnni.artifacts[peer.artifact], args.threads, integer=False)
            row["mqbench"]["top1_agreement_vnni_recipe"] = agreement(served, task.evaluation, reference)
    inputs = samples_of(task.evaluation)
    sample = sorted(inputs, key=lambda item: item[0].shape[-1])[len(inputs) // 2]  # a sentence of median length
    samples = interleaved_samples({side: (lambda run=run: run(sample)) for side, run in runners.items()}, args.repeats)
    record["latency_ms"] = 1000 * statistics.median(samples["peer"])
    row["mqbench"]["latency_ms"] = 1000 * statistics.median(samples["mqbench"])
    row["latency_ratio"] = paired_ratio(samples, "mqbench", "peer")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", default=",".join(PEERS))
    parser.add_argument("--models", default="mobilenet_v2,resnet50,vit,minilm")
    parser.add_argument("--sentences", type=int, default=128, help="MiniLM's calibration sentences")
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
            if is_text(task) and peer.text_backend is None:
                continue  # compared on the image classifiers only
            try:
                row = compare(peer, task, folder, args)
            except Exception as error:  # a peer that cannot do a model is a row that says why
                row = {"backend": peer.backend, "error": f"{type(error).__name__}: {error}"[-2000:]}
            row.update(model=model, peer_name=peer.name, metric="mean_cosine" if is_text(task) else "top1_agreement")
            rows.append(row)
            print(json.dumps(row, default=str)[:600], flush=True)
    table = []
    for row in rows:
        if "error" in row:
            table.append([row["model"], row["backend"], row["peer_name"], "failed: " + row["error"][:80], "", "", ""])
            continue
        peer, mine = row["peer"], row["mqbench"]
        digits = 4 if row["metric"] == "mean_cosine" else 3
        exact = (
            f"{peer['top1_agreement_exact']:.{digits}f} / {mine['top1_agreement_exact']:.{digits}f}"
            if "top1_agreement_exact" in mine
            else "-"
        )
        if "top1_agreement_vnni_recipe" in mine:
            exact += f" ({mine['top1_agreement_vnni_recipe']:.{digits}f} made on VNNI)"
        table.append(
            [
                row["model"],
                row["backend"],
                row["peer_name"],
                f"{peer['top1_agreement']:.{digits}f} / {mine['top1_agreement']:.{digits}f}",
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
            "top-1 agreement (minilm: mean cosine) peer / mqbench",
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
