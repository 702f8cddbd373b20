"""GGUF: the single file llama.cpp (and transformers' GGUF loader) runs a quantized decoder from (Llama-architecture
models as GGUF's ``llama``, GPT-2-shaped ones as its ``gpt2``).

GGUF holds the weight-only schemes of this project that it stores exactly: 32 weights a block, one float16 scale
``d`` a block, symmetric integers, ``w = d * q``.

* ``Q4_0``: ``d``, then 16 bytes; byte ``j`` holds ``q[j] + 8`` in its low nibble and ``q[j + 16] + 8`` in its
  high one (``q`` in [-8, 7]).
* ``Q8_0``: ``d``, then the 32 integers as int8.

So a layer quantized in symmetric groups of 32 input channels on a 4-bit or 8-bit grid, with its scales rounded
to float16 (``w_qscheme: {group_size: 32, scale_dtype: float16}``), is written as ``Q4_0`` or ``Q8_0`` and
computes the simulation exactly; any other setting is named in a warning with the setting that GGUF holds, and no
file is written (the ONNX artifacts still are). The layers left float are written as F32.

Names follow llama.cpp's ``llama`` architecture (``token_embd``, ``blk.N.attn_q``, ...), with the query and key
projections' rows in its order (each head's two rotary halves interleaved, as llama.cpp's converter writes them;
a reader turns them back). The model's shape goes into the ``llama.*`` keys; the tokenizer (``tokenizer.*``) is
carried over from the GGUF file the model was loaded from, where its folder holds one of the same shape.

An OPT-architecture model whose blocks are GPT-2's (pre-norm, tanh-approximated GELU, an MLP 4x wide, no
projections around the blocks; the project's decoder is written so) is written as GGUF's ``gpt2``: the query, key
and value layers' rows one after the other in ``attn_qkv`` (each row's blocks are its own, so quantized rows stay
exact), OPT's position table without its two leading rows, and a byte-level model's 256 tokens as GPT-2's byte
characters. Its blocks' weights are checked as the ``gguf`` package dequantizes them from the file (transformers
builds GPT-2's fused ``Conv1D`` from them).

Example:
    >>> q = np.concatenate([np.arange(-8, 8), np.arange(7, -9, -1)]).reshape(1, 32)  # -8 .. 7, then 7 .. -8
    >>> block = q4_0_blocks(q, np.array([[0.5]], np.float32))
    >>> block.shape, block[0, :2].view(np.float16).tolist()  # 18 bytes: d first
    ((1, 18), [0.5])
    >>> [hex(b) for b in block[0, 2:5]]  # then q[j] + 8 in the low nibble, q[j + 16] + 8 in the high one
    ['0xf0', '0xe1', '0xd2']
"""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from mqbench.deploy.comparison import ArtifactReport, compare
from mqbench.deploy.writers.compressed_tensors import integer_levels, loaded_by_consumer
from mqbench.deploy.writers.hf_checkpoint import Checkpoint, Names, hf_checkpoint, unlike_gpt2
from mqbench.qparams import TensorQParams
from mqbench.utils.hf_capture import BYTE_LEVEL, INPUT_NAMES, SOURCE_CONFIG, attention_of

if TYPE_CHECKING:
    from mqbench.deploy.context import DeployContext

__all__ = [
    "BLOCK",
    "KEY",
    "SUFFIX",
    "byte_tokens",
    "gguf_name",
    "interleaved_rows",
    "q4_0_blocks",
    "q8_0_blocks",
    "verify",
    "write",
]

KEY = "gguf"
SUFFIX = ".gguf"
BLOCK = 32
ARCHITECTURES = ("llama", "opt")  # model_type values written: as GGUF's llama, and (GPT-2's blocks) its gpt2
HOLDS = "w_qscheme {group_size: 32, scale_dtype: float16} on a 4-bit or 8-bit symmetric grid"
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_MODEL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}


def gguf_name(name: str) -> str | None:
    """llama.cpp's name of a Llama model's parameter ``name`` (None: not one GGUF's llama architecture has)."""
    if name in _MODEL:
        return _MODEL[name]
    if name == "lm_head.weight":
        return "output.weight"
    parts = name.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[2].isdigit() and parts[3] in _LAYER:
        return f"blk.{parts[2]}.{_LAYER[parts[3]]}"
    return None


_GPT2_LAYER = {  # OPT's names of a block's tensors -> GGUF gpt2's (q, k and v go into attn_qkv together)
    "self_attn_layer_norm": "attn_norm",
    "self_attn.out_proj": "attn_output",
    "final_layer_norm": "ffn_norm",
    "fc1": "ffn_up",
    "fc2": "ffn_down",
}
_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")


