"""Weights kept on disk while a decoder is calibrated block by block (``attach_weights``): the same results as the
model held in memory, one block's weights loaded at a time, and clear refusals where every weight is needed."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from mqbench.advanced_ptq import (
    attach_weights,
    awq,
    calibrate,
    cross_layer_equalization,
    gptq,
    materialize,
    smooth_quant,
)
from mqbench.backends.spec import PTQRecipe
from mqbench.prepare_by_platform import prepare_by_platform
from mqbench.utils.lazy_weights import store_of

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

VOCAB = 96
BLOCK = re.compile(r"^model\.layers\.(\d+)\.")


def _config(blocks: int) -> object:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=blocks,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            tie_word_embeddings=True,
        )
    config._attn_implementation = "eager"
    return config


def _llama(blocks: int, empty: bool) -> nn.Module:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if empty:
            with accelerate.init_empty_weights():
                model = transformers.LlamaForCausalLM(_config(blocks))
            model.tie_weights()
        else:
            model = transformers.LlamaForCausalLM(_config(blocks))
    model.config.use_cache = False
    return model.eval()


def _ids(seed: int, batch: int = 4, length: int = 12) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _prepare(model: nn.Module, backend: str) -> torch.fx.GraphModule:
    config: dict = {"example_inputs": {"input_ids": _ids(0, 2, 8)}}
    if backend == "llm_w4a16":
        config["extra_qconfig_dict"] = {"w_qscheme": {"group_size": 32}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return prepare_by_platform(model, backend, config)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 3-block decoder saved as Hugging Face saves it, in shards of at most 40 kB (with their index)."""
    folder = tmp_path_factory.mktemp("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _llama(3, empty=False).save_pretrained(folder, max_shard_size="40KB")
    assert (folder / "model.safetensors.index.json").is_file() and len(list(folder.glob("*.safetensors"))) > 3
    return folder


def _watch(store, monkeypatch) -> list[set[str]]:
    """The names held in memory each time a segment's weights are written back."""
    held: list[set[str]] = []
    offload = type(store).offload

    def watched(self, tensors, label):
        held.append(set(self.loaded.values()))
        return offload(self, tensors, label)

    monkeypatch.setattr(type(store), "offload", watched)
    return held


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def test_gptq_on_weights_kept_on_disk_equals_gptq_in_memory_one_block_loaded_at_a_time(
    checkpoint: Path, tmp_path: Path, monkeypatch
) -> None:
    batches = [{"input_ids": _ids(seed)} for seed in (1, 2, 3)]
    reference = gptq(_prepare(_llama(3, empty=False), "llm_w4a16"), batches)
    qmodel = _prepare(_llama(3, empty=True), "llm_w4a16")
    store = attach_weights(qmodel, checkpoint, folder=tmp_path / "offload")
    assert len(store.pending) == 3 * 9 + 2  # 9 a block, the tied embedding and the final norm
    held = _watch(store, monkeypatch)
    gptq(qmodel, batches)
    # each segment held one block's layers (the first: the embedding); besides, norm weights (a vector each: a
    # segment starts at its block's first layer, so it computes the next block's first norm)
    layers = [{int(m[1]) for name in names if (m := BLOCK.match(name)) and "_proj." in name} for names in held]
    assert layers == [set(), {0}, {1}, {2}]
    assert "model.embed_tokens.weight" in held[0]
    others = {name for names in held for name in names if "_proj." not in name} - {"model.embed_tokens.weight"}
    assert others and all(name.endswith("norm.weight") for name in others)
    # the offload folder holds what the pass wrote; nothing is left to load or still loaded
    assert len(list((tmp_path / "offload").glob("*.pt"))) == 4
    assert not store.pending and not store.loaded and len(store.mapped) == 3 * 9 + 2  # every weight, written back
    assert qmodel.meta["gptq"].keys() == reference.meta["gptq"].keys()
    for name, row in reference.meta["gptq"].items():
        assert qmodel.meta["gptq"][name]["gptq"] == row["gptq"], name
    expected, got = _weights(reference), _weights(qmodel)
    assert expected.keys() == got.keys()
    for name, tensor in expected.items():
        assert torch.equal(tensor, got[name]), name
    assert qmodel.get_submodule("lm_head").weight is qmodel.get_submodule("model.embed_tokens").weight
    ids = _ids(9)
    assert torch.equal(qmodel(input_ids=ids).logits, reference(input_ids=ids).logits)


def test_awq_on_weights_kept_on_disk_equals_awq_in_memory(checkpoint: Path, tmp_path: Path, monkeypatch) -> None:
    """AWQ scales each block's layers while the block is loaded (the inverse scales are nodes of the graph)."""
    batches = [{"input_ids": _ids(seed)} for seed in (1, 2)]
    searches = {"grid": 5, "clip_grid": 5}
    reference = awq(_prepare(_llama(3, empty=False), "llm_w4a16"), batches, searches)
    qmodel = _prepare(_llama(3, empty=True), "llm_w4a16")
    store = attach_weights(qmodel, checkpoint, folder=tmp_path)
    held = _watch(store, monkeypatch)
    awq(qmodel, batches, searches)
    layers = [{int(m[1]) for name in names if (m := BLOCK.match(name)) and "_proj." in name} for names in held]
    assert layers == [set(), {0}, {1}, {2}]
    alphas = {site: row["alpha"] for site, row in reference.meta["awq"]["sites"].items()}
    assert {site: row["alpha"] for site, row in qmodel.meta["awq"]["sites"].items()} == alphas
    expected, got = _weights(reference), _weights(qmodel)
    assert expected.keys() == got.keys()
    for name, tensor in expected.items():
        assert torch.equal(tensor, got[name]), name


def test_awq_then_gptq_on_disk_each_pass_one_block_at_a_time(checkpoint: Path, monkeypatch) -> None:
    """The second pass loads the blocks the first memory-mapped, one at a time, and writes them back."""
    import copy

    batches = [{"input_ids": _ids(seed)} for seed in (1, 2)]
    searches = {"grid": 3, "clip_grid": 3}
    reference = gptq(awq(_prepare(_llama(3, empty=False), "llm_w4a16"), batches, searches), batches)
    qmodel = _prepare(_llama(3, empty=True), "llm_w4a16")
    store = attach_weights(qmodel, checkpoint)
    with pytest.raises(ValueError, match=r"29 weight\(s\) on disk \(attach_weights\) cannot be copied"):
        copy.deepcopy(qmodel)
    awq(qmodel, batches, searches)
    held = _watch(store, monkeypatch)
    gptq(qmodel, batches)
    layers = [{int(m[1]) for name in names if (m := BLOCK.match(name)) and "_proj." in name} for names in held]
    assert layers == [set(), {0}, {1}, {2}]
    expected, got = _weights(reference), _weights(qmodel)
    assert expected.keys() == got.keys()
    for name, tensor in expected.items():
        assert torch.equal(tensor, got[name]), name
    copied = copy.deepcopy(qmodel)  # every weight memory-mapped: the copy holds its own, and no store
    assert store_of(copied) is None and store_of(qmodel) is store
    assert torch.equal(copied(input_ids=_ids(9)).logits, reference(input_ids=_ids(9)).logits)


def test_calibration_on_weights_kept_on_disk_equals_calibration_in_memory(checkpoint: Path) -> None:
    batches = [{"input_ids": _ids(seed)} for seed in (1, 2)]
    reference = calibrate(_prepare(_llama(3, empty=False), "tensorrt_nlp"), batches, smooth=False, recipe=PTQRecipe())
    qmodel = _prepare(_llama(3, empty=True), "tensorrt_nlp")
    attach_weights(qmodel, checkpoint)
    calibrate(qmodel, batches, smooth=False, recipe=PTQRecipe())
    expected, got = _weights(reference), _weights(qmodel)
    assert expected.keys() == got.keys() and any(name.endswith("post_act_fake_quantizer.scale") for name in got)
    for name, tensor in expected.items():
        assert torch.equal(tensor, got[name]), name


def test_materialize_loads_every_weight_and_the_model_computes_the_checkpoints_model(checkpoint: Path) -> None:
    reference = _prepare(_llama(3, empty=False), "llm_w4a16")
    qmodel = _prepare(_llama(3, empty=True), "llm_w4a16")
    attach_weights(qmodel, {name: t.clone() for name, t in _llama(3, empty=False).state_dict().items()})
    assert materialize(qmodel) is qmodel and store_of(qmodel) is None
    ids = _ids(5)
    assert torch.equal(qmodel(input_ids=ids).logits, reference(input_ids=ids).logits)


@pytest.mark.parametrize(
    ("step", "message"),
    [
        (lambda m, b: cross_layer_equalization(m), r"cross_layer_equalization .* needs every weight at once"),
        (lambda m, b: smooth_quant(m, b), r"smooth_quant .* needs every weight at once, and 29 are still on disk"),
    ],
)
def test_steps_that_need_every_weight_refuse_weights_on_disk_saying_how_to_load_them(
    checkpoint: Path, step, message: str
) -> None:
    qmodel = _prepare(_llama(3, empty=True), "llm_w4a16")
    attach_weights(qmodel, checkpoint)
    with pytest.raises(ValueError, match=message + r".*materialize\(model\) first"):
        step(qmodel, [{"input_ids": _ids(1)}])
    assert len(store_of(qmodel).pending) == 29  # nothing was loaded


def test_convert_deploy_refuses_weights_still_on_disk(checkpoint: Path, tmp_path: Path) -> None:
    from mqbench.convert_deploy import convert_deploy

    qmodel = _prepare(_llama(2, empty=True), "llm_w4a16")
    attach_weights(qmodel, {k: v for k, v in _llama(2, empty=False).state_dict().items()})
    with pytest.raises(ValueError, match=r"convert_deploy \(it writes every weight\) needs every weight at once"):
        convert_deploy(qmodel, "llm_w4a16", dummy_input={"input_ids": _ids(1)}, output_path=tmp_path)
    assert not any(tmp_path.iterdir())


def test_a_checkpoint_of_another_model_is_refused_naming_what_differs(checkpoint: Path) -> None:
    qmodel = _prepare(_llama(4, empty=True), "llm_w4a16")
    with pytest.raises(ValueError, match=r"missing model\.layers\.3\.input_layernorm\.weight"):
        attach_weights(qmodel, checkpoint)
    narrow = {
        name: t[..., :-1] if name.endswith("q_proj.weight") else t for name, t in _llama(4, False).state_dict().items()
    }
    with pytest.raises(ValueError, match=r"shapes differ: model\.layers\.0\.self_attn\.q_proj\.weight: \(64, 63\)"):
        attach_weights(qmodel, narrow)
    with pytest.raises(FileNotFoundError, match=r"does not exist"):
        attach_weights(qmodel, checkpoint / "nothing")
    with pytest.raises(ValueError, match=r"no parameter of the model is on the meta device"):
        attach_weights(_prepare(_llama(2, empty=False), "llm_w4a16"), checkpoint)


def test_a_model_without_its_weights_is_not_calibrated_until_they_are_attached() -> None:
    qmodel = _prepare(_llama(2, empty=True), "llm_w4a16")
    with pytest.raises(ValueError, match=r"parameters are on the meta device .*attach_weights\(model, checkpoint\)"):
        gptq(qmodel, [{"input_ids": _ids(1)}])


def test_untied_weights_missing_from_a_tied_checkpoint_say_to_tie_them(checkpoint: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with accelerate.init_empty_weights():
            model = transformers.LlamaForCausalLM(_config(3)).eval()  # not tied: its own lm_head.weight
    model.config.use_cache = False
    if model.lm_head.weight is model.model.embed_tokens.weight:
        pytest.skip("this transformers ties the weights of an empty model itself")
    with pytest.raises(ValueError, match=r"missing lm_head\.weight .*model\.tie_weights\(\)"):
        attach_weights(_prepare(model, "llm_w4a16"), checkpoint)


def test_weights_on_disk_through_the_device_path_give_the_same_weights(checkpoint: Path, monkeypatch) -> None:
    """``device: cpu`` takes the device path (each block's weights read onto the device, moved back, written back)
    and gives what GPTQ gives the model in memory, one block loaded at a time."""
    batches = [{"input_ids": _ids(seed)} for seed in (1, 2)]
    reference = gptq(_prepare(_llama(3, empty=False), "llm_w4a16"), batches)
    qmodel = _prepare(_llama(3, empty=True), "llm_w4a16")
    store = attach_weights(qmodel, checkpoint)
    held = _watch(store, monkeypatch)
    gptq(qmodel, batches, {"device": "cpu"})
    layers = [{int(m[1]) for name in names if (m := BLOCK.match(name)) and "_proj." in name} for names in held]
    assert layers == [set(), {0}, {1}, {2}]
    expected, got = _weights(reference), _weights(qmodel)
    for name, tensor in expected.items():
        assert torch.equal(tensor, got[name]), name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_weights_on_disk_calibrated_on_cuda_end_on_the_host(checkpoint: Path) -> None:
    batches = [{"input_ids": _ids(seed)} for seed in (1, 2)]
    qmodel = _prepare(_llama(3, empty=True), "llm_w4a16")
    attach_weights(qmodel, checkpoint)
    gptq(qmodel, batches, {"device": "cuda"})
    assert {t.device.type for t in qmodel.parameters()} == {"cpu"}
    reference = gptq(_prepare(_llama(3, empty=False), "llm_w4a16"), batches)
    for name, row in reference.meta["gptq"].items():
        assert qmodel.meta["gptq"][name]["gptq"] <= row["rtn"], name


def test_a_model_transformers_offloaded_to_disk_is_calibrated_from_accelerates_loader(
    checkpoint: Path, tmp_path: Path, monkeypatch
) -> None:
    """``from_pretrained`` with the blocks on "disk": accelerate's loader is the source, its hooks are removed, and
    GPTQ gives what it gives the model loaded whole."""
    from mqbench.advanced_ptq import offloaded_weights

    batches = [{"input_ids": _ids(seed)} for seed in (1, 2)]
    reference = gptq(_prepare(_llama(3, empty=False), "llm_w4a16"), batches)
    placement = {"model.embed_tokens": "cpu", "model.layers": "disk", "model.norm": "cpu", "model.rotary_emb": "cpu"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(
            checkpoint,
            device_map={**placement, "lm_head": "cpu"},
            offload_folder=tmp_path / "accelerate",
            attn_implementation="eager",
        ).eval()
    model.config.use_cache = False
    assert model.get_submodule("model.layers.0.mlp.up_proj").weight.is_meta
    source = offloaded_weights(model)
    assert not any(hasattr(module, "_hf_hook") for module in model.modules())
    qmodel = _prepare(model, "llm_w4a16")
    store = attach_weights(qmodel, source)
    assert len(store.pending) == 3 * 9 + 2  # the blocks from disk; the embedding and the final norm from memory
    held = _watch(store, monkeypatch)
    gptq(qmodel, batches)
    layers = [{int(m[1]) for name in names if (m := BLOCK.match(name)) and "_proj." in name} for names in held]
    assert layers == [set(), {0}, {1}, {2}]
    expected, got = _weights(reference), _weights(qmodel)
    for name, tensor in expected.items():
        assert torch.equal(tensor, got[name]), name
