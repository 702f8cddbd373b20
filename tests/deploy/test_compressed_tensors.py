"""The compressed-tensors folder of a weight-only deployment of a Hugging Face decoder: read back by
compressed-tensors' own unpacking and transformers' loader, and verified against the simulation."""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from mqbench.advanced_ptq import awq, calibrate, restore_smoothing
from mqbench.convert_deploy import convert_deploy
from mqbench.deploy.verify import verify_deploy
from mqbench.deploy.writers.compressed_tensors import pack_bits
from mqbench.prepare_by_platform import prepare_by_platform
from mqbench.utils.state import enable_calibration, enable_quantization

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")
packing = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
quant_config = pytest.importorskip("compressed_tensors.quantization")

VOCAB = 96


def _llama(initializer_range: float = 0.02, attention: str | None = None) -> nn.Module:
    """A 2-block Llama decoder, tied, random; a larger ``initializer_range`` gives it greedy continuations that do
    not settle on one token."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
            tie_word_embeddings=True,
            initializer_range=initializer_range,
        )
        if attention is not None:
            config._attn_implementation = attention
        model = transformers.LlamaForCausalLM(config)
    model.config.use_cache = False
    return model.eval()


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(seed))


def _deployed(
    tmp_path: Path,
    backend: str,
    scheme: dict | None,
    heard: list | None = None,
    model: nn.Module | None = None,
    before: Callable[[nn.Module], None] | None = None,
    **config,
):
    """The decoder prepared, calibrated and deployed; the deployment's warnings appended to ``heard``; ``before``
    changes the prepared model before it is calibrated."""
    options: dict = {"example_inputs": {"input_ids": _ids(0)}, **config}
    if scheme is not None:
        options["extra_qconfig_dict"] = {"w_qscheme": scheme}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qmodel = prepare_by_platform(_llama() if model is None else model, backend, options)
        if before is not None:
            before(qmodel)
        enable_calibration(qmodel)
        qmodel(_ids(1))
        enable_quantization(qmodel)
        del caught[:]
        result = convert_deploy(qmodel, backend, dummy_input={"input_ids": _ids(2)}, output_path=tmp_path)
    if heard is not None:
        heard.extend(str(w.message) for w in caught)
    return qmodel, result


def _bit_string_packing(values: np.ndarray, bits: int) -> np.ndarray:
    """Each row's values written as one little-endian bit string (element i at bit i * bits), padded to whole
    32-element chunks, then cut into 32-bit words: written here bit by bit."""
    rows = []
    for row in values:
        length = -(-len(row) // 32) * 32 * bits
        string = [0] * length
        for i, value in enumerate(row):
            for b in range(bits):
                string[i * bits + b] = (int(value) >> b) & 1
        words = [sum(string[w * 32 + k] << k for k in range(32)) for w in range(length // 32)]
        rows.append(words[: -(-len(row) * bits // 32)])
    return np.array(rows, np.uint64).astype(np.uint32).view(np.int32)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 8])
def test_dense_packing_is_the_little_endian_bit_string_and_compressed_tensors_unpacks_it(bits):
    rng = np.random.default_rng(bits)
    values = rng.integers(0, 2**bits, size=(3, 45))
    packed = pack_bits(values, bits)
    assert np.array_equal(packed, _bit_string_packing(values, bits))
    signed = torch.from_numpy(values - 2 ** (bits - 1))
    unpacked = packing.unpack_from_int32(torch.from_numpy(packed), bits, torch.Size([3, 45]))
    assert torch.equal(unpacked.long(), signed)


def _simulated_weights(qmodel: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, module in qmodel.named_modules():
        quantizer = getattr(module, "weight_fake_quant", None)
        if quantizer is not None and isinstance(module, nn.Linear):
            with torch.no_grad():
                out[name] = quantizer(module.weight.detach())
    return out


def _transformers_computes_the_simulation(qmodel: nn.Module, result) -> None:
    """transformers' loader: the verification compares each of the 14 decompressed weights (0 LSB) and the logits
    (within 1e-5 of their magnitude) with the simulation."""
    report = verify_deploy(qmodel, result, {"input_ids": _ids(3)}, ["compressed_tensors"], fidelity=False)
    art = report.artifacts["compressed_tensors"]
    assert report.passed, report.failures()
    assert len(art.per_tensor) == 14 and art.max_lsb_diff == 0
    (logits,) = art.outputs.values()
    assert logits.max_abs_diff <= 1e-5 * max(logits.magnitude, 1.0)


@pytest.mark.parametrize(
    ("backend", "scheme", "strategy", "symmetric"),
    [
        ("llm_w4a16", {"group_size": 32}, "group", True),
        ("llm_w4a16", {"group_size": 16, "symmetry": False}, "group", False),
        ("llm_w8a16", {"group_size": 64}, "group", True),
        ("llm_w8a16", {"group_size": None}, "channel", True),
    ],
)
def test_the_folder_holds_the_simulated_weights_and_transformers_computes_the_simulation(
    tmp_path, backend, scheme, strategy, symmetric
):
    qmodel, result = _deployed(tmp_path, backend, scheme)
    folder = Path(result.artifacts["compressed_tensors"])
    config = json.loads((folder / "config.json").read_text())
    quantization = config["quantization_config"]
    parsed = quant_config.QuantizationConfig.model_validate(quantization)  # the package's own schema
    assert parsed.format == "pack-quantized" and quantization["quant_method"] == "compressed-tensors"
    (group,) = quantization["config_groups"].values()
    weights = group["weights"]
    bits = 4 if backend == "llm_w4a16" else 8
    assert (weights["num_bits"], weights["strategy"], weights["symmetric"]) == (bits, strategy, symmetric)
    assert group["targets"] == ["Linear"] and quantization["ignore"] == ["lm_head"]  # the output layer stays float
    # the file read by compressed-tensors' own unpacking: (q - z) * s is the simulation's weight, bit for bit
    tensors = safetensors_torch.load_file(str(folder / "model.safetensors"))
    simulated = _simulated_weights(qmodel)
    assert len(simulated) == 14
    for name, expected in simulated.items():
        shape = torch.Size(tensors[f"{name}.weight_shape"].tolist())
        q = packing.unpack_from_int32(tensors[f"{name}.weight_packed"], bits, shape).double()
        scale = tensors[f"{name}.weight_scale"].double()
        zero = torch.zeros_like(scale)
        if not symmetric:
            zero = packing.unpack_from_int32(
                tensors[f"{name}.weight_zero_point"], bits, torch.Size(scale.shape), packed_dim=0
            ).double()
        repeat = shape[1] // scale.shape[1]
        weight = (q - zero.repeat_interleave(repeat, 1)) * scale.repeat_interleave(repeat, 1)
        assert torch.equal(weight.float(), expected), name
    assert f"{name}.weight" not in tensors
    assert "lm_head.weight" not in tensors  # tied: the runtime ties it to the embedding again
    _transformers_computes_the_simulation(qmodel, result)


def test_a_quantized_output_layer_is_written_untied(tmp_path):
    qmodel, result = _deployed(tmp_path, "llm_w4a16", {"group_size": 32}, float_layers=[])
    folder = Path(result.artifacts["compressed_tensors"])
    config = json.loads((folder / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and config["quantization_config"]["ignore"] == []
    tensors = safetensors_torch.load_file(str(folder / "model.safetensors"))
    assert "lm_head.weight_packed" in tensors and "model.embed_tokens.weight" in tensors
    report = verify_deploy(qmodel, result, {"input_ids": _ids(3)}, ["compressed_tensors"], fidelity=False)
    assert report.passed, report.failures()


def test_an_edited_scale_fails_verification_naming_the_layer(tmp_path):
    qmodel, result = _deployed(tmp_path, "llm_w4a16", {"group_size": 32})
    path = Path(result.artifacts["compressed_tensors"]) / "model.safetensors"
    tensors = safetensors_torch.load_file(str(path))
    tensors["model.layers.1.mlp.up_proj.weight_scale"][3, 0] *= 1.5
    safetensors_torch.save_file(tensors, str(path), metadata={"format": "pt"})
    report = verify_deploy(qmodel, result, {"input_ids": _ids(3)}, ["compressed_tensors"], fidelity=False)
    failures = [line for line in report.failures() if line.startswith("compressed_tensors")]
    assert failures and "model.layers.1.mlp.up_proj.weight" in failures[0]
    assert report.artifacts["compressed_tensors"].per_tensor["model.layers.1.mlp.up_proj.weight"].max_lsb_diff >= 1


def test_groups_the_format_cannot_hold_are_named_and_the_onnx_artifacts_still_written(tmp_path):
    heard: list[str] = []
    _, result = _deployed(tmp_path, "llm_w4a16", {"group_size": 48}, heard)
    (said,) = [line for line in heard if line.startswith("compressed_tensors")]
    assert "not written" in said and "groups of 48 over 64 input channels" in said and "32 divides them" in said
    assert "compressed_tensors" not in result.artifacts and "matmulnbits_onnx" in result.artifacts
    assert not list(tmp_path.glob("*_compressed_tensors"))


def test_a_model_that_is_not_a_hugging_face_model_has_no_such_folder(tmp_path):
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8)).eval()
    qmodel = prepare_by_platform(model, "llm_w4a16", {"extra_qconfig_dict": {"w_qscheme": {"group_size": 32}}})
    enable_calibration(qmodel)
    qmodel(torch.randn(4, 64))
    enable_quantization(qmodel)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about: the format is for Hugging Face models
        result = convert_deploy(qmodel, "llm_w4a16", {"x": [2, 64]}, output_path=tmp_path)
    assert sorted(result.artifacts) == ["deploy_onnx", "matmulnbits_onnx", "onnx"]


def test_a_second_deployment_into_the_folder_replaces_the_first(tmp_path):
    _, first = _deployed(tmp_path, "llm_w4a16", {"group_size": 32})
    stale = Path(first.artifacts["compressed_tensors"]) / "stale.txt"
    stale.write_text("from before")
    qmodel, second = _deployed(tmp_path, "llm_w8a16", {"group_size": 32})
    folder = Path(second.artifacts["compressed_tensors"])
    assert folder == stale.parent and not stale.exists()
    bits = json.loads((folder / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    assert bits["weights"]["num_bits"] == 8
    assert verify_deploy(qmodel, second, {"input_ids": _ids(3)}, ["compressed_tensors"], fidelity=False).passed


def test_a_rotated_model_is_not_written_since_its_architecture_cannot_compute_it(tmp_path):
    from mqbench.advanced_ptq import hadamard_rotation

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qmodel = prepare_by_platform(
            _llama(),
            "llm_w4a16",
            {"example_inputs": {"input_ids": _ids(0)}, "extra_qconfig_dict": {"w_qscheme": {"group_size": 32}}},
        )
        hadamard_rotation(qmodel, [{"input_ids": _ids(1)}])
    with pytest.warns(UserWarning, match=r"compressed_tensors: not written, the Hadamard rotation changed the"):
        result = convert_deploy(qmodel, "llm_w4a16", dummy_input={"input_ids": _ids(2)}, output_path=tmp_path)
    assert "compressed_tensors" not in result.artifacts and "matmulnbits_onnx" in result.artifacts


def test_a_folder_transformers_cannot_load_is_a_failed_verdict_saying_why(tmp_path):
    qmodel, result = _deployed(tmp_path, "llm_w4a16", {"group_size": 32})
    path = Path(result.artifacts["compressed_tensors"]) / "model.safetensors"
    tensors = safetensors_torch.load_file(str(path))
    del tensors["model.layers.0.mlp.up_proj.weight_packed"]
    safetensors_torch.save_file(tensors, str(path), metadata={"format": "pt"})
    report = verify_deploy(qmodel, result, {"input_ids": _ids(3)}, ["compressed_tensors"], fidelity=False)
    (failure,) = report.failures()
    assert failure.startswith("compressed_tensors:") and "transformers did not load the folder" in failure


# -- layers that quantize their inputs too: int-quantized (W8A8) and float-quantized (FP8) --------------------------
NARROW = {"extra_qconfig_dict": {"a_qscheme": {"symmetric_range": True}}}  # implicit int8's [-127, 127] inputs


def _layer_inputs(qmodel: nn.Module, layer: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The float input of the simulation's ``layer`` (before its input quantizer) and its output, on ``_ids(3)``."""
    node = next(n for n in qmodel.graph.nodes if n.op == "call_module" and n.target == layer)
    quantizer = node.args[0]
    seen: dict[str, torch.Tensor] = {}
    hooks = [
        qmodel.get_submodule(str(quantizer.target)).register_forward_pre_hook(
            lambda _, args: seen.setdefault("x", args[0].detach().clone())
        ),
        qmodel.get_submodule(layer).register_forward_hook(lambda *a: seen.setdefault("y", a[2].detach().clone())),
    ]
    with torch.no_grad():
        qmodel(_ids(3))
    for hook in hooks:
        hook.remove()
    return seen["x"], seen["y"]