def byte_tokens() -> list[str]:
    """GPT-2's characters for the 256 bytes, token ``b`` for byte ``b``: the printable Latin-1 bytes stand for
    themselves, the others (in byte order) for the characters from U+0100 on.

    Example:
        >>> tokens = byte_tokens()
        >>> tokens[ord("a")], tokens[0], tokens[ord(" ")], len(set(tokens))
        ('a', 'Ā', 'Ġ', 256)
    """
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    tokens, extra = [], 0
    for byte in range(256):
        if byte in printable:
            tokens.append(chr(byte))
        else:
            tokens.append(chr(0x100 + extra))
            extra += 1
    return tokens


def interleaved_rows(values: np.ndarray, heads: int) -> np.ndarray:
    """The rows of a query or key projection (``[heads * head_dim, ...]``) in llama.cpp's order: within each head,
    row ``i`` of the first half and row ``i`` of the second half next to each other."""
    half = values.shape[0] // heads // 2
    return values.reshape(heads, 2, half, *values.shape[1:]).swapaxes(1, 2).reshape(values.shape)


def _blocked(levels: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray, int, int]:
    rows, cols = levels.shape
    count = cols // BLOCK
    d = np.asarray(scales, np.float32).astype(np.float16).reshape(rows, count, 1).view(np.uint8)
    return levels.reshape(rows, count, BLOCK), d, rows, count


