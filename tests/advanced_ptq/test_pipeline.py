"""The calibration pipeline: a decoder's graph cut into its blocks, the data run block by block with the cost of a few
block forwards per block, and GPTQ and AWQ giving exactly what the whole-model path gives (also from spilled
activations and with padded batches)."""

from __future__ import annotations

import copy
import itertools
import warnings

import pytest
import torch
from torch import nn

from mqbench.advanced_ptq import awq, gptq
from mqbench.advanced_ptq.pipeline import Pipeline, segments_of
from mqbench.advanced_ptq.weight_only import linear_sites
from mqbench.prepare_by_platform import prepare_by_platform

transformers = pytest.importorskip("transformers")

VOCAB = 96


def _llama(blocks: int) -> nn.Module:
    torch.manual_seed(0)
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
            tie_word_embeddings=False,
        )
        config._attn_implementation = "eager"
        model = transformers.LlamaForCausalLM(config)
    model.config.use_cache = False
    return model.eval()


def _ids(seed: int, batch: int = 4, length: int = 12) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _prepared(blocks: int, group_size: int = 32) -> torch.fx.GraphModule:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return prepare_by_platform(
            _llama(blocks),
            "llm_w4a16",
            {
                "example_inputs": {"input_ids": _ids(0, 2, 8), "attention_mask": torch.ones(2, 8, dtype=torch.long)},
                "extra_qconfig_dict": {"w_qscheme": {"group_size": group_size}},
            },
        )


def _padded(seed: int) -> dict[str, torch.Tensor]:
    """Token batches right-padded as a tokenizer pads them (the padding's rows are left out of the statistics)."""
    ids = _ids(seed)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    mask[3, 5:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def test_a_decoder_is_cut_into_its_blocks_with_the_head_in_the_last() -> None:
    qmodel = _prepared(3)
    segments = segments_of(qmodel)
    assert [s.name for s in segments] == ["start", "model.layers.0", "model.layers.1", "model.layers.2"]
    targets = [{str(n.target) for n in s.nodes if n.op == "call_module"} for s in segments]
    assert "model.embed_tokens" in targets[0]
    for k in range(3):
        assert {f"model.layers.{k}.self_attn.q_proj", f"model.layers.{k}.mlp.down_proj"} <= targets[k + 1]
        assert not any(t.startswith("model.layers.") and not t.startswith(f"model.layers.{k}.") for t in targets[k + 1])
    assert {"model.norm", "lm_head"} <= targets[3]
    nodes = [n for n in qmodel.graph.nodes if n.op != "output"]
    assert [n for s in segments for n in s.nodes] == nodes  # a partition of the graph, in order
    # a group of nodes spanning two blocks keeps them in one segment; without blocks, one segment
    q0, q1 = (next(n for n in nodes if n.target == f"model.layers.{k}.self_attn.q_proj") for k in (0, 1))
    merged = segments_of(qmodel, together=[[q0, q1]])
    assert [s.name for s in merged] == ["start", "model.layers.0", "model.layers.2"]
    assert [s.name for s in segments_of(qmodel, by_block=False)] == ["model"]
    plain = prepare_by_platform(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)).eval(), "llm_w8a16")
    assert [s.name for s in segments_of(plain)] == ["model"]


@pytest.mark.parametrize("blocks", [2, 3])
def test_gptq_runs_each_layer_once_a_batch_whatever_the_depth(blocks: int) -> None:
    """Each site's inputs are its source value, computed from the state kept just after the source of the site
    before it (that site now rounded): a layer runs only once it is rounded, once per batch, for the sites after
    it or to hand the block's output on, and the last block's last layer, which nothing after it reads, not at
    all; at any depth, block by block or with the whole model as one segment."""
    for by_block in (True, False):
        qmodel = _prepared(blocks)
        parts = ("input_layernorm", "self_attn.q_proj", "self_attn.o_proj", "mlp.up_proj", "mlp.down_proj")
        seen = {(k, part): 0 for k in range(blocks) for part in parts}
        for k, part in seen:
            module = qmodel.get_submodule(f"model.layers.{k}.{part}")
            module.register_forward_hook(lambda *args, key=(k, part), seen=seen: seen.__setitem__(key, seen[key] + 1))
        gptq(qmodel, [_padded(1), _padded(2)], {"by_block": by_block})
        last = (blocks - 1, "mlp.down_proj")
        assert seen == {key: 0 if key == last else 2 for key in seen}, by_block


