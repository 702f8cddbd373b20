"""A small GPT-2-architecture decoder, trained here on the Python standard library's own source.

No pretrained decoder can be downloaded where this project is tested, so it trains one: byte-level (256
tokens), pre-norm blocks of causal self-attention (separate q / k / v / out ``nn.Linear`` with biases) and an MLP
with GPT-2's tanh-approximated GELU, learned position embeddings, a final LayerNorm and an output layer tied to the
token embedding, without a bias. That is GPT-2's computation, and OPT's with its GELU: the checkpoints LLM runtimes
load are written for it (:func:`opt_config`). Attention is computed ``"eager"`` (the matrix products and the softmax
as graph operations, which the backends that quantize attention's inputs see) or ``"sdpa"`` (one
``scaled_dot_product_attention``, which they leave float), the same function either way; the query is scaled
before its product with the keys, as OPT scales it. :func:`stdlib_corpus` reads the ``.py``
files of the running interpreter's standard library, sorted by path, every tenth one held out; training and
evaluation read fixed-length windows of the bytes. :func:`trained_decoder` trains it once (minutes on two
cores) and caches the weights like the zoo (``$MQBENCH_CACHE/zoo``), keyed by this module's source, the
recipe, torch's version and a digest of the corpus.

Example:
    >>> import torch
    >>> model = TinyGPT(dim=32, depth=1, heads=2, context=16)
    >>> model(torch.zeros(2, 16, dtype=torch.long)).shape
    torch.Size([2, 16, 256])
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import sys
import sysconfig
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mqbench.models.zoo import _load, _store, zoo_cache_dir
from mqbench.utils.hf_capture import ATTENTION, BYTE_LEVEL, INPUT_NAMES, LEADING_ROWS, PARAMETER_NAMES
from mqbench.utils.logger import logger

__all__ = [
    "DecoderRecipe",
    "TinyGPT",
    "held_out_perplexity",
    "opt_config",
    "stdlib_corpus",
    "token_windows",
    "trained_decoder",
    "window_perplexity",
]

VOCAB = 256  # bytes


IMPLEMENTATIONS = ("eager", "sdpa")  # of attention


class _Attention(nn.Module):
    causal: Tensor

    def __init__(self, dim: int, heads: int, context: int, attention: str = "eager") -> None:
        super().__init__()
        self.heads, self.head_dim, self.attention = heads, dim // heads, attention
        self.scaling = self.head_dim**-0.5
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)
        causal = torch.triu(torch.full((context, context), -10000.0), diagonal=1)  # additive, finite
        self.register_buffer("causal", causal[None, None], persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        b, n = x.shape[0], x.shape[1]
        q = (self.q(x) * self.scaling).reshape(b, n, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(x).reshape(b, n, self.heads, self.head_dim).transpose(1, 2)
        v = self.v(x).reshape(b, n, self.heads, self.head_dim).transpose(1, 2)
        if self.attention == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0)
        else:
            scores = torch.matmul(q, k.transpose(-2, -1)) + self.causal.narrow(2, 0, n).narrow(3, 0, n)
            y = torch.matmul(torch.softmax(scores, dim=-1), v)
        return self.out(y.transpose(1, 2).reshape(b, n, self.heads * self.head_dim))


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int, context: int, mlp: int, attention: str) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = _Attention(dim, heads, context, attention)
        self.norm2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, mlp)
        self.proj = nn.Linear(mlp, dim)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.proj(F.gelu(self.fc(self.norm2(x)), approximate="tanh"))


class TinyGPT(nn.Module):
    """GPT-2's architecture at small width: ``forward(ids [N, L]) -> logits [N, L, 256]`` (``L <= context``);
    ``attention`` is ``"eager"`` or ``"sdpa"`` (see the module docstring)."""

    def __init__(
        self,
        dim: int = 128,
        depth: int = 4,
        heads: int = 4,
        context: int = 128,
        mlp_ratio: int = 4,
        attention: str = "eager",
    ) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim ({dim}) must be divisible by heads ({heads})")
        if attention not in IMPLEMENTATIONS:
            raise ValueError(f"attention {attention!r}: one of {', '.join(IMPLEMENTATIONS)}")
        self.context, self.heads, self.attention = context, heads, attention
        self.tokens = nn.Embedding(VOCAB, dim)
        self.positions = nn.Embedding(context, dim)
        self.blocks = nn.ModuleList([_Block(dim, heads, context, mlp_ratio * dim, attention) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        for name, parameter in self.named_parameters():  # GPT-2: residual writers scaled by 1 / sqrt(2 * depth)
            if name.endswith(("attn.out.weight", "proj.weight")):
                nn.init.normal_(parameter, std=0.02 / math.sqrt(2 * depth))
        self.tie_weights()

    def tie_weights(self) -> None:
        """The output layer's weight is the token embedding, as GPT-2's (again after ``init_empty_weights()``,
        which makes each parameter anew, as transformers ties its models' weights after building them)."""
        self.head.weight = self.tokens.weight

    def checkpoint_config(self) -> dict[str, Any]:
        """The Hugging Face configuration its checkpoints are written with: :func:`opt_config`."""
        return opt_config(self)

    def forward(self, ids: Tensor) -> Tensor:
        positions = torch.ones_like(ids).cumsum(dim=1) - 1
        x = self.tokens(ids) + self.positions(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


_OPT_NAMES = {
    "norm1": "self_attn_layer_norm",
    "attn.q": "self_attn.q_proj",
    "attn.k": "self_attn.k_proj",
    "attn.v": "self_attn.v_proj",
    "attn.out": "self_attn.out_proj",
    "norm2": "final_layer_norm",
    "fc": "fc1",
    "proj": "fc2",
}


def opt_config(model: TinyGPT) -> dict[str, Any]:
    """``model`` as transformers' ``OPTForCausalLM`` holds it, the architecture of its checkpoints (OPT computes
    GPT-2's blocks with separate q / k / v layers, and vLLM serves it): the configuration as ``config.json`` holds
    it, with ``model``'s parameter names mapped onto OPT's (``mqbench_parameter_names``), its input onto OPT's
    argument (``mqbench_input_names``), OPT's two leading rows of the position table (``mqbench_leading_rows``: OPT
    looks position ``p`` up at row ``p + 2``), its attention (``mqbench_attn_implementation``) and its byte-level
    tokens (``mqbench_byte_level``).

    Example:
        >>> config = opt_config(TinyGPT(dim=32, depth=1, heads=2, context=16))
        >>> config["mqbench_parameter_names"]["blocks.0.attn.q.weight"]
        'model.decoder.layers.0.self_attn.q_proj.weight'
    """
    fc = model.blocks[0].get_submodule("fc")
    assert isinstance(fc, nn.Linear)
    names = {
        "tokens.weight": "model.decoder.embed_tokens.weight",
        "positions.weight": "model.decoder.embed_positions.weight",
        "norm.weight": "model.decoder.final_layer_norm.weight",
        "norm.bias": "model.decoder.final_layer_norm.bias",
        "head.weight": "lm_head.weight",
    }
    for index in range(len(model.blocks)):
        for ours, theirs in _OPT_NAMES.items():
            for leaf in ("weight", "bias"):
                names[f"blocks.{index}.{ours}.{leaf}"] = f"model.decoder.layers.{index}.{theirs}.{leaf}"
    dim = model.tokens.embedding_dim
    return {
        "architectures": ["OPTForCausalLM"],
        "model_type": "opt",
        "vocab_size": VOCAB,
        "hidden_size": dim,
        "word_embed_proj_dim": dim,
        "num_hidden_layers": len(model.blocks),
        "num_attention_heads": model.heads,
        "ffn_dim": fc.out_features,
        "max_position_embeddings": model.context,
        "activation_function": "gelu_pytorch_tanh",
        "do_layer_norm_before": True,
        "enable_bias": True,
        "layer_norm_elementwise_affine": True,
        "tie_word_embeddings": True,
        "dropout": 0.0,
        "attention_dropout": 0.0,
        "activation_dropout": 0.0,
        "layerdrop": 0.0,
        "bos_token_id": None,  # bytes: no token begins or ends a text
        "eos_token_id": None,
        "pad_token_id": None,
        ATTENTION: model.attention,
        PARAMETER_NAMES: names,
        INPUT_NAMES: ["input_ids"],
        LEADING_ROWS: {"positions.weight": 2},
        BYTE_LEVEL: True,
    }


def stdlib_corpus(limit: int = 4_000_000) -> tuple[bytes, bytes]:
    """(train, held-out) bytes: the standard library's ``.py`` files (top level and packages, tests excluded),
    sorted by path, every tenth one held out, each part cut at ``limit`` bytes (the held-out one at a tenth)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p
        for p in root.rglob("*.py")
        if not {"test", "tests", "idle_test", "site-packages"} & set(p.relative_to(root).parts)
    )
    if len(files) < 20:
        raise RuntimeError(f"the standard library at {root} has too few .py files ({len(files)}) to train on")
    train, held = bytearray(), bytearray()
    for index, path in enumerate(files):
        part = held if index % 10 == 0 else train
        if len(part) < (limit // 10 if part is held else limit):
            part.extend(path.read_bytes())
    return bytes(train[:limit]), bytes(held[: limit // 10])


def token_windows(data: bytes, length: int, count: int, seed: int) -> Tensor:
    """``count`` windows of ``length`` bytes at random offsets (seeded): ``[count, length]`` int64."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    starts = torch.randint(0, len(tokens) - length, (count,), generator=generator)
    return torch.stack([tokens[s : s + length] for s in starts.tolist()]).long()


@torch.no_grad()
def window_perplexity(logits_of: Callable[[Tensor], Tensor], batches: Iterable[Tensor]) -> float:
    """``exp`` of the mean next-token cross-entropy over every position of each batch of windows ``[N, L + 1]``, the
    first excepted; ``logits_of(ids[:, :-1])`` gives the logits ``[N, L, vocabulary]`` (a model's or a runtime's)."""
    total, count = 0.0, 0
    with torch.no_grad():
        for ids in batches:
            logits = logits_of(ids[:, :-1])
            targets = ids[:, 1:].reshape(-1)
            total += float(F.cross_entropy(logits.reshape(len(targets), -1).float(), targets, reduction="sum"))
            count += len(targets)
    return math.exp(total / count)


def held_out_perplexity(model: nn.Module, windows: Tensor, batch: int = 16) -> float:
    """``exp`` of the mean next-byte cross-entropy over every position of ``windows`` (the first excepted)."""

    def logits_of(ids: Tensor) -> Tensor:
        logits = model(ids)
        return logits if isinstance(logits, Tensor) else logits[0]

    return window_perplexity(logits_of, windows.split(batch))


@dataclass(frozen=True)
class DecoderRecipe:
    dim: int = 128
    depth: int = 4
    heads: int = 4
    context: int = 128
    steps: int = 1500
    batch_size: int = 32
    lr: float = 3e-3
    warmup: int = 100
    seed: int = 0


def _cache_key(recipe: DecoderRecipe, train: bytes) -> str:
    settings = {
        "recipe": asdict(recipe),
        "torch": torch.__version__,
        "source": inspect.getsource(sys.modules[__name__]),
    }
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    digest.update(hashlib.sha256(train).digest())
    return digest.hexdigest()[:20]


def trained_decoder(recipe: DecoderRecipe | None = None) -> tuple[TinyGPT, bytes, bytes]:
    """(the trained decoder in eval mode, train bytes, held-out bytes), from the cache where it is there."""
    recipe = recipe or DecoderRecipe()
    train, held = stdlib_corpus()
    torch.manual_seed(recipe.seed)
    model = TinyGPT(recipe.dim, recipe.depth, recipe.heads, recipe.context)
    directory = zoo_cache_dir()
    path = None if directory is None else directory / f"tinygpt-{_cache_key(recipe, train)}.pt"
    if path is not None and _load(path, model):
        return model.eval(), train, held
    logger.info("training the decoder (%d steps; cached afterwards)", recipe.steps)
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=0.1, betas=(0.9, 0.95))
    windows = token_windows(train, recipe.context + 1, recipe.steps * recipe.batch_size, recipe.seed)
    model.train()
    for step in range(recipe.steps):
        scale = min(1.0, (step + 1) / recipe.warmup) * 0.5 * (1 + math.cos(math.pi * step / recipe.steps))
        for group in optimizer.param_groups:
            group["lr"] = recipe.lr * scale
        ids = windows[step * recipe.batch_size : (step + 1) * recipe.batch_size]
        loss = F.cross_entropy(model(ids[:, :-1]).reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    model.eval()
    if path is not None:
        _store(path, model)
    return model, train, held