def q4_0_blocks(levels: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """``Q4_0`` bytes ``[rows, cols / 32 * 18]`` of integers ``levels`` in [-8, 7] with one scale a block."""
    blocks, d, rows, count = _blocked(levels, scales)
    unsigned = (blocks + 8).astype(np.uint8)
    packed = unsigned[..., :16] | (unsigned[..., 16:] << 4)
    return np.concatenate([d, packed], axis=2).reshape(rows, count * 18)


def q8_0_blocks(levels: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """``Q8_0`` bytes ``[rows, cols / 32 * 34]`` of integers ``levels`` in [-128, 127] with one scale a block."""
    blocks, d, rows, count = _blocked(levels, scales)
    return np.concatenate([d, blocks.astype(np.int8).view(np.uint8)], axis=2).reshape(rows, count * 34)


def _held(entry: TensorQParams, shape: tuple[int, ...]) -> tuple[str | None, str]:
    """(``Q4_0`` or ``Q8_0``, "") for a quantization GGUF holds exactly, else (None, why not)."""
    if entry.group_size != BLOCK:
        return None, f"groups of {entry.group_size}" if entry.group_size else "one scale per channel or tensor"
    if len(shape) != 2 or shape[1] % BLOCK:
        return None, f"a weight of shape {list(shape)} (whole blocks of {BLOCK} input channels)"
    if entry.grid != "linear" or entry.quant_min >= 0 or np.any(entry.zero_point != 0):
        return None, "an asymmetric grid (GGUF's Q4_0 and Q8_0 are symmetric)"
    scale = np.asarray(entry.scale, np.float32)
    if not np.array_equal(scale.astype(np.float16).astype(np.float32), scale):
        return None, "float32 scales (GGUF stores float16 ones)"
    for kind, low, high in (("Q4_0", -8, 7), ("Q8_0", -128, 127)):
        if low <= entry.quant_min and entry.quant_max <= high:
            return kind, ""
    return None, f"the grid [{entry.quant_min}, {entry.quant_max}] (GGUF holds 4-bit and 8-bit ones here)"


def _source_tokenizer(source: Mapping[str, Any], shape: Mapping[str, int]) -> list[Any]:
    """The ``tokenizer.*`` fields of a GGUF file in the folder the model was loaded from whose model has this
    one's width and vocabulary (none when there is no such file; a model cut to fewer blocks keeps its tokenizer)."""
    import gguf

    where = Path(source.get("_name_or_path") or "").expanduser()
    if not str(where) or not where.is_dir():
        return []
    for candidate in sorted(where.glob("*.gguf")):
        try:
            reader = gguf.GGUFReader(str(candidate))
        except (OSError, ValueError):
            continue
        fields = reader.fields
        same = all(
            key in fields and int(fields[key].contents()) == value for key, value in shape.items() if value is not None
        )
        if same:
            return [field for name, field in fields.items() if name.startswith("tokenizer.")]
    return []


def _rope_theta(source: Mapping[str, Any]) -> float:
    parameters = source.get("rope_parameters") or source.get("rope_scaling") or {}
    return float(parameters.get("rope_theta") or source.get("rope_theta") or 10000.0)


def _finish(writer: Any, tensors: list[tuple[str, np.ndarray, Any]], path: Path) -> Path:
    """The tensors added to ``writer``, and the file written and closed."""
    for target, data, raw in tensors:
        writer.add_tensor(target, data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _refuse(why: str, stacklevel: int = 4) -> None:
    warnings.warn(f"{KEY}: not written, {why}", stacklevel=stacklevel)


def _encoded(context: DeployContext, name: str, values: np.ndarray, gguf: Any) -> tuple[np.ndarray, Any, str]:
    """(the bytes or float32 values GGUF stores for parameter ``name``, its raw type (None: F32), the block kind or
    ""); raises ValueError saying why where GGUF cannot hold its quantization."""
    entry = context.table.get(name)
    if entry is None:
        return np.ascontiguousarray(values, np.float32), None, ""
    kind, why = _held(entry, values.shape)
    if kind is None:
        raise ValueError(f"{name}: {why}")
    levels, scales = integer_levels(entry, values), entry.blocked(entry.scale, values.shape)
    packed = q4_0_blocks(levels, scales) if kind == "Q4_0" else q8_0_blocks(levels, scales)
    return packed, getattr(gguf.GGMLQuantizationType, kind), kind


def _gpt2_tensors(
    context: DeployContext, checkpoint: Checkpoint, gguf: Any
) -> tuple[list[tuple[str, np.ndarray, Any]], set[str], list[str]]:
    """GGUF gpt2's tensors of an OPT model with GPT-2's blocks: (name, data, raw type), the block kinds, refusals."""
    source = checkpoint.config
    ours = {checkpoint.names.rename(name): name for name in checkpoint.weights}  # OPT's name -> the model's
    tensors: list[tuple[str, np.ndarray, Any]] = []
    kinds: set[str] = set()
    refused: list[str] = []

    def add(target: str, names: list[str], rows: int = 0) -> None:
        parts = []
        for name in names:
            mine = ours[name]
            try:
                parts.append(_encoded(context, mine, checkpoint.weights[mine].detach().float().numpy()[rows:], gguf))
            except ValueError as error:
                refused.append(str(error))
                return
        if len({raw for _, raw, _ in parts}) != 1:
            refused.append(f"{', '.join(ours[n] for n in names)}: quantized differently (GGUF stores them as one)")
            return
        tensors.append((target, np.concatenate([data for data, _, _ in parts]), parts[0][1]))
        kinds.update(kind for _, _, kind in parts if kind)

    add("token_embd.weight", ["model.decoder.embed_tokens.weight"])
    add("position_embd.weight", ["model.decoder.embed_positions.weight"], rows=2)  # OPT's rows start at 2
    for leaf in ("weight", "bias"):
        add(f"output_norm.{leaf}", [f"model.decoder.final_layer_norm.{leaf}"])
    for index in range(int(source["num_hidden_layers"])):
        layer = f"model.decoder.layers.{index}"
        for leaf in ("weight", "bias"):
            add(f"blk.{index}.attn_qkv.{leaf}", [f"{layer}.{part}.{leaf}" for part in _QKV])
            for theirs, target in _GPT2_LAYER.items():
                add(f"blk.{index}.{target}.{leaf}", [f"{layer}.{theirs}.{leaf}"])
    head, embedding = ours.get("lm_head.weight"), ours["model.decoder.embed_tokens.weight"]
    if head is not None and head in context.table:
        refused.append(f"{head}: quantized, while GGUF's gpt2 ties the output layer to the float embedding")
    elif head is not None and not checkpoint.weights[head].equal(checkpoint.weights[embedding]):
        refused.append(f"{head}: an output layer of its own (GGUF's gpt2 as transformers reads it ties it)")
    return tensors, kinds, refused


def _write_gpt2(context: DeployContext, checkpoint: Checkpoint, gguf: Any) -> Path | None:
    """``{model_name}.gguf`` as GGUF's gpt2 (see the module docstring), or None with a warning saying why not."""
    source = checkpoint.config
    unlike = unlike_gpt2(source)
    if unlike:
        _refuse(f"GGUF has no architecture for this OPT model: {unlike}", stacklevel=5)
        return None
    if not source.get(BYTE_LEVEL):
        _refuse("GGUF's gpt2 needs the model's tokenizer, and only a byte-level model's is written here", stacklevel=5)
        return None
    tensors, kinds, refused = _gpt2_tensors(context, checkpoint, gguf)
    if refused:
        shown = "; ".join(refused[:3]) + (f"; and {len(refused) - 3} more" if len(refused) > 3 else "")
        _refuse(f"GGUF cannot hold {shown}; it holds {HOLDS}", stacklevel=5)
        return None
    path = context.path(SUFFIX)
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_name(str(source.get("architectures", ["gpt2"])[0]))
    writer.add_context_length(int(source["max_position_embeddings"]))
    writer.add_embedding_length(int(source["hidden_size"]))
    writer.add_block_count(int(source["num_hidden_layers"]))
    writer.add_feed_forward_length(int(source["ffn_dim"]))
    writer.add_head_count(int(source["num_attention_heads"]))
    writer.add_layer_norm_eps(1e-5)  # OPT's nn.LayerNorm default
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0 if "Q4_0" in kinds else gguf.LlamaFileType.MOSTLY_Q8_0)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(byte_tokens())
    writer.add_token_types([int(gguf.TokenType.NORMAL)] * 256)
    writer.add_token_merges([])  # bytes are the tokens: nothing merges
    for key, add in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id)):
        if source.get(key) is not None:
            add(int(source[key]))
    return _finish(writer, tensors, path)