class _LaterSourceFirst(nn.Module):
    """The layer met first reads a value computed after the value the layer met second reads: the second site's
    source lies before the state kept after the first's, so its inputs are gathered with hooks on its layer."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(16, 8), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scaled = x * 2.0
        return self.first(torch.relu(scaled)) + self.second(scaled)


@pytest.mark.parametrize("model", ["llama", "later_source_first"])
def test_gptq_from_the_source_value_equals_gptq_from_hooks_on_the_layers(model: str, monkeypatch) -> None:
    """Bit for bit: reading each site's source value gives every layer the inputs that hooks on the layers give."""
    if model == "llama":
        base, batches = _prepared(2), [_padded(1), _padded(2)]
    else:
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            base = prepare_by_platform(
                _LaterSourceFirst().eval(), "llm_w4a16", {"extra_qconfig_dict": {"w_qscheme": {"group_size": 8}}}
            )
        batches = [torch.randn(5, 16) for _ in range(3)]
    read = gptq(copy.deepcopy(base), batches)
    used = []
    original = Pipeline.gather_value

    def counted(*args, **kwargs):
        used.append(original(*args, **kwargs))
        return used[-1]

    monkeypatch.setattr(Pipeline, "gather_value", counted)
    gptq(copy.deepcopy(base), batches)
    assert any(used) and (all(used) if model == "llama" else not all(used)), used
    monkeypatch.setattr(Pipeline, "gather_value", lambda *args, **kwargs: False)
    hooked = gptq(copy.deepcopy(base), batches)
    for key, tensor in _weights(hooked).items():
        assert torch.equal(tensor, _weights(read)[key]), key
    assert read.meta["gptq"] == {
        k: {**r, "seconds": read.meta["gptq"][k]["seconds"]} for k, r in hooked.meta["gptq"].items()
    }


@pytest.mark.parametrize("algorithm", ["gptq", "awq"])
def test_block_by_block_equals_the_whole_model_path(algorithm: str) -> None:
    """Bit for bit: the same inputs reach every layer (padded batches, their padding left out), so the same
    weights, scales and report come out; also when the cached activations are spilled to disk (budget 0)."""
    run = {"gptq": gptq, "awq": awq}[algorithm]
    searches = {"grid": 5, "clip_grid": 5} if algorithm == "awq" else {}
    batches = [_padded(1), _padded(2), _padded(3)]
    base = _prepared(3)
    results = {}
    for name, config in {
        "whole": {"by_block": False},
        "blocks": {"by_block": True},
        "spilled": {"by_block": True, "cache_budget_mb": 0},
    }.items():
        qmodel = run(copy.deepcopy(base), batches, {**config, **searches})
        results[name] = (_weights(qmodel), qmodel.meta[algorithm], qmodel(**_padded(9)).logits)
    for name in ("blocks", "spilled"):
        weights, report, logits = results[name]
        assert weights.keys() == results["whole"][0].keys()
        for key, tensor in weights.items():
            assert torch.equal(tensor, results["whole"][0][key]), key
        assert torch.equal(logits, results["whole"][2])
        if algorithm == "gptq":
            assert {k: (r["rtn"], r["gptq"]) for k, r in report.items()} == {
                k: (r["rtn"], r["gptq"]) for k, r in results["whole"][1].items()
            }
        else:
            assert {k: s["alpha"] for k, s in report["sites"].items()} == {
                k: s["alpha"] for k, s in results["whole"][1]["sites"].items()
            }
    # and the algorithm did its work: GPTQ below rounding to nearest on every layer, AWQ scaled some site
    report = results["blocks"][1]
    if algorithm == "gptq":
        assert len(report) == 3 * 7 and all(r["gptq"] <= r["rtn"] for r in report.values())
    else:
        assert any(s["alpha"] > 0 for s in report["sites"].values())