@pytest.mark.parametrize(
    ("backend", "config", "fmt"),
    [("tensorrt_nlp", {}, "int-quantized"), ("tensorrt_fp8", {}, "float-quantized")],
)
def test_a_w8a8_folder_holds_the_weights_and_input_scales_and_transformers_computes_the_simulation(
    tmp_path, backend, config, fmt
):
    qmodel, result = _deployed(tmp_path, backend, None, **config)
    folder = Path(result.artifacts["compressed_tensors"])
    quantization = json.loads((folder / "config.json").read_text())["quantization_config"]
    parsed = quant_config.QuantizationConfig.model_validate(quantization)
    assert parsed.format == fmt and quantization["ignore"] == ["lm_head"]
    (group,) = quantization["config_groups"].values()
    kind = "int" if fmt == "int-quantized" else "float"
    assert group["weights"]["type"] == kind and group["weights"]["strategy"] == "channel"
    inputs = group["input_activations"]
    assert (inputs["type"], inputs["strategy"], inputs["dynamic"], inputs["num_bits"]) == (kind, "tensor", False, 8)
    tensors = safetensors_torch.load_file(str(folder / "model.safetensors"))
    assert tensors["model.layers.0.mlp.up_proj.weight"].dtype == (torch.int8 if kind == "int" else torch.float8_e4m3fn)
    for name, expected in _simulated_weights(qmodel).items():  # q * s, the file's weight, is the simulation's
        weight = tensors[f"{name}.weight"].float() * tensors[f"{name}.weight_scale"]
        assert torch.equal(weight, expected), name
    # one layer computed from the file alone, with the runtime's input rounding written here: the simulation's output
    x, y = _layer_inputs(qmodel, "model.layers.1.mlp.down_proj")
    s = tensors["model.layers.1.mlp.down_proj.input_scale"]
    if kind == "int":
        x_q = torch.clamp(torch.round(x / s), -128, 127) * s
    else:
        x_q = torch.clamp(x / s, -448, 448).to(torch.float8_e4m3fn).float() * s
    w = tensors["model.layers.1.mlp.down_proj.weight"].float() * tensors["model.layers.1.mlp.down_proj.weight_scale"]
    # float32 dot products of length K agree within K * 2**-24 * sum(|x| |w|) whatever the summation order
    bound = w.shape[1] * 2.0**-24 * (x_q.abs() @ w.abs().T)
    assert ((x_q @ w.T - y).abs() <= bound).all()
    _transformers_computes_the_simulation(qmodel, result)