def write(context: DeployContext) -> Path | None:
    """``{model_name}.gguf`` (see the module docstring); None where the model is not a Llama-architecture Hugging
    Face model or an OPT one with GPT-2's blocks, or (with a warning naming what GGUF holds) its quantization is
    not one GGUF stores exactly."""
    checkpoint = hf_checkpoint(context, KEY, tuple(ARCHITECTURES))
    if checkpoint is None:
        return None
    source = checkpoint.config
    if importlib.util.find_spec("gguf") is None:
        _refuse("the gguf package is not installed (pip install gguf, or mqbench[llm])")
        return None
    import gguf

    if source.get("model_type") == "opt":
        return _write_gpt2(context, checkpoint, gguf)
    rope = source.get("rope_parameters") or source.get("rope_scaling") or {}
    if rope.get("rope_type", "default") != "default" or source.get("attention_bias") or source.get("mlp_bias"):
        _refuse("the model's rotary scaling or biases are not written here (plain Llama models are)")
        return None
    heads, kv_heads = int(source["num_attention_heads"]), int(source.get("num_key_value_heads") or 0)
    kv_heads = kv_heads or heads
    params = checkpoint.weights
    tied = bool(source.get("tie_word_embeddings", False))
    tensors: list[tuple[str, np.ndarray, Any]] = []
    kinds: set[str] = set()
    refused: list[str] = []
    seen: set[int] = set()
    for name, parameter in params.items():
        target = gguf_name(name)
        if target is None:
            refused.append(f"{name}: not a tensor of GGUF's llama architecture")
            continue
        if name == "lm_head.weight" and tied and parameter.data_ptr() in seen and name not in context.table:
            continue  # tied: readers use token_embd
        seen.add(parameter.data_ptr())
        values = parameter.detach().float().numpy()
        heads_of = {"attn_q.weight": heads, "attn_k.weight": kv_heads}.get(target.split(".", 2)[-1])
        entry = context.table.get(name)
        if entry is None:
            data = interleaved_rows(values, heads_of) if heads_of else values
            tensors.append((target, np.ascontiguousarray(data, np.float32), None))
            continue
        kind, why = _held(entry, values.shape)
        if kind is None:
            refused.append(f"{name}: {why}")
            continue
        levels = integer_levels(entry, values)
        scales = entry.blocked(entry.scale, values.shape)
        if heads_of:
            levels, scales = interleaved_rows(levels, heads_of), interleaved_rows(scales, heads_of)
        packed = q4_0_blocks(levels, scales) if kind == "Q4_0" else q8_0_blocks(levels, scales)
        tensors.append((target, packed, getattr(gguf.GGMLQuantizationType, kind)))
        kinds.add(kind)
    if tied and "lm_head.weight" in context.table:
        refused.append("lm_head.weight: quantized, while the model ties it to the float embedding")
    if refused:
        shown = "; ".join(refused[:3]) + (f"; and {len(refused) - 3} more" if len(refused) > 3 else "")
        _refuse(f"GGUF cannot hold {shown}; it holds {HOLDS}")
        return None
    path = context.path(SUFFIX)
    layers = int(source["num_hidden_layers"])
    shape = {"llama.embedding_length": int(source["hidden_size"]), "llama.vocab_size": int(source["vocab_size"])}
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(str(source.get("architectures", ["llama"])[0]))
    writer.add_context_length(int(source.get("max_position_embeddings") or 2048))
    writer.add_embedding_length(int(source["hidden_size"]))
    writer.add_block_count(layers)
    writer.add_feed_forward_length(int(source["intermediate_size"]))
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(float(source.get("rms_norm_eps") or 1e-6))
    writer.add_rope_freq_base(_rope_theta(source))
    writer.add_rope_dimension_count(int(source.get("head_dim") or int(source["hidden_size"]) // heads))
    writer.add_vocab_size(int(source["vocab_size"]))
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0 if "Q4_0" in kinds else gguf.LlamaFileType.MOSTLY_Q8_0)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for field in _source_tokenizer(source, shape):
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    return _finish(writer, tensors, path)


def _load(path: str, attention: str | None = None) -> nn.Module:
    """The file as transformers' GGUF loader reads it (dequantized with the gguf package), float32, ``attention``
    as the simulation computed it (None: transformers' default); a gpt2 file with its context as GPT-2's
    ``n_positions`` (the reader sets only ``n_ctx`` from it, and builds 1024 positions)."""
    import gguf
    import transformers

    file = Path(path)
    options: dict[str, Any] = {} if attention is None else {"attn_implementation": attention}
    fields = gguf.GGUFReader(str(file)).fields
    if fields["general.architecture"].contents() == "gpt2":  # the reader takes GPT-2's context as 1024 positions
        options["n_positions"] = int(fields["gpt2.context_length"].contents())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(file.parent), gguf_file=file.name, dtype=torch.float32, **options
        )
    return model.eval()


