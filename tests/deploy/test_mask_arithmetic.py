"""A BERT-style encoder with Hugging Face's additive mask ``(1 - mask) * finfo.min`` and a padded row: on every
backend no quantizer reads the mask arithmetic, the deployed files compute finite values, and verify passes
(verify fails on any NaN or inf, so a pass is that proof)."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from backend_configs import host_config
from mqbench.convert_deploy import convert_deploy
from mqbench.deploy.verify import verify_deploy
from mqbench.fake_quantize.quantize_base import QuantizeBase
from mqbench.models.transformers import BertTiny
from mqbench.prepare_by_platform import BackendType, prepare_by_platform
from mqbench.utils.state import enable_calibration, enable_quantization

BACKENDS = [backend.value for backend in BackendType]


class FinfoMaskBert(BertTiny):
    """BertTiny with the mask transformers builds: padding gets the most negative float32, not -10000."""

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        positions = torch.ones_like(input_ids).cumsum(dim=1) - 1
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        x = self.embed_norm(x + self.token_type_embeddings(torch.zeros_like(input_ids)))
        mask = (1 - attention_mask[:, None, None, :].to(torch.float32)) * torch.finfo(torch.float32).min
        for layer in self.layers:
            x = layer(x, mask)
        return self.classifier(self.pooler_act(self.pooler(x[:, 0])))


def _inputs() -> tuple[Tensor, Tensor]:
    ids = torch.randint(0, 50, (4, 12), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(4, 12, dtype=torch.long)
    mask[1, 8:] = 0  # a padded row: its scores meet the mask
    return ids, mask


CASES = [(b, "fx") for b in BACKENDS] + [("openvino", "export"), ("tensorrt", "export")]


@pytest.mark.parametrize(("backend", "capture"), CASES)
def test_a_finfo_min_mask_is_never_quantized_and_deploys_finite(backend, capture, tmp_path):
    torch.manual_seed(0)
    model = FinfoMaskBert(vocab_size=50, dim=32, depth=2, heads=2, max_len=16).eval()
    ids, mask = _inputs()
    config = {**(host_config(backend) or {}), "capture": capture}
    if capture == "export":
        config["example_inputs"] = (ids, mask)
    qmodel = prepare_by_platform(model, backend, config)
    quantizers = {name for name, module in qmodel.named_modules() if isinstance(module, QuantizeBase)}
    # the mask chain: values computed from the integer mask input and constants only (not from the token ids)
    mask_chain = {n for n in qmodel.graph.nodes if n.op != "placeholder" and _from_mask_only(n)}
    assert mask_chain
    reads = [n.name for n in qmodel.graph.nodes if n.op == "call_module" and n.target in quantizers]
    assert reads
    assert not [n.name for n in qmodel.graph.nodes if n.name in reads and n.args[0] in mask_chain]
    enable_calibration(qmodel)
    with torch.no_grad():
        qmodel(ids, mask)
    enable_quantization(qmodel)
    with torch.no_grad():
        out = qmodel(ids, mask)
    assert bool(out.isfinite().all())
    result = convert_deploy(qmodel, backend, dummy_input=(ids, mask), output_path=tmp_path)
    report = verify_deploy(qmodel, result, (ids, mask))
    assert report.passed, report.failures()


def _ancestors(node: torch.fx.Node) -> set[torch.fx.Node]:
    seen: set[torch.fx.Node] = set()
    stack = [node]
    while stack:
        current = stack.pop()
        if current not in seen:
            seen.add(current)
            stack.extend(current.all_input_nodes)
    return seen


def _from_mask_only(node: torch.fx.Node) -> bool:
    names = {n.name for n in _ancestors(node) if n.op == "placeholder"}
    return "attention_mask" in names and "input_ids" not in names