def test_tensorrt_inputs_on_the_narrow_grid_are_refused_naming_the_setting_that_holds(tmp_path):
    heard: list[str] = []
    _, result = _deployed(tmp_path, "tensorrt_nlp", None, heard, **NARROW)
    (said,) = [line for line in heard if line.startswith("compressed_tensors")]
    assert "inputs on the grid [-127, 127]" in said and "'symmetric_range': False" in said and "and 5 more" in said
    assert "compressed_tensors" not in result.artifacts and "calib_cache" in result.artifacts


def test_quantized_attention_products_are_refused(tmp_path):
    heard: list[str] = []
    _, result = _deployed(tmp_path, "tensorrt_fp8", None, heard, model=_llama(attention="eager"))
    (said,) = [line for line in heard if line.startswith("compressed_tensors")]
    assert "the format quantizes the inputs of linear layers only" in said and "matmul" in said
    assert "compressed_tensors" not in result.artifacts


def _smoothed(quantizers: list[str]) -> Callable[[nn.Module], None]:
    """Per-channel scales in front of the named activation quantizers, as SmoothQuant leaves them."""

    def smooth(qmodel: nn.Module) -> None:
        generator = torch.Generator().manual_seed(5)
        saved = {f"{q}_smoothing.scale": 0.5 + 1.5 * torch.rand(64, generator=generator) for q in quantizers}
        restore_smoothing(qmodel, saved)
        qmodel.load_state_dict({**qmodel.state_dict(), **saved})

    return smooth