def _logits(model: nn.Module, feeds: Mapping[str, np.ndarray]) -> np.ndarray:
    with torch.no_grad():
        ids = torch.from_numpy(np.asarray(feeds["input_ids"]))
        mask = feeds.get("attention_mask")
        extra = {} if mask is None else {"attention_mask": torch.from_numpy(np.asarray(mask))}
        return model(input_ids=ids, **extra, use_cache=False).logits.numpy()


def serve(result: Any) -> Callable[[Mapping[str, np.ndarray]], list[np.ndarray]]:
    """The file as transformers serves it on a CPU: its logits."""
    model = _load(result.artifacts[KEY])
    names = Names({INPUT_NAMES: ["input_ids"] if len(result.input_names) == 1 else []})  # one input: token ids
    return lambda feeds: [_logits(model, names.arguments(feeds))]


def _file_weights(path: str, wanted: Mapping[str, str]) -> dict[str, np.ndarray]:
    """The weights of a gpt2 file as the ``gguf`` package dequantizes its blocks, by the model's name: ``wanted``
    maps each model's name to its OPT name (q, k and v are the three thirds of ``attn_qkv``'s rows)."""
    import gguf

    stored = {t.name: t for t in gguf.GGUFReader(path).tensors}
    out = {}
    for mine, theirs in wanted.items():
        parts = theirs.split(".")
        if len(parts) < 6 or parts[:3] != ["model", "decoder", "layers"]:
            continue
        layer, role = parts[3], ".".join(parts[4:-1])
        third = _QKV.index(role) if role in _QKV else None
        target = f"blk.{layer}.{'attn_qkv' if third is not None else _GPT2_LAYER.get(role, '')}.{parts[-1]}"
        if target not in stored:
            continue
        tensor = stored[target]
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        if third is not None:
            values = np.split(values, 3)[third]
        out[mine] = np.asarray(values, np.float32)
    return out


def verify(result: Any, feeds: Mapping[str, np.ndarray], run: Any) -> ArtifactReport:
    """The file read by transformers' GGUF loader (the gguf package dequantizes its blocks): each quantized weight
    against the simulation's, and the logits against the simulation's outputs on the same inputs."""
    report = ArtifactReport(KEY, "transformers GGUF loader")
    missing = [name for name in ("transformers", "gguf") if importlib.util.find_spec(name) is None]
    if missing:
        report.missing = [f"not loaded: {' and '.join(missing)} not installed (pip install gguf)"]
        return report
    model = loaded_by_consumer(lambda: _load(result.artifacts[KEY], attention_of(run.model)), report, "the file")
    if model is None:
        return report
    config = getattr(run.model, SOURCE_CONFIG, None) or {}
    names = Names(config)
    if config.get("model_type") == "opt":  # GPT-2's blocks: the file's own blocks, dequantized by the gguf package
        weights = _file_weights(result.artifacts[KEY], {t: names.rename(t) for t in result.table})
    else:
        weights = {t: w.detach().numpy() for t, w in model.named_parameters()}
    exposed = {t: result.dequantized[t] for t in result.table if t in weights and t in result.dequantized}
    values: dict[str, np.ndarray] = {name: weights[t] for t, name in exposed.items()}
    arguments = names.arguments(feeds)
    if result.output_names and "input_ids" in arguments:
        values[result.output_names[0]] = _logits(model, arguments)
    return compare(report, values, result.table, exposed, run, result.output_names[:1])
