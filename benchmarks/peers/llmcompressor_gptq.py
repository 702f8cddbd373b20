"""llm-compressor's W4A16 (rounding to nearest or GPTQ) on a causal LM: calibration time and held-out perplexity.

Runs in the peer venv (``benchmarks/peers/make_venv.sh``), never in the project's: it does not import mqbench.

Inputs: the model, as a GGUF file (transformers dequantizes it to float32) or a Hugging Face folder; a ``.pt`` file
``{"calibration": LongTensor[n, L], "evaluation": LongTensor[m, L']}`` of token windows (``smollm2_windows.py``
writes SmolLM2's, drawn by the project).

* The model is loaded in float32, eval mode, no KV cache, ``"eager"`` attention (as the project loads it).
* Float perplexity first, on the evaluation windows: ``exp`` of the mean next-token cross entropy over every window,
  tokens 1..L'-1 predicted from tokens 0..L'-2, in batches of 4.
* ``oneshot`` with one modifier: ``QuantizationModifier`` (``--mode rtn``: rounding to nearest, data-free
  pipeline, no calibration data) or ``GPTQModifier`` (``--mode gptq``: its defaults, i.e. dampening 0.01, block
  128 and static activation ordering; its sequential pipeline, one decoder layer at a time, on the calibration
  windows as a pre-tokenized ``datasets.Dataset`` of ``input_ids``, batch 1, in order). Both with
  ``targets="Linear"``, ``ignore=["lm_head"]`` and the W4A16 preset with its group size replaced
  (``--group-size``, 64 by default): 4-bit symmetric integer weights, one scale per group of input columns,
  min/max ranges, activations float.
* ``seconds``: ``time.perf_counter`` around ``oneshot`` only.
* Perplexity of the quantized model that ``oneshot`` leaves in memory (fake-quantized weights), same windows.

Prints and writes a JSON (``--out``).
Run: benchmarks/peers/.venv-llmcompressor/bin/python benchmarks/peers/llmcompressor_gptq.py MODEL WINDOWS.pt
--mode gptq --out RESULT.json [--group-size 64] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from datetime import datetime, timezone
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F


def load_model(source: Path, folder: Path) -> tuple[torch.nn.Module, Any]:
    """A causal LM and its tokenizer, float32, eval, no KV cache, from a Hugging Face folder, or from a GGUF file by
    way of ``folder``.

    ``oneshot`` reads the model's config again from ``config.name_or_path`` (to refuse models quantized in other
    formats): a GGUF load leaves it at a folder without ``config.json``, and its config says ``quant_method: gguf``
    (although the weights are dequantized float32), which ``save_pretrained`` refuses to write. So the GGUF model's
    weights go into a plain model of the same config without that entry, written to ``folder`` (float32
    safetensors, with the tokenizer), and the model is loaded back from there."""
    import transformers

    if source.is_file():  # GGUF
        tokenizer = transformers.AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        gguf = transformers.AutoModelForCausalLM.from_pretrained(
            source.parent, gguf_file=source.name, dtype=torch.float32
        )
        config = gguf.config
        del config.quantization_config
        plain = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(gguf.state_dict())
        plain.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        source = folder
    tokenizer = transformers.AutoTokenizer.from_pretrained(source)
    model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, attn_implementation="eager")
    model.config.use_cache = False
    return model.eval(), tokenizer


def perplexity(model: torch.nn.Module, windows: torch.Tensor, batch: int = 4) -> float:
    """``exp`` of the mean next-token cross entropy: in each window, tokens 1..L-1 predicted from 0..L-2."""
    total, count = 0.0, 0
    with torch.no_grad():
        for ids in windows.split(batch):
            logits = model(input_ids=ids[:, :-1]).logits
            targets = ids[:, 1:].reshape(-1)
            total += float(F.cross_entropy(logits.reshape(len(targets), -1).float(), targets, reduction="sum"))
            count += len(targets)
    return math.exp(total / count)


def w4a16_scheme(group_size: int) -> Any:
    """llm-compressor's W4A16 preset on the ``Linear`` layers (4-bit symmetric integer weight groups, activations
    float), with its group size (128) replaced by ``group_size`` (a modifier's ``scheme`` takes only preset names,
    so the scheme goes in as ``config_groups``)."""
    from compressed_tensors.quantization import preset_name_to_scheme

    scheme = preset_name_to_scheme("W4A16", ["Linear"])
    scheme.weights = scheme.weights.model_copy(update={"group_size": group_size})
    return scheme


def scheme_of(model: torch.nn.Module) -> dict[str, Any]:
    """The quantization scheme applied, as read back from the first quantized linear layer (and the ignored head)."""
    quantized = [(n, m) for n, m in model.named_modules() if getattr(m, "quantization_scheme", None) is not None]
    name, module = quantized[0]
    head = getattr(model, "lm_head", None)
    return {
        "layers_quantized": len(quantized),
        "first": name,
        "weights": module.quantization_scheme.weights.model_dump(mode="json"),
        "input_activations": module.quantization_scheme.input_activations,
        "lm_head_quantized": head is not None and getattr(head, "quantization_scheme", None) is not None,
    }


LOADED_GGUF = "GGUF, dequantized to float32, saved as safetensors and loaded back"


def gptq_settings(modifier: Any) -> dict[str, Any]:
    """The GPTQ modifier's settings that this script leaves at their defaults."""
    return {
        "dampening_frac": modifier.dampening_frac,
        "block_size": modifier.block_size,
        "actorder": str(modifier.actorder),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path, help="a GGUF file or a Hugging Face model folder")
    parser.add_argument("windows", type=Path, help='.pt file {"calibration": [n, L], "evaluation": [m, L]}')
    parser.add_argument("--mode", choices=("rtn", "gptq"), default="gptq")
    parser.add_argument("--scheme", choices=("W4A16",), default="W4A16")
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        run(args, Path(folder))


