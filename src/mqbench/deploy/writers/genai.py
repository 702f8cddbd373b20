"""An ONNX decoder with a KV cache, and the ``genai_config.json`` onnxruntime-genai generates with.

The folder holds ``model.onnx`` and ``genai_config.json`` (plus the tokenizer's files where the model's folder has
them). The model is the source architecture's decoder written op by op from the deployed weights, one graph for
prefill and decode:

* inputs ``input_ids`` ``[batch, sequence]``, ``attention_mask`` ``[batch, past + sequence]``, ``position_ids``
  ``[batch, sequence]`` and, per block ``i``, ``past_key_values.i.key`` / ``.value`` ``[batch, kv_heads, past,
  head_size]`` (past 0 for a prefill);
* outputs ``logits`` ``[batch, sequence, vocabulary]`` and ``present.i.key`` / ``.value`` (the past with this
  step's keys and values appended).

Each linear layer whose group-wise weight ``MatMulNBits`` holds is one ``MatMulNBits`` (the same operands as the
``matmulnbits_onnx`` artifact); the others multiply by their float (or dequantized) weight. Norms, the rotary
embedding (a table of cosines and sines computed as transformers computes them, gathered by position), grouped
key/value heads, the causal and padding mask and the softmax are standard ONNX ops, in float32 as the simulation.

Written for the weight-only backends on a Hugging Face Llama model (``model_type: llama``, no biases, plain rotary
embedding) and on an OPT model with GPT-2's blocks (the project's decoder: LayerNorms, biases, learned positions
looked up at ``position_ids + 2`` as OPT stores them, the tanh GELU as ONNX's ``Gelu``; genai's generic model type
``decoder``, since its ``gpt2`` type reads GPT-2's older combined key-value inputs); another model gets no folder,
and a rotated model (its inputs rotated online) gets a warning and none.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from mqbench.deploy.comparison import ArtifactReport, tensor_diff
from mqbench.deploy.onnx_graph import ort_session, save_model
from mqbench.deploy.writers.compressed_tensors import _copy_tokenizer
from mqbench.deploy.writers.hf_checkpoint import Names, hf_checkpoint, unlike_gpt2
from mqbench.deploy.writers.matmulnbits import DOMAIN, _operands, container_bits, unsupported
from mqbench.qparams import TensorQParams
from mqbench.utils.hf_capture import SOURCE_CONFIG

if TYPE_CHECKING:
    from mqbench.deploy.context import DeployContext

__all__ = ["KEY", "SUFFIX", "build_decoder", "run_step", "serve", "verify", "write", "write_folder"]

KEY = "genai"
SUFFIX = "_genai"
OPSET = 21
MASKED = float(np.finfo(np.float32).min)  # what transformers adds where attention is masked


class _Graph:
    """Nodes, initializers and names of the decoder being written."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.count = 0

    def name(self, hint: str) -> str:
        self.count += 1
        return f"{hint}_{self.count}"

    def const(self, value: Any, hint: str, dtype: Any = None) -> str:
        name = self.name(hint)
        self.initializers.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def op(
        self, op_type: str, inputs: list[str], hint: str = "", outputs: list[str] | None = None, **attrs: Any
    ) -> str:
        domain = DOMAIN if op_type == "MatMulNBits" else ""
        outs = outputs or [self.name(hint or op_type.lower())]
        self.nodes.append(helper.make_node(op_type, inputs, outs, self.name(op_type), domain=domain, **attrs))
        return outs[0]


def _linear(g: _Graph, x: str, name: str, weights: Mapping[str, np.ndarray], table: Mapping[str, TensorQParams]) -> str:
    """``x @ W.T`` for the linear layer ``name``: MatMulNBits where it holds the quantized weight, else MatMul."""
    weight = weights[f"{name}.weight"]
    entry = table.get(f"{name}.weight")
    if entry is not None and unsupported(entry, weight) is None:
        bits = container_bits(entry)
        assert bits is not None and entry.group_size is not None
        packed, scales, zeros = _operands(entry, weight, bits)
        inputs = [x, g.const(packed, f"{name}.packed"), g.const(scales, f"{name}.scales")]
        if zeros is not None:
            inputs.append(g.const(zeros, f"{name}.zero_points"))
        n, k = weight.shape
        return g.op("MatMulNBits", inputs, name, K=k, N=n, bits=bits, block_size=entry.group_size, accuracy_level=0)
    return g.op("MatMul", [x, g.const(np.ascontiguousarray(weight.T), f"{name}.weight_t", np.float32)], name)