def test_input_scales_after_a_norm_are_folded_into_its_gain_and_others_refused(tmp_path):
    norms = ["model_layers_0_input_layernorm", "model_layers_1_post_attention_layernorm"]
    folded = _smoothed([f"{n}_post_act_fake_quantizer" for n in norms])
    qmodel, result = _deployed(tmp_path / "a", "tensorrt_nlp", None, before=folded)
    tensors = safetensors_torch.load_file(str(Path(result.artifacts["compressed_tensors"]) / "model.safetensors"))
    scale = qmodel.get_submodule("model_layers_0_input_layernorm_post_act_fake_quantizer_smoothing").scale
    gain = qmodel.get_submodule("model.layers.0.input_layernorm").weight.detach()
    torch.testing.assert_close(tensors["model.layers.0.input_layernorm.weight"], gain * scale, rtol=0, atol=0)
    report = verify_deploy(qmodel, result, {"input_ids": _ids(3)}, ["compressed_tensors"], fidelity=False)
    assert report.passed, report.failures()
    heard: list[str] = []
    unfoldable = _smoothed(["reshape_6_post_act_fake_quantizer"])  # the output projection's input
    _, result = _deployed(tmp_path / "b", "tensorrt_nlp", None, heard, before=unfoldable)
    (said,) = [line for line in heard if line.startswith("compressed_tensors")]
    assert "reshape_6_post_act_fake_quantizer_smoothing" in said and "smooth=False" in said
    assert "compressed_tensors" not in result.artifacts