def run(args: argparse.Namespace, folder: Path) -> None:
    torch.set_num_threads(args.threads)
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier

    windows = torch.load(args.windows)
    calibration, evaluation = windows["calibration"].long(), windows["evaluation"].long()
    model, tokenizer = load_model(args.model, folder)
    started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")

    float_ppl = perplexity(model, evaluation)
    print(f"float perplexity: {float_ppl:.4f}", flush=True)

    settings = {"config_groups": {"group_0": w4a16_scheme(args.group_size)}, "ignore": ["lm_head"]}
    if args.mode == "gptq":
        modifier = GPTQModifier(**settings)
        data = {"dataset": Dataset.from_dict({"input_ids": calibration.tolist()}), "pipeline": "sequential"}
        data.update(num_calibration_samples=len(calibration), shuffle_calibration_samples=False, batch_size=1)
    else:
        modifier = QuantizationModifier(**settings)
        data = {"pipeline": "datafree"}

    started = time.perf_counter()
    model = oneshot(model=model, tokenizer=tokenizer, recipe=modifier, **data)
    seconds = time.perf_counter() - started
    model.eval()
    print(f"oneshot ({args.mode}): {seconds:.1f} s", flush=True)

    ppl = perplexity(model, evaluation)
    print(f"{args.scheme} g{args.group_size} {args.mode} perplexity: {ppl:.4f} ({ppl / float_ppl:.3f}x float)")
    result = {
        "peer": "llmcompressor",
        "version": version("llmcompressor"),
        "mode": args.mode,
        "scheme": args.scheme,
        "group_size": args.group_size,
        "float_ppl": float_ppl,
        "ppl": ppl,
        "ppl_over_float": ppl / float_ppl,
        "seconds": seconds,
        "calibration_windows": len(calibration) if args.mode == "gptq" else 0,
        "seq_len": calibration.shape[1],
        "evaluation_windows": len(evaluation),
        "evaluation_seq_len": evaluation.shape[1],
        "predicted_tokens": evaluation.shape[0] * (evaluation.shape[1] - 1),
        "torch_threads": torch.get_num_threads(),
        "modifier": type(modifier).__name__,
        "modifier_settings": gptq_settings(modifier) if args.mode == "gptq" else {},
        "pipeline": data["pipeline"],
        "applied": scheme_of(model),
        "model": args.model.name,
        "loaded": LOADED_GGUF if args.model.is_file() else "folder",
        "draws": windows.get("draws"),
        "versions": {p: version(p) for p in ("torch", "transformers", "compressed-tensors", "datasets", "gguf")},
        "started_utc": started_at,
    }
    print(json.dumps(result, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