def _rms_norm(g: _Graph, x: str, weight: np.ndarray, eps: float, hint: str) -> str:
    """transformers' RMSNorm: ``w * x / sqrt(mean(x ** 2) + eps)`` over the last axis."""
    square = g.op("Mul", [x, x], f"{hint}.square")
    mean = g.op("ReduceMean", [square, g.const([-1], "axes", np.int64)], f"{hint}.mean", keepdims=1)
    root = g.op("Sqrt", [g.op("Add", [mean, g.const(np.float32(eps), "eps")])], f"{hint}.root")
    normed = g.op("Mul", [x, g.op("Reciprocal", [root])], f"{hint}.normed")
    return g.op("Mul", [g.const(weight.astype(np.float32), f"{hint}.weight"), normed], hint)


def _rotary(g: _Graph, x: str, cos: str, sin: str, hint: str) -> str:
    """``x * cos + rotate_half(x) * sin`` (``rotate_half``: the halves of the last axis swapped, the first negated)."""
    first, second = g.name(f"{hint}.x1"), g.name(f"{hint}.x2")
    g.op("Split", [x], outputs=[first, second], axis=-1, num_outputs=2)
    rotated = g.op("Concat", [g.op("Neg", [second]), first], f"{hint}.rotated", axis=-1)
    return g.op("Add", [g.op("Mul", [x, cos]), g.op("Mul", [rotated, sin])], hint)


def _heads(g: _Graph, x: str, count: int, size: int, hint: str) -> str:
    """``[B, S, count * size]`` -> ``[B, count, S, size]``."""
    shaped = g.op("Reshape", [x, g.const([0, 0, count, size], "shape", np.int64)], f"{hint}.split")
    return g.op("Transpose", [shaped], hint, perm=[0, 2, 1, 3])


def _repeat_kv(g: _Graph, x: str, kv_heads: int, repeat: int, size: int, hint: str) -> str:
    """``[B, kv, T, D]`` -> ``[B, kv * repeat, T, D]``, each key/value head repeated for its group of query heads."""
    if repeat == 1:
        return x
    shape = g.op("Shape", [x])
    batch = g.op("Slice", [shape, g.const([0], "s", np.int64), g.const([1], "e", np.int64)])
    total = g.op("Slice", [shape, g.const([2], "s", np.int64), g.const([3], "e", np.int64)])
    wide = g.op(
        "Concat", [batch, g.const([kv_heads, repeat], "kv", np.int64), total, g.const([size], "d", np.int64)], axis=0
    )
    expanded = g.op("Expand", [g.op("Unsqueeze", [x, g.const([2], "axes", np.int64)]), wide], f"{hint}.expanded")
    return g.op("Reshape", [expanded, g.const([0, kv_heads * repeat, -1, size], "shape", np.int64)], hint)


def _rotary_tables(source: Mapping[str, Any], size: int, positions: int) -> tuple[np.ndarray, np.ndarray]:
    """The cosines and sines ``[positions, size]`` of transformers' default rotary embedding, in float32 as it
    computes them (``inv_freq = 1 / theta ** (arange(0, size, 2) / size)``, angles ``position * inv_freq``, the
    half repeated)."""
    parameters = source.get("rope_parameters") or source.get("rope_scaling") or {}
    theta = float(parameters.get("rope_theta") or source.get("rope_theta") or 10000.0)
    inv_freq = 1.0 / (theta ** (torch.arange(0, size, 2, dtype=torch.int64).float() / size))
    angles = torch.arange(positions).float()[:, None] @ inv_freq[None, :]
    full = torch.cat([angles, angles], dim=-1)
    return full.cos().numpy(), full.sin().numpy()