def test_the_pipeline_hands_each_block_the_values_it_reads_and_frees_the_rest() -> None:
    """After block k the cache holds what later nodes read (the residual stream, the mask, the rotary tables),
    never a value only block k read; spilled to files past the budget and read back the same."""
    qmodel = _prepared(2)
    sites = linear_sites(qmodel)
    with Pipeline(qmodel, [_padded(1)], cache_budget_mb=0) as pipeline:
        first = pipeline.segments[0]
        pipeline.advance(first)
        held = pipeline._boundaries[0].load()
        assert pipeline._boundaries[0].file is not None and pipeline._boundaries[0].file.exists()
        assert any(v.shape == (4, 12, 64) for v in held.values() if isinstance(v, torch.Tensor))  # the stream
        later = {n.name for s in pipeline.segments[1:] for n in s.nodes}
        for name in held:
            node = pipeline._named[name]
            assert any(user.name in later for user in node.users), name
        rows = []
        block = pipeline.segments[1]
        layers = sites[0].layers[:1]
        pipeline.gather(block, layers, lambda layer, x: rows.append(x), weights=False, until=layers[0].node)
    assert sum(r.shape[0] for r in rows) == 12 + 9 + 12 + 5  # the tokens, not the padding
    with pytest.raises(RuntimeError, match="not the one the pipeline reached"), Pipeline(qmodel, [_padded(1)]) as p:
        p.advance(p.segments[1])


def _prepared_w8a8(blocks: int) -> torch.fx.GraphModule:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = _llama(blocks)
        with torch.no_grad():  # an outlier channel on the residual stream, for SmoothQuant to move
            for layer in model.model.layers:
                layer.mlp.down_proj.weight[3] *= 20
        example = {"input_ids": _ids(0, 2, 8), "attention_mask": torch.ones(2, 8, dtype=torch.long)}
        return prepare_by_platform(model, "tensorrt_nlp", {"example_inputs": example})


def test_calibration_and_smoothquant_block_by_block_equal_the_model_called_whole(monkeypatch) -> None:
    """The observers see each batch's tensors in the same order either way, and SmoothQuant's statistics are the
    same: every scale, weight and logit equal bit for bit to a run whose pipeline is the whole model."""
    from mqbench.advanced_ptq import calibrate
    from mqbench.advanced_ptq import pipeline as pipeline_module
    from mqbench.backends.spec import PTQRecipe

    batches = [_padded(1), _padded(2), _padded(3)]
    base = _prepared_w8a8(2)
    assert len(segments_of(base)) == 3
    results = []
    for whole in (False, True):
        if whole:
            monkeypatch.setattr(pipeline_module, "_stack", lambda nodes: None)
            assert [s.name for s in segments_of(base)] == ["model"]
        qmodel = calibrate(copy.deepcopy(base), batches, smooth=True, recipe=PTQRecipe())
        results.append((_weights(qmodel), qmodel(**_padded(9)).logits))
    (first, logits), (second, reference) = results
    assert first.keys() == second.keys() and any(key.endswith("_smoothing.scale") for key in first)
    for key, tensor in first.items():
        assert torch.equal(tensor, second[key]), key
    assert torch.equal(logits, reference)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"by_block": "yes"}, r"gptq config by_block must be true or false, got 'yes'"),
        ({"cache_budget_mb": -1}, r"gptq config cache_budget_mb must be a number of MiB >= 0 .*, got -1"),
        ({"cache_budget_mb": "1G"}, r"gptq config cache_budget_mb must be a number of MiB >= 0 .*, got '1G'"),
    ],
)
def test_pipeline_keys_of_another_form_are_refused(config: dict, message: str) -> None:
    qmodel = prepare_by_platform(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)).eval(), "llm_w8a16")
    with pytest.raises(ValueError, match=message):
        gptq(qmodel, [torch.randn(4, 8)], config)


@pytest.mark.parametrize(
    ("device", "message"),
    [
        ("gpu0", r"gptq config device must be a torch device such as 'cuda' .*got 'gpu0'"),
        ("meta", r"gptq config device 'meta' holds no values"),
        pytest.param(
            "cuda",
            r"gptq config device 'cuda': this machine has no CUDA device .*leave device unset",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has a CUDA device"),
        ),
    ],
)
def test_a_device_that_cannot_run_the_blocks_is_refused(device: str, message: str) -> None:
    qmodel = _prepared(2)
    before = _weights(qmodel)
    with pytest.raises(ValueError, match=message):
        gptq(qmodel, [_padded(1)], {"device": device})
    after = _weights(qmodel)
    assert all(torch.equal(before[key], after[key]) for key in before)  # refused before anything changed


