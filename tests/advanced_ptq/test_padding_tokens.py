"""GPTQ and AWQ read the tokens of padded calibration batches, not their padding: a batch of sequences padded to
one length with an ``attention_mask`` gives what the same sequences give one at a time, without padding."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from mqbench.advanced_ptq import awq, gptq
from mqbench.advanced_ptq.weight_only import collect_inputs, linear_sites, token_mask
from mqbench.prepare_by_platform import prepare_by_platform

LENGTHS = (7, 3, 5)  # three sequences padded to 7 tokens
WIDTH = 64


class Encoder(nn.Module):
    """A token-wise MLP taking a tokenizer's keyword inputs (the mask is for the caller's pooling), with a second
    layer beside the first (``side``: one site of two layers reading the tokens, as a query and a key do)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(WIDTH, 128)
        self.side = nn.Linear(WIDTH, 128)
        self.fc2 = nn.Linear(128, WIDTH)

    def forward(self, x: Tensor, attention_mask: Tensor) -> Tensor:
        return self.fc2(torch.relu(self.fc1(x)) * self.side(x))


def _batches() -> tuple[list[dict[str, Tensor]], list[dict[str, Tensor]]]:
    """(one padded batch, the same sequences one per batch without padding); padding holds large garbage values,
    as a padded position of a transformer does."""
    generator = torch.Generator().manual_seed(0)
    sequences = [torch.randn(n, WIDTH, generator=generator) for n in LENGTHS]
    padded = 25.0 * torch.randn(len(LENGTHS), max(LENGTHS), WIDTH, generator=generator)
    mask = torch.zeros(len(LENGTHS), max(LENGTHS), dtype=torch.int64)
    for i, sequence in enumerate(sequences):
        padded[i, : len(sequence)] = sequence
        mask[i, : len(sequence)] = 1
    alone = [{"x": s[None], "attention_mask": torch.ones(1, len(s), dtype=torch.int64)} for s in sequences]
    return [{"x": padded, "attention_mask": mask}], alone


def _prepared() -> torch.fx.GraphModule:
    torch.manual_seed(0)
    return prepare_by_platform(Encoder().eval(), "llm_w4a16", {"extra_qconfig_dict": {"w_qscheme": {"group_size": 32}}})


def test_the_rows_collected_are_the_tokens_only():
    padded, alone = _batches()
    model = _prepared()
    layers = [layer for site in linear_sites(model) for layer in site.layers]
    seen: dict[str, list[Tensor]] = {layer.name: [] for layer in layers}
    collect_inputs(model, padded, layers, lambda layer, rows: seen[layer.name].append(rows), weights=False)
    tokens = torch.cat([batch["x"][0] for batch in alone]).double()
    assert torch.equal(torch.cat(seen["fc1"]), tokens)  # the three sequences' rows, in order, padding left out
    assert torch.equal(torch.cat(seen["side"]), tokens)
    each = {name: [] for name in seen}
    collect_inputs(model, alone, layers, lambda layer, rows: each[layer.name].append(rows), weights=False)
    # fc2 reads what fc1 computed: on a batch of another shape, equal to float32 rounding (summation order)
    torch.testing.assert_close(torch.cat(seen["fc2"]), torch.cat(each["fc2"]), rtol=1e-6, atol=1e-6)
    assert token_mask({"x": padded[0]["x"], "attention_mask": torch.ones(3, 7)}) is None  # nothing to leave out
    assert token_mask(padded[0]["x"]) is None


@pytest.mark.parametrize("algorithm", [gptq, awq], ids=["gptq", "awq"])
def test_a_padded_batch_rounds_the_weights_as_the_unpadded_sequences_do(algorithm):
    padded, alone = _batches()
    config = {"sample_rows": 64} if algorithm is awq else None  # more than the 15 tokens: every row is used
    from_padded = algorithm(_prepared(), padded, config)
    from_alone = algorithm(_prepared(), alone, config)
    # the layers reading the tokens themselves (fc2's inputs differ in float32 rounding, see above, which GPTQ's
    # error propagation can turn into another rounding of a few weights)
    for name in ("fc1", "side"):
        assert torch.equal(getattr(from_padded, name).weight, getattr(from_alone, name).weight), name
    # the padding would matter: read as tokens (a mask of ones), it moves the rounding
    ones = [{"x": padded[0]["x"], "attention_mask": torch.ones(3, 7, dtype=torch.int64)}]
    as_tokens = algorithm(_prepared(), ones, config)
    assert not torch.equal(as_tokens.fc1.weight, from_alone.fc1.weight)
