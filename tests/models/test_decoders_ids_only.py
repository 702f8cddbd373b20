"""Hugging Face decoders captured with torch.export from token ids alone (one unpadded prompt, no attention mask):
prepare, calibrate, deploy and verify. Without a mask, transformers 5 looks for packed sequences in the position ids
(``torch.diff``, then a cumulative sum of a boolean tensor), ops the capture writes as ops ONNX has. With a mask the
same decoders are covered by test_decoders_export.py."""

from __future__ import annotations

import onnx
import pytest
import torch

from models.test_decoders_export import DECODERS, VOCAB, _decoder
from mqbench.convert_deploy import convert_deploy
from mqbench.deploy.verify import verify_deploy
from mqbench.prepare_by_platform import prepare_by_platform
from mqbench.utils.export_ops import ATEN_WRITES
from mqbench.utils.state import enable_calibration, enable_quantization

pytest.importorskip("transformers")


def _ids(length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", list(DECODERS))
def test_a_decoder_called_with_token_ids_alone_deploys_and_verifies(name, tmp_path):
    model = _decoder(name)
    ids = _ids(8, seed=1)
    qmodel = prepare_by_platform(model, "tensorrt_nlp", {"example_inputs": {"input_ids": ids}})
    assert qmodel.mqbench_capture == "export"
    enable_calibration(qmodel)
    with torch.no_grad():
        for seed, length in ((1, 8), (2, 6)):
            qmodel(input_ids=_ids(length, seed))
    enable_quantization(qmodel)
    with torch.no_grad():
        cosine = torch.nn.functional.cosine_similarity(
            model(input_ids=ids).logits.flatten(), qmodel(input_ids=ids).logits.flatten(), dim=0
        )
    assert cosine > 0.99, float(cosine)
    result = convert_deploy(
        qmodel, "tensorrt_nlp", dummy_input={"input_ids": ids}, output_path=tmp_path, model_name=name
    )
    graph = onnx.load(result.artifacts["deploy_onnx"]).graph
    assert [i.name for i in graph.input] == ["input_ids"]
    assert graph.input[0].type.tensor_type.shape.dim[1].dim_param == "sequence"  # any prompt length
    report = verify_deploy(qmodel, result, {"input_ids": _ids(5, seed=3)})  # deployed for 8 tokens, run on 5
    assert report.passed, report.failures()


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_one_prompt_captures_a_model_that_takes_batches(name, tmp_path):
    """Export fixes a dimension of size 1: one prompt is captured twice over, so that the prepared model calibrates
    on batches of windows and its files take any batch."""
    model = _decoder(name)
    qmodel = prepare_by_platform(model, "tensorrt_nlp", {"example_inputs": {"input_ids": _ids(8, seed=1)}})
    batch = torch.randint(0, VOCAB, (4, 6), generator=torch.Generator().manual_seed(4))
    enable_calibration(qmodel)
    with torch.no_grad():
        qmodel(input_ids=batch)
    enable_quantization(qmodel)
    with torch.no_grad():
        assert qmodel(input_ids=batch[:3]).logits.shape == (3, 6, VOCAB)
    result = convert_deploy(qmodel, "tensorrt_nlp", dummy_input={"input_ids": batch[:1]}, output_path=tmp_path)
    graph = onnx.load(result.artifacts["deploy_onnx"]).graph
    assert [d.dim_param for d in graph.input[0].type.tensor_type.shape.dim] == ["batch", "sequence"]
    assert verify_deploy(qmodel, result, {"input_ids": batch[:3, :5]}).passed


def test_an_op_of_transformers_mask_code_is_named_as_transformers(monkeypatch, tmp_path):
    """Were ``aten.diff`` left as torch.export recorded it, deploy would name transformers' code as its caller and say
    what the user can do (not "change that op of the model": the model does not call it)."""
    monkeypatch.delitem(ATEN_WRITES, torch.ops.aten.diff.default)
    model = _decoder("llama")
    ids = _ids(8, seed=1)
    qmodel = prepare_by_platform(model, "tensorrt_nlp", {"example_inputs": {"input_ids": ids}})
    enable_calibration(qmodel)
    with torch.no_grad():
        qmodel(input_ids=ids)
    enable_quantization(qmodel)
    with pytest.raises(NotImplementedError) as error:
        convert_deploy(qmodel, "tensorrt_nlp", dummy_input={"input_ids": ids}, output_path=tmp_path, model_name="llama")
    message = str(error.value)
    assert "'aten::diff'" in message and "The op is called by transformers' code, not the model's" in message
    assert "modeling_llama.py" in message and "an attention_mask in example_inputs and dummy_input" in message
    assert "Change that op of the model" not in message