def test_blocks_run_on_the_named_device_give_the_same_weights() -> None:
    """``device: cpu`` takes the device path (constants the capture wrote into the graph made on the device, the
    boundaries kept on the host, each block's tensors moved in place) and gives the default path's results bit for
    bit."""
    base = _prepared(2)
    batches = [_padded(1), _padded(2)]
    plain = gptq(copy.deepcopy(base), batches)
    placed = gptq(copy.deepcopy(base), batches, {"device": "cpu"})
    for key, tensor in _weights(plain).items():
        assert torch.equal(tensor, _weights(placed)[key]), key
    assert torch.equal(plain(**_padded(9)).logits, placed(**_padded(9)).logits)


def _tied_llama(blocks: int) -> nn.Module:
    model = _llama(blocks)
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight
    return model


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("algorithm", ["gptq", "awq"])
def test_a_host_model_calibrated_block_by_block_on_cuda(algorithm: str) -> None:
    _host_against(algorithm, "cuda")


def _host_against(algorithm: str, device: str) -> None:
    """A model on the host, each block run on ``device``: it ends on the host with its tied weight one tensor, and
    its results match the host's as far as float32 arithmetic in another order lets them. The bounds are those of
    the host against itself with every weight moved by 1e-7 (float32's rounding) on three draws, doubled: GPTQ's
    per-layer output error moved by up to 4% and the logits by up to 5% of their largest; AWQ chose another
    scale at one site of twelve and moved the logits by up to 2%."""
    run = {"gptq": gptq, "awq": awq}[algorithm]
    searches = {"grid": 5, "clip_grid": 5} if algorithm == "awq" else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = prepare_by_platform(
            _tied_llama(3),
            "llm_w4a16",
            {
                "example_inputs": {"input_ids": _ids(0, 2, 8), "attention_mask": torch.ones(2, 8, dtype=torch.long)},
                "extra_qconfig_dict": {"w_qscheme": {"group_size": 32}},
                "float_layers": [],
            },
        )
    batches = [_padded(1), _padded(2), _padded(3)]
    host = run(copy.deepcopy(base), batches, searches)
    placed = run(copy.deepcopy(base), batches, {**searches, "device": device})
    assert {t.device.type for t in itertools.chain(placed.parameters(), placed.buffers())} == {"cpu"}
    assert placed.get_submodule("model.embed_tokens").weight is placed.get_submodule("lm_head").weight
    assert _weights(host).keys() == _weights(placed).keys()
    if algorithm == "gptq":
        assert host.meta["gptq"].keys() == placed.meta["gptq"].keys()
        for name, row in placed.meta["gptq"].items():
            assert row["gptq"] <= row["rtn"], name
            assert row["gptq"] == pytest.approx(host.meta["gptq"][name]["gptq"], rel=0.08), name
    else:
        alphas = {k: v["alpha"] for k, v in host.meta["awq"]["sites"].items()}
        chosen = {k: v["alpha"] for k, v in placed.meta["awq"]["sites"].items()}
        assert chosen.keys() == alphas.keys() and sum(chosen[k] != alphas[k] for k in alphas) <= 2
    ids = _padded(9)
    reference = host(**ids).logits
    assert (placed(**ids).logits - reference).abs().max() <= 0.1 * reference.abs().max()


def test_smoothquant_holds_the_samples_of_one_block_at_a_time(monkeypatch) -> None:
    """Each block's migrations are decided once its data has run, and its samples dropped: the samples held at any
    time are those of one block's quantizers (and the block before, being decided), not of every block."""
    from mqbench.advanced_ptq import smoothing

    live: list[int] = []
    made: list[smoothing._Statistics] = []
    original_init, original_call = smoothing._Statistics.__init__, smoothing._Statistics.__call__

    def init(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        original_init(self, *args, **kwargs)
        made.append(self)

    def call(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        original_call(self, *args, **kwargs)
        live.append(sum(s.sample is not None for s in made))

    monkeypatch.setattr(smoothing._Statistics, "__init__", init)
    monkeypatch.setattr(smoothing._Statistics, "__call__", call)
    qmodel = _prepared_w8a8(4)
    chosen = smoothing.smooth_quant(qmodel, [_padded(1), _padded(2)])
    per_block = len(made) // 4
    assert len(made) == 4 * per_block and per_block >= 2 and chosen
    assert max(live) == per_block  # one block's, where a whole-model pass held all 4 x per_block until the end
    assert all(s.sample is None for s in made)
