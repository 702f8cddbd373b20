"""The GGUF file of a weight-only deployment of a Llama-architecture model: its blocks read back by the gguf
package's own dequantization, the file loaded by transformers' GGUF loader, and verified against the simulation."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from mqbench.deploy.verify import verify_deploy

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parent))
from test_compressed_tensors import _deployed, _ids, _llama, _simulated_weights  # noqa: E402

HEADS, KV_HEADS = 4, 2
GGUF_SCHEME = {"group_size": 32, "scale_dtype": "float16"}


def _llama_cpp_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's order of a query / key projection's rows: for each head, its rows ``[0, d/2)`` and
    ``[d/2, d)`` interleaved (row i of the first half, then row i of the second half)."""
    rows = weight.shape[0]
    per_head = rows // heads
    order = [
        h * per_head + half * (per_head // 2) + i for h in range(heads) for i in range(per_head // 2) for half in (0, 1)
    ]
    return weight[order]


def _read(path: str) -> dict[str, tuple[str, np.ndarray]]:
    reader = gguf.GGUFReader(path)
    return {
        t.name: (t.tensor_type.name, gguf.quants.dequantize(t.data, t.tensor_type).reshape(list(reversed(t.shape))))
        for t in reader.tensors
    }


LLAMA_CPP = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


@pytest.mark.parametrize(("backend", "kind"), [("llm_w4a16", "Q4_0"), ("llm_w8a16", "Q8_0")])
def test_the_blocks_hold_the_simulated_weights_and_transformers_computes_the_simulation(tmp_path, backend, kind):
    qmodel, result = _deployed(tmp_path, backend, GGUF_SCHEME)
    path = result.artifacts["gguf"]
    assert path.endswith(".gguf")
    tensors = _read(path)
    simulated = _simulated_weights(qmodel)
    assert len(simulated) == 14
    for name, expected in simulated.items():
        block, layer = name.split(".")[2], ".".join(name.split(".")[3:])
        found, values = tensors[f"blk.{block}.{LLAMA_CPP[layer]}.weight"]
        weight = expected.numpy()
        heads = {"self_attn.q_proj": HEADS, "self_attn.k_proj": KV_HEADS}.get(layer)
        if heads is not None:
            weight = _llama_cpp_rows(weight, heads)
        assert found == kind and np.array_equal(values, weight), name
    assert tensors["blk.0.attn_norm.weight"][0] == "F32"
    assert tensors["token_embd.weight"][0] == "F32" and "output.weight" not in tensors  # tied, float
    fields = gguf.GGUFReader(path).fields
    assert fields["general.architecture"].contents() == "llama"
    assert fields["llama.block_count"].contents() == 2 and fields["llama.attention.head_count_kv"].contents() == 2
    report = verify_deploy(qmodel, result, {"input_ids": _ids(3)}, ["gguf"], fidelity=False)
    art = report.artifacts["gguf"]
    assert report.passed, report.failures()
    assert len(art.per_tensor) == 14 and art.max_lsb_diff == 0
    (logits,) = art.outputs.values()
    assert logits.max_abs_diff <= 1e-5 * max(logits.magnitude, 1.0)


def test_an_edited_block_scale_fails_verification_naming_the_layer(tmp_path):
    qmodel, result = _deployed(tmp_path, "llm_w4a16", GGUF_SCHEME)
    path = Path(result.artifacts["gguf"])
    reader = gguf.GGUFReader(str(path))
    (tensor,) = [t for t in reader.tensors if t.name == "blk.1.ffn_up.weight"]
    start = int(tensor.data_offset)
    data = bytearray(path.read_bytes())
    scale = np.frombuffer(bytes(data[start : start + 2]), np.float16)[0]
    data[start : start + 2] = np.float16(scale * 1.5).tobytes()  # the first block's d
    path.write_bytes(bytes(data))
    report = verify_deploy(qmodel, result, {"input_ids": _ids(3)}, ["gguf"], fidelity=False)
    failures = report.failures()
    assert failures and "model.layers.1.mlp.up_proj.weight" in failures[0]


@pytest.mark.parametrize(
    ("scheme", "why"),
    [
        ({"group_size": 32}, "float32 scales (GGUF stores float16 ones)"),
        ({"group_size": 64, "scale_dtype": "float16"}, "groups of 64"),
        ({"group_size": 32, "scale_dtype": "float16", "symmetry": False}, "an asymmetric grid"),
    ],
)
def test_a_setting_gguf_cannot_hold_is_named_with_the_one_it_holds(tmp_path, scheme, why):
    heard: list[str] = []
    _, result = _deployed(tmp_path, "llm_w4a16", scheme, heard)
    (said,) = [line for line in heard if line.startswith("gguf")]
    assert why in said and "group_size: 32, scale_dtype: float16" in said
    assert "gguf" not in result.artifacts and not list(tmp_path.glob("*.gguf"))
    assert "matmulnbits_onnx" in result.artifacts


def test_the_tokenizer_is_carried_from_the_gguf_file_the_model_came_from(tmp_path):
    source = tmp_path / "source"
    source.mkdir()
    writer = gguf.GGUFWriter(str(source / "model.gguf"), "llama")
    writer.add_block_count(2)
    writer.add_embedding_length(64)
    writer.add_vocab_size(96)
    writer.add_tokenizer_model("gpt2")
    tokens = [f"t{i}" for i in range(96)]
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 96)
    writer.add_token_merges(["t 1", "t 2"])
    writer.add_bos_token_id(1)
    writer.add_tensor("token_embd.weight", np.zeros((96, 64), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    model = _llama()
    model.config._name_or_path = str(source)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from mqbench.convert_deploy import convert_deploy
        from mqbench.prepare_by_platform import prepare_by_platform
        from mqbench.utils.state import enable_calibration, enable_quantization

        qmodel = prepare_by_platform(
            model,
            "llm_w4a16",
            {"example_inputs": {"input_ids": _ids(0)}, "extra_qconfig_dict": {"w_qscheme": GGUF_SCHEME}},
        )
        enable_calibration(qmodel)
        qmodel(_ids(1))
        enable_quantization(qmodel)
        result = convert_deploy(qmodel, "llm_w4a16", dummy_input={"input_ids": _ids(2)}, output_path=tmp_path / "out")
    fields = gguf.GGUFReader(result.artifacts["gguf"]).fields
    assert fields["tokenizer.ggml.model"].contents() == "gpt2"
    assert fields["tokenizer.ggml.tokens"].contents() == tokens
    assert fields["tokenizer.ggml.merges"].contents() == ["t 1", "t 2"]
    assert fields["tokenizer.ggml.bos_token_id"].contents() == 1


def test_scale_dtype_rounds_each_group_scale_to_float16_in_the_simulation_and_after_gptq():
    from mqbench.advanced_ptq import gptq
    from mqbench.prepare_by_platform import prepare_by_platform
    from mqbench.utils.state import enable_calibration, enable_quantization

    config = {"example_inputs": {"input_ids": _ids(0)}, "extra_qconfig_dict": {"w_qscheme": GGUF_SCHEME}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qmodel = prepare_by_platform(_llama(), "llm_w4a16", config)
        enable_calibration(qmodel)
        qmodel(_ids(1))
        enable_quantization(qmodel)
    layer = qmodel.get_submodule("model.layers.0.mlp.down_proj")
    weight = layer.weight.detach().numpy().astype(np.float64)
    groups = weight.reshape(weight.shape[0], -1, 32)
    # symmetric MinMax on [-8, 7]: max |w| / 7.5, then float16's nearest value
    scale = (np.abs(groups).max(axis=2, keepdims=True) / 7.5).astype(np.float32).astype(np.float16).astype(np.float64)
    expected = (np.clip(np.rint(groups / scale), -8, 7) * scale).reshape(weight.shape).astype(np.float32)
    with torch.no_grad():
        assert np.array_equal(layer.weight_fake_quant(layer.weight).numpy(), expected)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gptq(qmodel, [{"input_ids": _ids(s)} for s in range(4)])
    for name, module in qmodel.named_modules():
        if name.endswith("weight_fake_quant"):
            assert torch.equal(module.scale, module.scale.half().float()), name
