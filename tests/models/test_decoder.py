"""The project's decoder: the standard-library corpus, training with the cache, perplexity, and the decoder on the
weight-only backends (GPTQ, AWQ, deploy + verify of both artifacts)."""

from __future__ import annotations

import math

import onnx
import pytest
import torch

from mqbench.advanced_ptq import awq, gptq
from mqbench.convert_deploy import convert_deploy
from mqbench.deploy.verify import verify_deploy
from mqbench.models.decoder import (
    DecoderRecipe,
    TinyGPT,
    held_out_perplexity,
    stdlib_corpus,
    token_windows,
    trained_decoder,
)
from mqbench.prepare_by_platform import prepare_by_platform
from mqbench.utils.state import enable_quantization


def test_the_corpus_is_the_standard_library_split_by_file():
    train, held = stdlib_corpus(200_000)
    assert len(train) == 200_000 and len(held) == 20_000
    assert b"def " in train and b"def " in held
    assert train[:2000] != held[:2000]
    assert stdlib_corpus(200_000) == (train, held)  # the same bytes every call


def test_training_lowers_perplexity_and_is_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("MQBENCH_CACHE", str(tmp_path))
    recipe = DecoderRecipe(dim=32, depth=1, heads=2, context=32, steps=60, batch_size=16, warmup=10)
    model, _train, held = trained_decoder(recipe)
    windows = token_windows(held, 33, 32, 1000)
    torch.manual_seed(recipe.seed)
    untrained = TinyGPT(recipe.dim, recipe.depth, recipe.heads, recipe.context).eval()
    assert held_out_perplexity(untrained, windows) > 200  # about 256: a uniform guess over bytes
    assert held_out_perplexity(model, windows) < 0.5 * held_out_perplexity(untrained, windows)
    assert len(list((tmp_path / "zoo").glob("tinygpt-*.pt"))) == 1
    again, _, _ = trained_decoder(recipe)  # from the cache: the same weights, no training
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values(), strict=True))


def test_perplexity_is_exp_of_the_mean_cross_entropy():
    model = TinyGPT(dim=16, depth=1, heads=2, context=8).eval()
    windows = torch.randint(0, 256, (3, 9), generator=torch.Generator().manual_seed(0))
    logits = model(windows[:, :-1])
    expected = math.exp(float(torch.nn.functional.cross_entropy(logits.reshape(-1, 256), windows[:, 1:].reshape(-1))))
    assert held_out_perplexity(model, windows, batch=2) == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("algorithm", ["gptq", "awq"])
def test_the_decoder_quantizes_deploys_and_verifies(algorithm, tmp_path):
    torch.manual_seed(0)
    model = TinyGPT(dim=128, depth=1, heads=4, context=32).eval()
    train, _ = stdlib_corpus(100_000)
    cali = list(token_windows(train, 32, 16, 1).split(8))
    qmodel = prepare_by_platform(model, "llm_w4a16")
    (gptq if algorithm == "gptq" else awq)(qmodel, cali)
    enable_quantization(qmodel)
    ids = cali[0][:2]
    result = convert_deploy(qmodel, "llm_w4a16", dummy_input=ids, output_path=str(tmp_path), model_name="gpt")
    report = verify_deploy(qmodel, result, ids)
    assert report.passed, str(report)
    # GPTQ rounds the weights in place: the float reference holds them, and the report says so (AWQ keeps them)
    assert report.fidelity is not None
    note = report.fidelity.reference_note
    assert (note is not None and "gptq rounded in place (6 layer(s))" in note) is (algorithm == "gptq"), note
    assert (note or "") in str(report)
    ops = [n.op_type for n in onnx.load(result.artifacts["matmulnbits_onnx"]).graph.node]
    assert ops.count("MatMulNBits") == 6  # q, k, v, out, fc and proj; the head onto the bytes stays float
