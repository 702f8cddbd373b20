"""Reference models: shapes, fx traceability, parameter counts, trainability, graph patterns."""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn

from mqbench import models

Inputs = tuple[Tensor, ...]


def _image(n: int, size: int) -> Callable[[], Inputs]:
    return lambda: (torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(0)),)


def _tokens() -> Inputs:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1000, (2, 12), generator=g)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 8:] = 0
    return ids, mask


# name -> (factory, inputs, expected output shape or {key: shape})
CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[], Inputs], object]] = {
    "digits_cnn": (models.DigitsCNN, lambda: (torch.randn(2, 1, 8, 8),), (2, 10)),
    "resnet18": (models.resnet18, _image(1, 64), (1, 1000)),
    "resnet50": (models.resnet50, _image(1, 64), (1, 1000)),
    "mobilenet_v2": (models.mobilenet_v2, _image(1, 64), (1, 1000)),
    "mobilenet_v3_small_style": (models.mobilenet_v3_small_style, _image(1, 64), (1, 1000)),
    "unet": (models.unet, _image(1, 64), (1, 2, 64, 64)),
    "two_head_detector": (
        models.two_head_detector,
        _image(2, 64),
        {"boxes": (2, 12, 16, 16), "scores": (2, 9, 16, 16)},
    ),
    "vit_tiny": (models.vit_tiny, _image(2, 32), (2, 10)),
    "bert_tiny": (models.bert_tiny, _tokens, (2, 2)),
}


@functools.cache
def _model(name: str) -> nn.Module:
    """One eval-mode instance per model for the read-only tests (building ResNet-50 is not free)."""
    torch.manual_seed(0)
    return CASES[name][0]().eval()


@functools.cache
def _traced(name: str) -> fx.GraphModule:
    return fx.symbolic_trace(_model(name))


def _shapes(out: object) -> object:
    if isinstance(out, dict):
        return {k: tuple(v.shape) for k, v in out.items()}
    assert isinstance(out, Tensor)
    return tuple(out.shape)


def _n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", list(CASES))
def test_forward_shape(name: str) -> None:
    _, inputs, expected = CASES[name]
    with torch.no_grad():
        out = _model(name)(*inputs())
    assert _shapes(out) == expected
    values = out.values() if isinstance(out, dict) else [out]
    assert all(torch.isfinite(v).all() for v in values)


@pytest.mark.parametrize("name", list(CASES))
def test_fx_trace_matches_eager(name: str) -> None:
    _, inputs, _ = CASES[name]
    traced = _traced(name)
    assert isinstance(traced, fx.GraphModule)
    x = inputs()
    with torch.no_grad():
        eager, graph = _model(name)(*x), traced(*x)
    if isinstance(eager, dict):
        assert isinstance(graph, dict)
        assert eager.keys() == graph.keys()
        for key in eager:
            assert torch.equal(eager[key], graph[key]), key
    else:
        assert torch.equal(eager, graph)


@pytest.mark.parametrize(
    ("name", "expected"),
    [("resnet18", 11_689_512), ("resnet50", 25_557_032), ("mobilenet_v2", 3_504_872)],
)
def test_parameter_counts_match_reference(name: str, expected: int) -> None:
    assert _n_params(_model(name)) == expected


def test_mobilenet_v3_style_size() -> None:
    assert 1_000_000 <= _n_params(_model("mobilenet_v3_small_style")) <= 3_000_000


def test_num_classes_option() -> None:
    torch.manual_seed(0)
    x = torch.randn(1, 3, 32, 32)
    assert models.resnet18(num_classes=7).eval()(x).shape == (1, 7)
    assert models.mobilenet_v2(num_classes=7, width_mult=0.5).eval()(x).shape == (1, 7)
    assert models.mobilenet_v3_small_style(num_classes=7).eval()(x).shape == (1, 7)
    assert models.vit_tiny(num_classes=7)(x).shape == (1, 7)
    assert models.unet(num_classes=7, base=4)(x).shape == (1, 7, 32, 32)
    out = models.two_head_detector(num_classes=7)(x)
    assert out["scores"].shape == (1, 21, 8, 8)


def _call_modules(gm: fx.GraphModule, cls: type[nn.Module]) -> list[fx.Node]:
    mods = dict(gm.named_modules())
    return [n for n in gm.graph.nodes if n.op == "call_module" and isinstance(mods[n.target], cls)]