def _mask(g: _Graph) -> str:
    """The additive attention mask ``[B, 1, S, past + S]``: query ``i`` (at absolute position ``past + i``) sees key
    ``j`` where ``j <= past + i`` and ``attention_mask[:, j]`` is 1."""
    axes1 = g.const([1], "axes", np.int64)
    total = g.op("Gather", [g.op("Shape", ["attention_mask"]), g.const(1, "one", np.int64)], "total")
    length = g.op("Gather", [g.op("Shape", ["input_ids"]), g.const(1, "one", np.int64)], "length")
    step = g.const(1, "step", np.int64)
    keys = g.op("Range", [g.const(0, "zero", np.int64), total, step], "key_positions")
    queries = g.op("Range", [g.op("Sub", [total, length]), total, step], "query_positions")
    causal = g.op(
        "LessOrEqual",
        [g.op("Unsqueeze", [keys, g.const([0], "axes", np.int64)]), g.op("Unsqueeze", [queries, axes1])],
        "causal",
    )
    padding = g.op(
        "Unsqueeze",
        [g.op("Cast", ["attention_mask"], to=TensorProto.BOOL), g.const([1, 2], "axes", np.int64)],
        "padding",
    )
    allowed = g.op("And", [causal, padding], "allowed")
    return g.op("Where", [allowed, g.const(np.float32(0.0), "open"), g.const(np.float32(MASKED), "closed")], "mask")


