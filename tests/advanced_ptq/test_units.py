"""Reconstruction units: the block boundaries of each model family, written out from the architectures."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mqbench import models
from mqbench.advanced_ptq import find_units
from mqbench.advanced_ptq.units import MAX_BLOCK_LAYERS
from mqbench.prepare_by_platform import prepare_by_platform


def layer_names(model: nn.Module) -> list[str]:
    return [name.replace(".", "_") for name, m in model.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear))]


def test_resnet_blocks_are_the_basic_blocks_with_their_shortcuts():
    model = models.resnet18(num_classes=10).eval()
    units = find_units(prepare_by_platform(model, "tensorrt"), "block")
    expected = [("conv1",)]
    for stage in range(1, 5):
        for block in range(2):
            prefix = f"layer{stage}_{block}"
            shortcut = (f"{prefix}_downsample_0",) if stage > 1 and block == 0 else ()
            expected.append((*shortcut, f"{prefix}_conv1", f"{prefix}_conv2"))
    expected.append(("fc",))
    assert [unit.layers for unit in units] == expected
    assert all(len(unit.inputs) == 1 and len(unit.outputs) == 1 for unit in units)


def test_resnet50_bottlenecks():
    units = find_units(prepare_by_platform(models.resnet50(num_classes=10).eval(), "tensorrt"), "block")
    assert len(units) == 1 + 16 + 1
    assert units[1].layers == ("layer1_0_downsample_0", "layer1_0_conv1", "layer1_0_conv2", "layer1_0_conv3")


def test_mobilenet_v2_groups_exactly_the_inverted_residuals_with_a_shortcut():
    model = models.mobilenet_v2(num_classes=10).eval()
    with_shortcut = {
        name.replace(".", "_")
        for name, m in model.named_modules()
        if isinstance(m, models.InvertedResidual) and m.use_residual
    }
    units = find_units(prepare_by_platform(model, "tensorrt"), "block")
    for unit in units:
        owners = {layer.rsplit("_conv_", 1)[0] for layer in unit.layers}
        if len(unit.layers) > 1:
            assert len(owners) == 1 and owners <= with_shortcut, unit.layers
        else:
            assert not owners & with_shortcut, unit.layers
    grouped = {unit.layers[0].rsplit("_conv_", 1)[0] for unit in units if len(unit.layers) > 1}
    assert grouped == with_shortcut
    assert sorted(layer for unit in units for layer in unit.layers) == sorted(layer_names(model))


@pytest.mark.parametrize(
    ("make", "prefix", "attention", "mlp"),
    [
        (models.vit_tiny, "blocks", "attn", "mlp"),
        (models.bert_tiny, "layers", "attn", "ffn"),
    ],
)
def test_transformer_blocks_are_attention_and_mlp_with_their_residuals(make, prefix, attention, mlp):
    model = make().eval()
    units = find_units(prepare_by_platform(model, "tensorrt_nlp"), "block")
    inner = [unit.layers for unit in units if unit.layers[0].startswith(prefix)]
    depth = len(inner) // 2
    assert depth >= 2
    for i in range(depth):
        assert inner[2 * i] == tuple(f"{prefix}_{i}_{attention}_{p}" for p in ("q", "k", "v", "out"))
        assert all(name.startswith(f"{prefix}_{i}_{mlp}_") for name in inner[2 * i + 1])
    if make is models.bert_tiny:  # every attention block reads the mask (or what the model made of it)
        attention_units = [unit for unit in units if unit.layers[0].endswith("_attn_q")]
        assert all(len(unit.inputs) == 2 for unit in attention_units)


def test_unet_stages_are_its_top_level_modules():
    model = models.unet().eval()
    units = find_units(prepare_by_platform(model, "tensorrt"), "block")
    for unit in units:
        assert len({layer.split("_")[0] for layer in unit.layers}) == 1, unit.layers  # one stage each
    tops = [unit.layers[0].split("_")[0] for unit in units]
    assert {"enc2", "enc3", "bottleneck", "dec3", "dec2"} <= set(tops)
    assert sorted(layer for unit in units for layer in unit.layers) == sorted(
        [*layer_names(model), "up1", "up2", "up3"]
    )


def test_layer_units_cover_every_layer_once():
    model = models.resnet18(num_classes=10).eval()
    qmodel = prepare_by_platform(model, "tensorrt")
    units = find_units(qmodel, "layer")
    modules = dict(qmodel.named_modules())
    in_graph_order = [
        n.name for n in qmodel.graph.nodes if n.op == "call_module" and hasattr(modules[n.target], "weight_fake_quant")
    ]
    assert sorted(in_graph_order) == sorted(layer_names(model))
    assert [unit.layers for unit in units] == [(name,) for name in in_graph_order]


class LongSkip(nn.Module):
    """One shortcut around a long chain, all in one module: no block boundary inside."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(*[nn.Linear(4, 4) for _ in range(MAX_BLOCK_LAYERS + 1)])

    def forward(self, x):
        return x + self.body(x)


def test_without_a_block_boundary_units_fall_back_to_layers_with_a_warning():
    with pytest.warns(UserWarning, match=r"no block boundary found among 9 layers.*body_0, body_1"):
        units = find_units(prepare_by_platform(LongSkip().eval(), "tensorrt"), "block")
    assert [unit.kind for unit in units] == ["layer"] * (MAX_BLOCK_LAYERS + 1)


def test_exclusions_and_bad_patterns():
    qmodel = prepare_by_platform(models.resnet18(num_classes=10).eval(), "tensorrt")
    units = find_units(qmodel, "block", exclude=["fc"])
    assert units[-1].layers != ("fc",)
    with pytest.raises(ValueError, match=r"exclude_node names no node of the model: \['nope'\]"):
        find_units(qmodel, "block", exclude=["nope"])
    with pytest.raises(ValueError, match="unknown reconstruction pattern 'net'; choose one of layer, block"):
        find_units(qmodel, "net")
    assert torch.is_tensor(next(qmodel.parameters()))