def _call_functions(gm: fx.GraphModule, *targets: object) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op in ("call_function", "call_method") and n.target in targets]


@pytest.mark.parametrize("name", ["resnet18", "resnet50"])
def test_resnet_graph_has_module_and_functional_relu(name: str) -> None:
    gm = _traced(name)
    assert len(_call_modules(gm, nn.ReLU)) > 0
    functional = _call_functions(gm, F.relu, torch.relu)
    # one functional relu after every residual add
    assert len(functional) == (8 if name == "resnet18" else 16)
    assert all(n.args[0].target is operator.add for n in functional)


def test_mobilenet_v2_residual_adds() -> None:
    gm = _traced("mobilenet_v2")
    assert len(_call_functions(gm, operator.add, torch.add)) == 10
    depthwise = [n for n in _call_modules(gm, nn.Conv2d) if gm.get_submodule(n.target).groups > 1]
    assert len(depthwise) == 17
    assert len(_call_modules(gm, nn.ReLU6)) == 35


def test_mobilenet_v3_graph_has_hardswish_and_se_mul() -> None:
    gm = _traced("mobilenet_v3_small_style")
    assert len(_call_modules(gm, nn.Hardswish)) > 0
    assert len(_call_modules(gm, nn.Hardsigmoid)) > 0
    muls = _call_functions(gm, operator.mul, torch.mul, "mul")
    assert len(muls) > 0
    mods = dict(gm.named_modules())
    # the SE scale comes from a Hardsigmoid module
    assert any(
        isinstance(a, fx.Node) and a.op == "call_module" and isinstance(mods[a.target], nn.Hardsigmoid)
        for n in muls
        for a in n.args
    )


def test_unet_graph_has_deconv_bn_relu_and_cat() -> None:
    gm = _traced("unet")
    mods = dict(gm.named_modules())

    def is_mod(node: fx.Node, cls: type[nn.Module]) -> bool:
        return node.op == "call_module" and isinstance(mods[node.target], cls)

    deconvs = _call_modules(gm, nn.ConvTranspose2d)
    assert len(deconvs) == 3
    fused = [
        d
        for d in deconvs
        if len(d.users) == 1
        and is_mod(bn := next(iter(d.users)), nn.BatchNorm2d)
        and len(bn.users) == 1
        and is_mod(next(iter(bn.users)), nn.ReLU)
    ]
    assert len(fused) == 1
    assert len(_call_functions(gm, torch.cat)) == 3


def test_detector_graph_has_top_down_interpolate_add() -> None:
    gm = _traced("two_head_detector")
    interps = _call_functions(gm, F.interpolate)
    assert len(interps) == 1
    assert interps[0].kwargs.get("mode", "nearest") == "nearest"
    assert [u.target for u in interps[0].users] == [operator.add]


@pytest.mark.parametrize("name", ["vit_tiny", "bert_tiny"])
def test_transformer_graph_has_matmuls(name: str) -> None:
    gm = _traced(name)
    assert len(_call_functions(gm, torch.matmul)) == 4  # two per layer, depth 2
    assert len(_call_modules(gm, nn.Linear)) >= 2 * 6 + 1


def test_bert_padding_is_masked() -> None:
    model = _model("bert_tiny")
    ids, mask = _tokens()
    changed = ids.clone()
    changed[1, 8:] = 3  # only padded positions of row 1 differ
    with torch.no_grad():
        a, b = model(ids, mask), model(changed, mask)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _train(model: nn.Module, inputs: Inputs, loss_fn: Callable[[Tensor], Tensor], steps: int = 6) -> list[float]:
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_fn(model(*inputs))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("name", ["vit_tiny", "unet", "bert_tiny"])
def test_training_reduces_loss(name: str) -> None:
    torch.manual_seed(0)
    if name == "vit_tiny":
        model: nn.Module = models.vit_tiny()
        inputs: Inputs = (torch.randn(8, 3, 32, 32),)
        target = torch.randint(0, 10, (8,))
    elif name == "unet":
        model = models.unet(base=8)
        inputs = (torch.randn(2, 3, 32, 32),)
        target = torch.randint(0, 2, (2, 32, 32))
    else:
        model = models.bert_tiny()
        inputs = _tokens()
        target = torch.tensor([0, 1])
    losses = _train(model, inputs, lambda out: F.cross_entropy(out, target))
    assert losses[-1] < 0.9 * losses[0], losses
