"""Architectures nobody here wrote, through every step a user takes: prepare, calibrate, deploy, verify, and an
independent check of each model artifact as a user loads it (tests/fuzz/harness.py ``check_artifacts``).

The models come from timm (``timm.create_model(name, pretrained=False)``: random weights, as no weights can be
downloaded here; a user with weights passes ``--pretrained``). Calibration and verification images are crops of
scikit-learn's two bundled photos (``load_sample_images``), normalized as ImageNet models expect.

Statuses per model x backend: ``ok`` (verify passed, and every artifact computes the prepared model on another
image within the fuzz harness's bound, or where rounding ties alone carry the Q/DQ model as written past that
bound on this image, within 3x what they carry it: ``tie_floor`` in the JSON), ``capture`` (neither torch.fx nor
torch.export captures the model: a clear error naming both reasons and the remedies), ``clear_error`` (a
documented refusal),
``verify_failed``, ``silent`` (verify passed over an artifact that computes something else) and ``crash`` (an
internal error). Prints the table and writes benchmarks/results/model_coverage.json with the host facts.

Each model is prepared with ``capture="auto"`` and its calibration batch as ``example_inputs`` (torch.fx, and
torch.export where fx cannot trace it; ``--capture fx|export`` forces one); the JSON records which captured it.

``--transformers``: transformers decoders by model type instead (``transformers.AutoConfig.for_model``, shrunk to
2 layers of width 32, random weights): the prefill forward with right and left padding, deployed with dynamic
batch and sequence axes and verified on another shape, with the cosine of the quantized logits to float's.

Run: .venv/bin/python benchmarks/model_coverage.py [--models mobilenetv2_100,resnet18] [--backends openvino]
     (needs ``pip install timm``; timm imports torchvision)
     .venv/bin/python benchmarks/model_coverage.py --library mqbench [--output model_coverage_own]
     (the project's own ResNet-18/50 and MobileNets, where timm cannot be imported)
     .venv/bin/python benchmarks/model_coverage.py --transformers [--models gpt2,llama] [--output decoder_coverage]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))  # the fuzz harness's independent artifact check lives with the tests

from _timing import print_table, write_json  # noqa: E402

MODELS = (
    "mobilenetv2_100",
    "mobilenetv3_large_100",
    "mobilenetv3_small_100",
    "efficientnet_b0",
    "efficientnet_lite0",
    "regnetx_002",
    "regnety_002",
    "resnet18",
    "resnet50",
    "convnext_atto",
    "fastvit_t8",
    "mobileone_s0",
    "densenet121",
    "ghostnet_100",
    "mnasnet_100",
    "repvgg_a0",
    "rexnet_100",
    "lcnet_050",
    "edgenext_xx_small",
    "vit_tiny_patch16_224",
    "deit_tiny_patch16_224",
    "swin_tiny_patch4_window7_224",
    "inception_v3",
    "tf_efficientnet_lite0",
    "mobilevit_xxs",
    "levit_128s",
)
BACKENDS = ("openvino", "tensorrt", "snpe", "onnx_qnn", "academic")
# transformers decoders by model type (small configs, random weights): the prefill forward, token ids and a padded
# attention mask to logits, on the backends that run transformers
DECODERS = ("gpt2", "llama", "mistral", "qwen2", "opt", "phi", "gemma", "qwen3", "gpt_neox", "bloom", "falcon")
NLP_BACKENDS = ("tensorrt_nlp", "academic_nlp", "tensorrt", "openvino")
VOCAB = 64
STATUSES = ("ok", "capture", "clear_error", "verify_failed", "silent", "crash")


def images(count: int, size: int, seed: int) -> Any:
    """``count`` random crops of the two bundled photos, resized to ``size``, ImageNet-normalized."""
    import numpy as np
    import torch
    import torch.nn.functional as F
    from sklearn.datasets import load_sample_images

    photos = [torch.from_numpy(np.asarray(p, np.float32) / 255.0).permute(2, 0, 1) for p in load_sample_images().images]
    rng = np.random.default_rng(seed)
    crops = []
    for index in range(count):
        photo = photos[index % len(photos)]
        side = int(rng.integers(min(photo.shape[1:]) // 3, min(photo.shape[1:])))
        top = int(rng.integers(0, photo.shape[1] - side + 1))
        left = int(rng.integers(0, photo.shape[2] - side + 1))
        crop = photo[:, top : top + side, left : left + side][None]
        crops.append(F.interpolate(crop, size=(size, size), mode="bilinear", align_corners=False))
    batch = torch.cat(crops)
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    return (batch - mean) / std


def failed(case: dict[str, Any], error: Exception) -> None:
    """Record ``error`` as the case's result: ``capture`` (neither capture takes the model), or what the fuzz
    harness classifies it as (``clear_error``: a documented refusal of mqbench's; ``crash``, with the traceback)."""
    from fuzz.harness import classify_error
    from mqbench.utils.export_capture import CaptureError
    from mqbench.utils.tracer import TracingError

    if isinstance(error, (TracingError, CaptureError)):
        case["status"], case["message"] = "capture", str(error).splitlines()[0]
        return
    case["status"], case["location"] = classify_error(error)
    case["message"] = f"{type(error).__name__}: {str(error).strip()[:300]}"
    if case["status"] == "crash":
        case["traceback"] = traceback.format_exc()[-2000:]


# ``--library mqbench``: the project's own architectures, for hosts where timm cannot be imported (it imports
# torchvision); random weights with BatchNorm statistics measured on the calibration photos (as a trained model has)
OWN_MODELS = ("resnet18", "resnet50", "mobilenet_v2", "mobilenet_v3_small_style")


def make_model(name: str, library: str, pretrained: bool, photos: Any) -> Any:
    """``name`` from timm (random or pretrained weights), or from mqbench.models with BatchNorm statistics
    accumulated over ``photos`` in training mode."""
    import torch

    if library == "timm":
        import timm

        return timm.create_model(name, pretrained=pretrained).eval()
    from mqbench import models

    if pretrained:
        raise SystemExit("--pretrained takes timm's weights; mqbench's own architectures are built with random ones")
    model = getattr(models, name)()
    for module in model.modules():
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
            module.momentum = None  # a cumulative average over the photos
    model.train()
    with torch.no_grad():
        model(photos)
    return model.eval()


def run_case(
    name: str, backend: str, pretrained: bool, batches: int, capture: str = "auto", library: str = "timm"
) -> dict[str, Any]:
    import torch

    from backend_configs import host_config
    from fuzz.harness import MAX_RELATIVE, ArtifactMismatchError, check_artifacts, tie_floor
    from mqbench.convert_deploy import convert_deploy
    from mqbench.deploy.verify import verify_deploy
    from mqbench.prepare_by_platform import prepare_by_platform
    from mqbench.utils.state import enable_calibration, enable_quantization

    start = time.perf_counter()
    case: dict[str, Any] = {"model": name, "backend": backend, "status": "ok", "message": ""}
    torch.manual_seed(0)
    model = make_model(name, library, pretrained, images(16, 224, seed=2))
    size = int(getattr(model, "pretrained_cfg", {}).get("input_size", (3, 224, 224))[-1])
    calibration = images(4 * batches, size, seed=0).split(4)
    check = images(2, size, seed=1)
    stage = "prepare"
    with warnings.catch_warnings(), tempfile.TemporaryDirectory() as folder:
        warnings.simplefilter("ignore")
        try:
            config = {**(host_config(backend) or {}), "capture": capture, "example_inputs": calibration[0]}
            qmodel = prepare_by_platform(model, backend, config)
            case["capture"] = qmodel.mqbench_capture
            stage = "calibrate"
            enable_calibration(qmodel)
            with torch.no_grad():
                for batch in calibration:
                    qmodel(batch)
            enable_quantization(qmodel)
            stage = "deploy"
            result = convert_deploy(qmodel, backend, dummy_input=check[:1], output_path=folder)
            stage = "verify"
            report = verify_deploy(qmodel, result, check[:1], reference=True)
            case["max_lsb"] = float(report.max_lsb_diff)
            if not report.passed:
                case["status"], case["message"] = "verify_failed", "; ".join(report.failures())
            else:
                stage = "check"
                # where rounding ties alone carry the simulation's own arithmetic past the fuzz bound (deep
                # networks), the bound is 3x what they carry it on this input (the fuzz bound's own margin)
                case["tie_floor"] = tie_floor(qmodel, result, [check[1:]])
                bound = max(MAX_RELATIVE, 3 * case["tie_floor"])
                case["check_relative"] = check_artifacts(qmodel, result, [check[1:]], relative=bound)
        except ArtifactMismatchError as mismatch:
            case["status"], case["message"] = "silent", str(mismatch)
        except Exception as error:  # the benchmark's purpose: every failure becomes a result
            failed(case, error)
    case["stage"] = stage if case["status"] != "ok" else "done"
    case["seconds"] = round(time.perf_counter() - start, 1)
    return case


def small_decoder(model_type: str) -> Any:
    """A causal LM of ``model_type`` (a transformers model type such as ``llama``) with a small config: 2 layers
    of width 32, 2 heads (1 key/value head where the architecture groups them), a vocabulary of 64; eager
    attention, no KV cache, seed 0."""
    import torch
    import transformers

    config = transformers.AutoConfig.for_model(model_type)
    small = {
        ("hidden_size", "n_embd", "d_model"): 32,
        ("num_hidden_layers", "n_layer", "num_layers"): 2,
        ("num_attention_heads", "n_head"): 2,
        ("intermediate_size", "ffn_dim", "n_inner"): 64,
        ("num_key_value_heads",): 1,
        ("head_dim",): 16,
        ("word_embed_proj_dim",): 32,
        ("max_position_embeddings", "n_positions"): 32,
        ("vocab_size",): VOCAB,
    }
    for names, value in small.items():
        for name in names:
            if name in config.to_dict() or hasattr(config, name):
                with contextlib.suppress(AttributeError):  # one derived from the others (Falcon's head_dim)
                    setattr(config, name, value)
    config.use_cache = False
    config._attn_implementation = "eager"  # attention as matmuls, which the NLP backends quantize
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    model.config.use_cache = False
    return model.eval()


def tokens(batch: int, length: int, seed: int) -> dict[str, Any]:
    """Token ids and a padded mask: the second sequence right-padded by 3, the third left-padded by 2."""
    import torch

    ids = torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[1, length - 3 :] = 0
    mask[2, :2] = 0
    return {"input_ids": ids, "attention_mask": mask}


def run_decoder(name: str, backend: str) -> dict[str, Any]:
    """One decoder x backend: prepare (export capture), calibrate on two batches of 4 x 10 tokens, deploy for 4 x 10
    (dynamic batch and sequence axes) and verify on 3 x 7; the cosine of the quantized logits to float's."""
    import torch

    from backend_configs import config_for, host_config
    from mqbench.convert_deploy import convert_deploy
    from mqbench.deploy.verify import verify_deploy
    from mqbench.prepare_by_platform import prepare_by_platform
    from mqbench.utils.state import enable_calibration, enable_quantization

    start = time.perf_counter()
    case: dict[str, Any] = {"model": name, "backend": backend, "status": "ok", "message": ""}
    stage = "build"
    with warnings.catch_warnings(), tempfile.TemporaryDirectory() as folder:
        warnings.simplefilter("ignore")
        try:
            model = small_decoder(name)
            inputs, check = tokens(4, 10, seed=1), tokens(3, 7, seed=3)
            stage = "prepare"
            config = {**(host_config(backend) or config_for(backend) or {}), "example_inputs": inputs}
            qmodel = prepare_by_platform(model, backend, config)
            case["capture"] = qmodel.mqbench_capture
            linear = [
                n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D"
            ]
            quantized = [n for n in linear if hasattr(qmodel.get_submodule(n), "weight_fake_quant")]
            case["quantized_layers"] = f"{len(quantized)}/{len(linear)}"  # of the Linear (and GPT-2 Conv1D) layers
            stage = "calibrate"
            enable_calibration(qmodel)
            with torch.no_grad():
                for seed in (1, 2):
                    qmodel(**tokens(4, 10, seed))
            enable_quantization(qmodel)
            with torch.no_grad():
                expected, got = model(**check).logits.flatten(), qmodel(**check).logits.flatten()
            case["cosine"] = round(float(torch.nn.functional.cosine_similarity(expected, got, dim=0)), 5)
            stage = "deploy"
            result = convert_deploy(qmodel, backend, dummy_input=inputs, output_path=folder)
            stage = "verify"
            report = verify_deploy(qmodel, result, check)
            case["max_lsb"] = float(report.max_lsb_diff)
            if not report.passed:
                case["status"], case["message"] = "verify_failed", "; ".join(report.failures())
        except Exception as error:  # the benchmark's purpose: every failure becomes a result
            failed(case, error)
    case["stage"] = stage if case["status"] != "ok" else "done"
    case["seconds"] = round(time.perf_counter() - start, 1)
    return case


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated timm model names")
    parser.add_argument(
        "--library",
        default="timm",
        choices=("timm", "mqbench"),
        help=f"where the image models come from (mqbench: {','.join(OWN_MODELS)} by default, random weights with "
        "BatchNorm statistics of the photos)",
    )
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--pretrained", action="store_true", help="timm's pretrained weights (downloads them)")
    parser.add_argument("--batches", type=int, default=2, help="calibration batches of 4 images")
    parser.add_argument("--output", default="model_coverage", help="results/<output>.json")
    parser.add_argument("--capture", default="auto", choices=("auto", "fx", "export"))
    parser.add_argument(
        "--transformers",
        action="store_true",
        help=f"transformers decoders by model type instead (default {','.join(DECODERS)}; backends "
        f"{','.join(NLP_BACKENDS)}), small configs with random weights",
    )
    args = parser.parse_args(argv)
    library: Any
    try:
        if args.transformers:
            import transformers as library
        elif args.library == "mqbench":
            import mqbench as library
        else:
            import timm as library
    except ImportError as error:
        print(f"model_coverage needs {'transformers' if args.transformers else 'timm (and torchvision)'}: {error}")
        return 2
    if args.transformers:
        models = args.models.split(",") if args.models != ",".join(MODELS) else list(DECODERS)
        backends = args.backends.split(",") if args.backends != ",".join(BACKENDS) else list(NLP_BACKENDS)
    else:
        own = args.library == "mqbench" and args.models == ",".join(MODELS)
        models, backends = list(OWN_MODELS) if own else args.models.split(","), args.backends.split(",")
    cases = []
    for name in models:
        for backend in backends:
            if args.transformers:
                case = run_decoder(name, backend)
            else:
                case = run_case(name, backend, args.pretrained, args.batches, args.capture, args.library)
            cases.append(case)
            how = case.get("capture", "-")
            cosine = f"cos {case['cosine']:.4f} {case['quantized_layers']}" if "cosine" in case else ""
            shown = f"{case['status']:<13} {how:<6} {case['seconds']:>6.1f} s {cosine} {case['message'][:160]}"
            print(f"{name:<30} {backend:<10} {shown}", flush=True)
    rows = []
    for backend in backends:
        counts = Counter(c["status"] for c in cases if c["backend"] == backend)
        rows.append([backend, sum(counts.values()), *(counts.get(s, 0) for s in STATUSES)])
    totals = Counter(c["status"] for c in cases)
    rows.append(["all", len(cases), *(totals.get(s, 0) for s in STATUSES)])
    print_table(["backend", "models", *STATUSES], rows)
    path = write_json(
        args.output,
        {
            "library": f"{library.__name__} {library.__version__}",
            "pretrained": args.pretrained,
            "capture": args.capture,
            "models": models,
            "cases": cases,
        },
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