def test_awq_scales_that_no_norm_takes_are_refused_by_every_checkpoint(tmp_path):
    heard: list[str] = []

    def scaled(qmodel: nn.Module) -> None:
        awq(qmodel, [_ids(1)], {"grid": 2, "clip": False})

    _, result = _deployed(tmp_path, "llm_w4a16", {"group_size": 32, "scale_dtype": "float16"}, heard, before=scaled)
    for key in ("compressed_tensors", "gguf", "genai"):
        (said,) = [line for line in heard if line.startswith(key)]
        assert "not after a norm" in said and "awq" in said, said
        assert key not in result.artifacts
    assert "matmulnbits_onnx" in result.artifacts


def test_smoothquant_after_norms_only_is_written_and_computes_the_simulation(tmp_path):
    gains: dict[str, torch.Tensor] = {}

    def smoothed(qmodel: nn.Module) -> None:
        before = {n: p.detach().clone() for n, p in qmodel.named_parameters() if n.endswith("layernorm.weight")}
        calibrate(qmodel, [_ids(1), _ids(4)], smooth="after_norm")
        assert not [n for n, _ in qmodel.named_modules() if n.endswith("_smoothing")]  # no scale node: in the gains
        gains.update({n: p.detach() for n, p in qmodel.named_parameters() if n in before and not p.equal(before[n])})

    qmodel, result = _deployed(tmp_path, "tensorrt_nlp", None, before=smoothed)
    assert gains  # norms' gains changed, the architecture not
    tensors = safetensors_torch.load_file(str(Path(result.artifacts["compressed_tensors"]) / "model.safetensors"))
    assert all(torch.equal(tensors[name], gain) for name, gain in gains.items())
    report = verify_deploy(qmodel, result, {"input_ids": _ids(3)}, ["compressed_tensors"], fidelity=False)
    assert report.passed, report.failures()
    (logits,) = report.artifacts["compressed_tensors"].outputs.values()
    assert logits.max_abs_diff == 0  # the same ops on the same values: bit for bit
    with pytest.raises(ValueError, match="smooth must be True, False, 'after_norm' or None"):
        calibrate(qmodel, [_ids(1)], smooth="norms")