class _Decoder:
    """The graph being written, its mask and its declared inputs and outputs."""

    def __init__(self, vocab: int) -> None:
        self.g = _Graph()
        self.inputs = [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch_size", "sequence_length"]),
            helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch_size", "total_sequence_length"]),
            helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch_size", "sequence_length"]),
        ]
        self.outputs = [
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch_size", "sequence_length", vocab])
        ]
        self.mask = _mask(self.g)

    def attention(self, q: str, k: str, v: str, index: int, shape: tuple[int, int, int], scaling: float | None) -> str:
        """Attention of block ``index`` over its KV cache: ``q`` ``[B, heads, S, D]``, ``k`` and ``v`` ``[B, kv_heads,
        S, D]`` appended to ``past_key_values.index.*`` as ``present.index.*``; the scores ``q k^T`` times
        ``scaling`` (None: ``q`` is scaled already); the context ``[B, S, heads * D]``."""
        g = self.g
        heads, kv_heads, size = shape
        for kind in ("key", "value"):
            self.inputs.append(
                helper.make_tensor_value_info(
                    f"past_key_values.{index}.{kind}",
                    TensorProto.FLOAT,
                    ["batch_size", kv_heads, "past_sequence_length", size],
                )
            )
            self.outputs.append(
                helper.make_tensor_value_info(
                    f"present.{index}.{kind}",
                    TensorProto.FLOAT,
                    ["batch_size", kv_heads, "total_sequence_length", size],
                )
            )
        key = g.op("Concat", [f"past_key_values.{index}.key", k], outputs=[f"present.{index}.key"], axis=2)
        value = g.op("Concat", [f"past_key_values.{index}.value", v], outputs=[f"present.{index}.value"], axis=2)
        key = _repeat_kv(g, key, kv_heads, heads // kv_heads, size, f"block{index}.keys")
        value = _repeat_kv(g, value, kv_heads, heads // kv_heads, size, f"block{index}.values")
        scores = g.op("MatMul", [q, g.op("Transpose", [key], perm=[0, 1, 3, 2])])
        if scaling is not None:
            scores = g.op("Mul", [scores, g.const(np.float32(scaling), "scaling")])
        probabilities = g.op("Softmax", [g.op("Add", [scores, self.mask])], f"block{index}.attention", axis=-1)
        context = g.op("Transpose", [g.op("MatMul", [probabilities, value])], perm=[0, 2, 1, 3])
        return g.op("Reshape", [context, g.const([0, 0, heads * size], "shape", np.int64)], f"block{index}.context")

    def model(self, logits: str) -> onnx.ModelProto:
        self.g.op("Identity", [logits], outputs=["logits"])
        graph = helper.make_graph(self.g.nodes, "decoder_with_past", self.inputs, self.outputs, self.g.initializers)
        opsets = [helper.make_opsetid("", OPSET), helper.make_opsetid(DOMAIN, 1)]
        return helper.make_model(graph, opset_imports=opsets, producer_name="mqbench")


def _llama(
    d: _Decoder, source: Mapping[str, Any], weights: Mapping[str, np.ndarray], table: Mapping[str, TensorQParams]
) -> str:
    """Llama's embedding, blocks and final norm: the hidden states ``[B, S, hidden]``."""
    g = d.g
    hidden, heads = int(source["hidden_size"]), int(source["num_attention_heads"])
    kv_heads = int(source.get("num_key_value_heads") or heads)
    size = int(source.get("head_dim") or hidden // heads)
    eps = float(source.get("rms_norm_eps") or 1e-6)
    cos_table, sin_table = _rotary_tables(source, size, int(source.get("max_position_embeddings") or 2048))
    axes1 = g.const([1], "axes", np.int64)
    cos = g.op("Unsqueeze", [g.op("Gather", [g.const(cos_table, "cos_table"), "position_ids"]), axes1], "cos")
    sin = g.op("Unsqueeze", [g.op("Gather", [g.const(sin_table, "sin_table"), "position_ids"]), axes1], "sin")
    x = g.op("Gather", [g.const(weights["model.embed_tokens.weight"], "embed_tokens"), "input_ids"], "embedded")
    for i in range(int(source["num_hidden_layers"])):
        prefix = f"model.layers.{i}"
        normed = _rms_norm(g, x, weights[f"{prefix}.input_layernorm.weight"], eps, f"{prefix}.input_layernorm")
        q = _heads(g, _linear(g, normed, f"{prefix}.self_attn.q_proj", weights, table), heads, size, f"{prefix}.q")
        k = _heads(g, _linear(g, normed, f"{prefix}.self_attn.k_proj", weights, table), kv_heads, size, f"{prefix}.k")
        v = _heads(g, _linear(g, normed, f"{prefix}.self_attn.v_proj", weights, table), kv_heads, size, f"{prefix}.v")
        q, k = _rotary(g, q, cos, sin, f"{prefix}.q_rot"), _rotary(g, k, cos, sin, f"{prefix}.k_rot")
        context = d.attention(q, k, v, i, (heads, kv_heads, size), size**-0.5)
        x = g.op("Add", [x, _linear(g, context, f"{prefix}.self_attn.o_proj", weights, table)], f"{prefix}.residual")
        normed = _rms_norm(
            g, x, weights[f"{prefix}.post_attention_layernorm.weight"], eps, f"{prefix}.post_attention_layernorm"
        )
        gate = _linear(g, normed, f"{prefix}.mlp.gate_proj", weights, table)
        up = _linear(g, normed, f"{prefix}.mlp.up_proj", weights, table)
        act = g.op("Mul", [g.op("Mul", [gate, g.op("Sigmoid", [gate])]), up], f"{prefix}.mlp.act")
        x = g.op("Add", [x, _linear(g, act, f"{prefix}.mlp.down_proj", weights, table)], f"{prefix}.output")
    return _rms_norm(g, x, weights["model.norm.weight"], eps, "model.norm")


def _layer_norm(g: _Graph, x: str, weights: Mapping[str, np.ndarray], name: str) -> str:
    """``nn.LayerNorm`` ``name`` (gain and bias, epsilon 1e-5) over the last axis."""
    scale, bias = (
        g.const(weights[f"{name}.{leaf}"].astype(np.float32), f"{name}.{leaf}") for leaf in ("weight", "bias")
    )
    return g.op("LayerNormalization", [x, scale, bias], name, axis=-1, epsilon=1e-5)


def _affine(g: _Graph, x: str, name: str, weights: Mapping[str, np.ndarray], table: Mapping[str, TensorQParams]) -> str:
    """The linear layer ``name`` with its bias."""
    return g.op("Add", [_linear(g, x, name, weights, table), g.const(weights[f"{name}.bias"], f"{name}.bias")], name)


def _opt(
    d: _Decoder, source: Mapping[str, Any], weights: Mapping[str, np.ndarray], table: Mapping[str, TensorQParams]
) -> str:
    """OPT's embedding (positions looked up at ``position_ids + 2``), its blocks with GPT-2's tanh GELU (the
    query scaled before its product with the keys, as OPT scales it) and the final norm."""
    g = d.g
    hidden, heads = int(source["hidden_size"]), int(source["num_attention_heads"])
    size = hidden // heads
    scaling = g.const(np.float32(size**-0.5), "scaling")
    positions = g.op("Add", ["position_ids", g.const(2, "offset", np.int64)], "positions")
    x = g.op(
        "Add",
        [
            g.op("Gather", [g.const(weights["model.decoder.embed_tokens.weight"], "embed_tokens"), "input_ids"]),
            g.op("Gather", [g.const(weights["model.decoder.embed_positions.weight"], "embed_positions"), positions]),
        ],
        "embedded",
    )
    for i in range(int(source["num_hidden_layers"])):
        prefix = f"model.decoder.layers.{i}"
        normed = _layer_norm(g, x, weights, f"{prefix}.self_attn_layer_norm")
        q = g.op("Mul", [_affine(g, normed, f"{prefix}.self_attn.q_proj", weights, table), scaling], f"{prefix}.q")
        q = _heads(g, q, heads, size, f"{prefix}.q_heads")
        k = _heads(g, _affine(g, normed, f"{prefix}.self_attn.k_proj", weights, table), heads, size, f"{prefix}.k")
        v = _heads(g, _affine(g, normed, f"{prefix}.self_attn.v_proj", weights, table), heads, size, f"{prefix}.v")
        context = d.attention(q, k, v, i, (heads, heads, size), None)
        x = g.op("Add", [x, _affine(g, context, f"{prefix}.self_attn.out_proj", weights, table)], f"{prefix}.residual")
        normed = _layer_norm(g, x, weights, f"{prefix}.final_layer_norm")
        act = g.op("Gelu", [_affine(g, normed, f"{prefix}.fc1", weights, table)], f"{prefix}.gelu", approximate="tanh")
        x = g.op("Add", [x, _affine(g, act, f"{prefix}.fc2", weights, table)], f"{prefix}.output")
    return _layer_norm(g, x, weights, "model.decoder.final_layer_norm")


_EMBEDDING = {"llama": "model.embed_tokens.weight", "opt": "model.decoder.embed_tokens.weight"}


def build_decoder(
    source: Mapping[str, Any], weights: Mapping[str, np.ndarray], table: Mapping[str, TensorQParams]
) -> onnx.ModelProto:
    """The decoder with a KV cache (see the module docstring) from ``source`` (the Hugging Face configuration, a
    Llama or an OPT with GPT-2's blocks) and ``weights`` (parameter name -> float32 array, the deployed values,
    by the architecture's names; ``table`` keyed by the same names)."""
    d = _Decoder(int(source["vocab_size"]))
    kind = str(source.get("model_type"))
    x = _opt(d, source, weights, table) if kind == "opt" else _llama(d, source, weights, table)
    head = dict(weights)
    head.setdefault("lm_head.weight", weights[_EMBEDDING[kind]])  # tied
    return d.model(_linear(d.g, x, "lm_head", head, table))


def _genai_config(source: Mapping[str, Any], filename: str) -> dict[str, Any]:
    heads = int(source["num_attention_heads"])
    hidden = int(source["hidden_size"])
    eos = source.get("eos_token_id")
    eos = eos if eos is not None else 0
    return {
        "model": {
            "bos_token_id": source.get("bos_token_id") if source.get("bos_token_id") is not None else 0,
            "context_length": int(source.get("max_position_embeddings") or 2048),
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "filename": filename,
                "head_size": int(source.get("head_dim") or hidden // heads),
                "hidden_size": hidden,
                "inputs": {
                    "input_ids": "input_ids",
                    "attention_mask": "attention_mask",
                    "position_ids": "position_ids",
                    "past_key_names": "past_key_values.%d.key",
                    "past_value_names": "past_key_values.%d.value",
                },
                "outputs": {
                    "logits": "logits",
                    "present_key_names": "present.%d.key",
                    "present_value_names": "present.%d.value",
                },
                "num_attention_heads": heads,
                "num_hidden_layers": int(source["num_hidden_layers"]),
                "num_key_value_heads": int(source.get("num_key_value_heads") or heads),
            },
            "eos_token_id": eos,
            "pad_token_id": source.get("pad_token_id") if source.get("pad_token_id") is not None else eos,
            "type": "decoder" if source.get("model_type") == "opt" else "llama",  # genai's generic decoder
            "vocab_size": int(source["vocab_size"]),
        },
        "search": {
            "diversity_penalty": 0.0,
            "do_sample": False,
            "early_stopping": True,
            "length_penalty": 1.0,
            "max_length": int(source.get("max_position_embeddings") or 2048),
            "min_length": 0,
            "no_repeat_ngram_size": 0,
            "num_beams": 1,
            "num_return_sequences": 1,
            "past_present_share_buffer": False,
            "repetition_penalty": 1.0,
            "temperature": 1.0,
            "top_k": 1,
            "top_p": 1.0,
        },
    }


def write(context: DeployContext) -> Path | None:
    """``{model_name}_genai/`` (``model.onnx``, ``genai_config.json``); None for a model that is not a plain
    Llama-architecture Hugging Face model or an OPT one with GPT-2's blocks (a rotated one with a warning)."""
    checkpoint = hf_checkpoint(context, KEY, ("llama", "opt"))
    if checkpoint is None:
        return None
    source = checkpoint.config
    rope = source.get("rope_parameters") or source.get("rope_scaling") or {}
    if rope.get("rope_type", "default") != "default" or source.get("attention_bias") or source.get("mlp_bias"):
        return None
    if source.get("model_type") == "opt" and unlike_gpt2(source):
        return None
    activations = [tensor for tensor, entry in context.table.items() if entry.kind != "weight"]
    if activations:
        return None  # weight-only decoders only
    names = checkpoint.names
    weights = {names.rename(name): value.float().numpy() for name, value in checkpoint.weights.items()}
    table = {names.rename(name): entry for name, entry in context.table.items()}
    return write_folder(context.folder / f"{context.model_name}{SUFFIX}", source, weights, table)


def write_folder(
    folder: Path, source: Mapping[str, Any], weights: Mapping[str, np.ndarray], table: Mapping[str, TensorQParams]
) -> Path:
    """``folder`` (created) with the decoder of ``weights`` (``table``'s quantized layers as MatMulNBits; an empty
    table: the float decoder), ``genai_config.json`` and the tokenizer's files of the source's folder."""
    folder.mkdir()
    save_model(build_decoder(source, weights, table), folder / "model.onnx")
    (folder / "genai_config.json").write_text(json.dumps(_genai_config(source, "model.onnx"), indent=2) + "\n")
    _copy_tokenizer(source, folder)
    return folder


def _session(folder: str) -> Any:
    return ort_session(str(Path(folder) / "model.onnx"), optimize=False)


def run_step(session: Any, config: Mapping[str, Any], ids: np.ndarray, past: list[np.ndarray] | None) -> tuple:
    """One call of the decoder: (logits, presents) for ``ids`` ``[B, S]`` after ``past`` (None: a prefill)."""
    decoder = config["model"]["decoder"]
    batch, length = ids.shape
    layers, kv, size = decoder["num_hidden_layers"], decoder["num_key_value_heads"], decoder["head_size"]
    if past is None:
        past = [np.zeros((batch, kv, 0, size), np.float32)] * (2 * layers)
    before = past[0].shape[2]
    feeds = {
        "input_ids": ids.astype(np.int64),
        "attention_mask": np.ones((batch, before + length), np.int64),
        "position_ids": np.broadcast_to(np.arange(before, before + length, dtype=np.int64), (batch, length)).copy(),
    }
    for i in range(layers):
        feeds[f"past_key_values.{i}.key"], feeds[f"past_key_values.{i}.value"] = past[2 * i], past[2 * i + 1]
    outputs = session.run(None, feeds)
    return outputs[0], list(outputs[1:])


def verify(result: Any, feeds: Mapping[str, np.ndarray], run: Any) -> ArtifactReport:
    """The decoder on onnxruntime in two calls, a prefill of all tokens but the last and a decode step of the last
    one after its KV cache: the logits of both against the simulation's on the whole sequence (causal, with float
    activations: the prefix's logits are the simulation's first positions)."""
    report = ArtifactReport(KEY, "onnxruntime (KV cache)")
    folder = result.artifacts[KEY]
    config = json.loads((Path(folder) / "genai_config.json").read_text())
    ids = np.asarray(Names(getattr(run.model, SOURCE_CONFIG, None) or {}).arguments(feeds)["input_ids"])
    session = _session(folder)
    prefill, past = run_step(session, config, ids[:, :-1], None)
    decode, _ = run_step(session, config, ids[:, -1:], past)
    simulated = np.asarray(run.free.outputs[0])
    report.outputs["logits (prefill)"] = tensor_diff("logits (prefill)", None, simulated[:, :-1], prefill)
    report.outputs["logits (decode step)"] = tensor_diff("logits (decode step)", None, simulated[:, -1:], decode)
    report.local_outputs = dict(report.outputs)
    return report


def serve(result: Any) -> Any:
    """The decoder as onnxruntime serves it: its logits for a prefill of the whole input."""
    folder = result.artifacts[KEY]
    config = json.loads((Path(folder) / "genai_config.json").read_text())
    session = _session(folder)

    def logits(feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        ids = feeds["input_ids"] if "input_ids" in feeds else next(iter(feeds.values()))  # one input: token ids
        return [run_step(session, config, np.asarray(ids), None)[0]]

    return logits
