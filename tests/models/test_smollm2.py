"""A real pretrained LLM: the first blocks of SmolLM2-135M-Instruct (real weights, Llama architecture, tied
embeddings, width 576 that groups of 128 do not divide), called with ``input_ids`` alone, as a user calls it.

Every transform keeps the float function with its quantizers off; the LLM backends leave the tied lm_head and the
embedding float; weight-only rounding to nearest needs no data and its two ONNX files verify."""

from __future__ import annotations

import warnings

import pytest
import torch

from mqbench.advanced_ptq import calibrate, hadamard_rotation
from mqbench.convert_deploy import convert_deploy
from mqbench.deploy.verify import verify_deploy
from mqbench.prepare_by_platform import prepare_by_platform
from mqbench.utils.state import disable_all, enable_quantization

smollm2 = pytest.importorskip("mqbench.models.smollm2")
pytest.importorskip("gguf")
try:
    smollm2.smollm2_path()
except FileNotFoundError as error:  # the Makefile installs the wheel; a bare checkout may lack it
    pytest.skip(str(error), allow_module_level=True)

BLOCKS = 2


@pytest.fixture(scope="module")
def cut() -> tuple[torch.nn.Module, torch.Tensor, list[dict[str, torch.Tensor]]]:
    """The first two blocks of SmolLM2 (then its final norm and tied lm_head), held-out token windows and
    calibration batches from the training files."""
    model, tokenizer = smollm2.load_smollm2(BLOCKS)
    calibration = smollm2.text_windows(tokenizer, 64, 8, held_out=False, seed=1)
    held = smollm2.text_windows(tokenizer, 48, 4, held_out=True, seed=2)
    return model, held, [{"input_ids": batch} for batch in calibration.split(4)]


def _prepare(model: torch.nn.Module, backend: str, calibration: list[dict[str, torch.Tensor]]) -> torch.fx.GraphModule:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return prepare_by_platform(model, backend, {"example_inputs": {"input_ids": calibration[0]["input_ids"][:2]}})


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_the_cut_is_smollm2_with_tied_embeddings(cut):
    model, held, _ = cut
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert len(model.model.layers) == BLOCKS and model.config.hidden_size == 576
    assert _logits(model, held).shape == (*held.shape, 49152)


@pytest.mark.parametrize("transform", ["smoothquant", "rotation"])
def test_w8a8_transforms_keep_the_float_function_and_land_near_float(cut, transform):
    model, held, calibration = cut
    qmodel = _prepare(model, "tensorrt_nlp", calibration)
    assert not hasattr(qmodel.lm_head, "weight_fake_quant")  # the LLM backends keep the tied lm_head float
    if transform == "rotation":
        hadamard_rotation(qmodel, calibration)
        assert len(qmodel.meta["rotation"]["streams"][0]["norms"]) == 2 * BLOCKS + 1  # LlamaRMSNorm, found
        calibrate(qmodel, calibration, smooth=True)
    else:
        calibrate(qmodel, calibration, smooth=True)
    enable_quantization(qmodel)
    reference, simulated = _logits(model, held), _logits(qmodel, held)
    cosine = torch.nn.functional.cosine_similarity(reference.flatten().double(), simulated.flatten().double(), dim=0)
    assert cosine > 0.99, float(cosine)  # measured: 0.9961 smoothed, 0.99986 rotated then smoothed
    disable_all(qmodel)
    bound = 1e-5 * float(reference.abs().max())
    torch.testing.assert_close(_logits(qmodel, held), reference, rtol=0, atol=bound)


def test_weight_only_without_data_deploys_both_files_and_verifies(cut, tmp_path):
    model, held, calibration = cut
    qmodel = _prepare(model, "llm_w4a16", calibration)
    enable_quantization(qmodel)  # rounding to nearest: no calibration data
    result = convert_deploy(qmodel, "llm_w4a16", dummy_input={"input_ids": held[:1]}, output_path=tmp_path)
    assert {"onnx", "matmulnbits_onnx"} <= set(result.artifacts)
    report = verify_deploy(qmodel, result, {"input_ids": held[:2, :40]})
    assert report.passed, report.failures()
