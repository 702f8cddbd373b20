"""Tracing real models: leaf modules, concrete args, custom tracers, wrappers, containers, errors."""

from __future__ import annotations

import importlib.util
import inspect
import sys
import textwrap
from typing import Any

import pytest
import torch
from torch import fx, nn

from mqbench.fake_quantize.quantize_base import QuantizeBase
from mqbench.prepare_by_platform import prepare_by_platform
from mqbench.utils.state import disable_all
from mqbench.utils.tracer import QuantizationTracer, TracingError, trace, unwrap_model


class Gate(nn.Module):
    """Data-dependent control flow: not traceable by torch.fx."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 1)

    def forward(self, x):
        if x.mean() > 0:  # gate-branch
            return self.conv(x)
        return x


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 1)
        self.body = nn.Sequential(nn.ReLU(), Gate())
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.body(self.stem(x)).mean((2, 3)))


def call_module_targets(gm: fx.GraphModule) -> list[str]:
    modules = dict(gm.named_modules())
    return [
        str(n.target)
        for n in gm.graph.nodes
        if n.op == "call_module" and not isinstance(modules[str(n.target)], QuantizeBase)
    ]


# -- errors ---------------------------------------------------------------------------------------
def gate_line() -> tuple[int, str]:
    lines, start = inspect.getsourcelines(Gate.forward)
    offset = next(i for i, line in enumerate(lines) if "gate-branch" in line)
    return start + offset, lines[offset].strip()


def test_data_dependent_branch_names_module_line_and_remedies():
    with pytest.raises(TracingError) as info:
        trace(Net())
    message = str(info.value)
    lineno, text = gate_line()
    assert "'body.1'" in message  # the qualified name of the module being traced
    assert text in message  # the user's source line
    assert f"{__file__}:{lineno}" in message
    assert "leaf_module" in message
    assert "concrete_args" in message
    assert isinstance(info.value.__cause__, Exception)  # the original torch.fx error is chained


def test_prepare_raises_the_same_tracing_error():
    with pytest.raises(TracingError, match=r"body\.1"):
        prepare_by_platform(Net(), "tensorrt")


def test_error_at_the_top_level_forward():
    class Top(nn.Module):
        def forward(self, x):
            if x.sum() > 0:  # top-branch
                return x
            return -x

    with pytest.raises(TracingError) as info:
        trace(Top())
    message = str(info.value)
    assert "Top.forward" in message
    assert "if x.sum() > 0:  # top-branch" in message


def test_user_frame_found_when_the_user_path_contains_library_names(tmp_path, monkeypatch):
    # a user project checked out in a folder named like the libraries must still be pointed at
    folder = tmp_path / "mqbench" / "torch"
    folder.mkdir(parents=True)
    source = folder / "user_model.py"
    source.write_text(
        textwrap.dedent(
            """
            from torch import nn

            class UserModel(nn.Module):
                def forward(self, x):
                    if x.max() > 1:  # user-branch
                        return x
                    return x * 2
            """
        )
    )
    spec = importlib.util.spec_from_file_location("user_model_for_tracer_test", source)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    with pytest.raises(TracingError) as info:
        trace(module.UserModel())
    assert f'{source}:6: "if x.max() > 1:  # user-branch"' in str(info.value)


# -- leaf modules, concrete args, custom tracers --------------------------------------------------
def test_leaf_module_keeps_the_module_whole():
    model = Net().eval()
    gm = trace(model, leaf_modules=(Gate,))
    assert call_module_targets(gm) == ["stem", "body.0", "body.1", "head"]
    x = torch.randn(2, 3, 4, 4)
    torch.testing.assert_close(gm(x), model(x))
    torch.testing.assert_close(gm(-x.abs()), model(-x.abs()))  # both branches of the whole module

    prepared = prepare_by_platform(model, "tensorrt", {"leaf_module": [Gate]})
    targets = call_module_targets(prepared)
    assert "body.1" in targets
    assert "body.1.conv" not in targets
    assert type(prepared.get_submodule("body.1")) is Gate
    with torch.no_grad():
        assert prepared(x).shape == model(x).shape


class Switch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 1)

    def forward(self, x, use_relu: bool = True, scale=None):
        y = self.conv(x)
        if use_relu:
            y = torch.relu(y)
        if scale is not None:
            y = y * scale
        return y


def test_concrete_args_fix_python_values():
    with pytest.raises(TracingError, match="concrete_args"):
        trace(Switch())
    gm = trace(Switch(), concrete_args={"use_relu": False, "scale": None})
    assert not any(n.target is torch.relu for n in gm.graph.nodes)
    gm = trace(Switch(), concrete_args={"use_relu": True, "scale": None})
    assert any(n.target is torch.relu for n in gm.graph.nodes)

    x = torch.randn(1, 3, 2, 2)
    for backend in ("tensorrt", "openvino", "vitis", "tengine_u8"):  # also those quantizing network inputs
        prepared = prepare_by_platform(Switch().eval(), backend, {"concrete_args": {"use_relu": False, "scale": None}})
        assert type(prepared.conv).__name__ == "Conv2d"  # nothing to fuse with: relu was traced away
        # torch.fx keeps the original default and asserts the specialized value: pass it
        assert prepared(x, False).shape == (1, 3, 2, 2)


def test_custom_tracer_replaces_the_default():
    class GateLeafTracer(fx.Tracer):
        def is_leaf_module(self, m, qualname):
            return isinstance(m, Gate) or super().is_leaf_module(m, qualname)

    gm = trace(Net(), custom_tracer=GateLeafTracer())
    assert "body.1" in call_module_targets(gm)
    prepared = prepare_by_platform(Net().eval(), "tensorrt", custom_tracer=GateLeafTracer())
    assert "body.1" in call_module_targets(prepared)
    assert prepared(torch.randn(1, 3, 2, 2)).shape == (1, 2)


def test_default_tracer_keeps_quantizers_and_fused_modules_whole():
    prepared = prepare_by_platform(nn.Sequential(nn.Conv2d(3, 3, 1), nn.ReLU()).eval(), "tensorrt")
    tracer = QuantizationTracer()
    assert tracer.is_leaf_module(prepared.get_submodule("0"), "0")  # the fused QAT ConvReLU2d
    retraced = trace(prepared)
    targets = [str(n.target) for n in retraced.graph.nodes if n.op == "call_module"]
    assert targets == ["input_1_post_act_fake_quantizer", "0"]


def test_module_called_twice_traces_to_two_calls():
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 3)

        def forward(self, x):
            return self.fc(torch.relu(self.fc(x)))

    gm = trace(Twice())
    assert call_module_targets(gm) == ["fc", "fc"]
    model = Twice().eval()
    x = torch.randn(2, 3)
    torch.testing.assert_close(trace(model)(x), model(x))


# -- wrappers and containers ----------------------------------------------------------------------
def test_data_parallel_is_unwrapped():
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.ReLU(), nn.Flatten(), nn.Linear(4, 2)).eval()
    assert unwrap_model(nn.DataParallel(nn.DataParallel(model))) is model
    gm = trace(nn.DataParallel(model))
    assert call_module_targets(gm) == ["0", "1", "2", "3"]
    prepared = prepare_by_platform(nn.DataParallel(model), "tensorrt")
    names = [name for name, _ in prepared.named_modules()]
    assert not any(name.startswith("module") for name in names)
    assert hasattr(prepared.get_submodule("0"), "weight_fake_quant")
    assert prepared(torch.randn(2, 3, 1, 1)).shape == (2, 2)


class DictModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)
        self.fc = nn.Linear(4, 2)

    def forward(self, batch: dict):
        features = self.conv(batch["image"]) * batch["weight"]
        pooled = features.mean((2, 3))
        return {"logits": self.fc(pooled), "extras": (features, pooled.sum())}


def _captured_by(capture: str, example: Any) -> dict[str, Any]:
    return {"capture": "fx"} if capture == "fx" else {"capture": "export", "example_inputs": example}


@pytest.mark.parametrize("capture", ["fx", "export"])
@pytest.mark.parametrize("backend", ["tensorrt", "snpe", "openvino", "vitis", "tengine_u8"])
def test_dict_inputs_and_nested_outputs(backend, capture):
    """Prepared by either capture, the model is called as it was: with the dict (or one tensor per key)."""
    model = DictModel().eval()
    batch = {"image": torch.randn(2, 3, 4, 4), "weight": torch.rand(2, 4, 1, 1)}
    gm = prepare_by_platform(model, backend, _captured_by(capture, (batch,)))
    assert [n.name for n in gm.graph.nodes if n.op == "placeholder"] == ["image", "weight"]
    disable_all(gm)
    with torch.no_grad():
        torch.testing.assert_close(gm(batch)["logits"], model(batch)["logits"])
        torch.testing.assert_close(gm(batch["image"], batch["weight"])["logits"], model(batch)["logits"])
    out = gm(batch)
    assert set(out) == {"logits", "extras"}
    assert out["logits"].shape == (2, 2)
    features, total = out["extras"]
    assert features.shape == (2, 4, 4, 4)
    assert total.shape == ()


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_a_dict_whose_keys_cannot_be_argument_names_stays_one_argument(capture):
    """A key such as "rgb-image" is no Python name: the prepared forward keeps the dict whole, ``forward(batch)``."""

    class Keyed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 1)

        def forward(self, batch: dict):
            return self.conv(batch["rgb-image"]) * batch["weight"]

    model = Keyed().eval()
    batch = {"rgb-image": torch.randn(2, 3, 4, 4), "weight": torch.rand(2, 4, 1, 1)}
    gm = prepare_by_platform(model, "tensorrt", _captured_by(capture, (batch,)))
    assert list(inspect.signature(gm.forward).parameters) == ["batch"]
    disable_all(gm)
    with torch.no_grad():
        torch.testing.assert_close(gm(batch), model(batch))


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_tuple_inputs_and_outputs(capture):
    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(3, 3)
            self.b = nn.Linear(3, 3)

        def forward(self, pair):
            left, right = pair
            return self.a(left), self.b(right) + left

    model = Pair().eval()
    x = (torch.randn(2, 3), torch.randn(2, 3))
    gm = prepare_by_platform(model, "openvino", _captured_by(capture, (x,)))
    disable_all(gm)
    with torch.no_grad():
        torch.testing.assert_close(gm(x), model(x))
    out = gm(x)
    assert isinstance(out, tuple)
    assert [o.shape for o in out] == [(2, 3), (2, 3)]


# -- preserve_attr ---------------------------------------------------------------------------------
class WithExtras(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, 4, 1), nn.ReLU())
        self.backbone.stride = 16
        self.fc = nn.Linear(4, 3)
        self.num_classes = 3
        self.labels = ["a", "b", "c"]

    def forward(self, x):
        return self.fc(self.backbone(x).mean((2, 3)))

    def predict(self, x):
        return self(x).argmax(-1)

    def describe(self):
        return f"{type(self).__name__} with {self.num_classes} classes"


def test_preserve_attr_copies_attributes_and_rebinds_methods():
    model = WithExtras().eval()
    config = {"preserve_attr": {"": ["num_classes", "labels", "predict", "describe"], "backbone": ["stride"]}}
    gm = prepare_by_platform(model, "tensorrt", config)
    assert gm.num_classes == 3
    assert gm.labels == ["a", "b", "c"]
    assert gm.get_submodule("backbone").stride == 16
    assert gm.predict.__self__ is gm  # rebound to the prepared model, not the user's
    assert gm.describe() == f"{type(gm).__name__} with 3 classes"
    x = torch.randn(5, 3, 2, 2)
    calls = []
    gm.register_forward_hook(lambda *args: calls.append(args))
    assert gm.predict(x).shape == (5,)
    assert len(calls) == 1  # predict ran the prepared model
    assert model.predict.__self__ is model


def test_preserve_attr_unknown_attribute():
    with pytest.raises(ValueError, match="no_such_thing"):
        prepare_by_platform(WithExtras().eval(), "tensorrt", {"preserve_attr": {"": ["no_such_thing"]}})


class _WritesIntoItsInputs(nn.Module):
    """A detector-style model: reads its input dict and writes its result into it."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, inputs):
        inputs.update({"y": self.conv(inputs["x"])})
        return inputs


class _ReadsTwoKeys(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, batch):
        return {"masked": torch.relu(self.conv(batch["image"])) * batch.get("mask")}


def test_a_model_that_writes_into_its_input_dict_prepares_calibrates_deploys_and_verifies(tmp_path):
    from mqbench.advanced_ptq import calibrate
    from mqbench.convert_deploy import convert_deploy
    from mqbench.deploy.verify import verify_deploy
    from mqbench.utils.state import disable_all, enable_quantization

    torch.manual_seed(0)
    model = _WritesIntoItsInputs().eval()
    qmodel = prepare_by_platform(model, "tensorrt")
    images = torch.randn(8, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    calibrate(qmodel, [{"x": images[:4]}, ({"x": images[4:]},)])  # keyword tensors, or the dict itself
    inputs = {"x": images}
    assert qmodel(inputs) is inputs and set(inputs) == {"x", "y"}  # the model's own behaviour, kept
    disable_all(qmodel)
    torch.testing.assert_close(qmodel({"x": images})["y"], model.conv(images), rtol=0, atol=0)
    enable_quantization(qmodel)

    result = convert_deploy(
        qmodel, "tensorrt", {"x": [1, 3, 8, 8]}, output_path=tmp_path, model_name="det", dynamic_axes={"x": {0: "b"}}
    )
    report = verify_deploy(qmodel, result, {"x": images})
    assert report.passed, report.failures()
    assert report.artifacts["onnx"].max_lsb_diff <= 1


def test_a_dict_input_of_two_keys_deploys_with_one_input_per_key(tmp_path):
    from mqbench.advanced_ptq import calibrate
    from mqbench.convert_deploy import convert_deploy
    from mqbench.deploy.verify import verify_deploy

    torch.manual_seed(0)
    qmodel = prepare_by_platform(_ReadsTwoKeys().eval(), "tensorrt")
    assert list(inspect.signature(qmodel.forward).parameters) == ["image", "mask"]
    image = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(2))
    mask = (torch.rand(4, 4, 8, 8, generator=torch.Generator().manual_seed(3)) > 0.5).float()
    calibrate(qmodel, [{"image": image, "mask": mask}])
    torch.testing.assert_close(qmodel({"image": image, "mask": mask})["masked"], qmodel(image, mask)["masked"])
    shapes = {"image": [4, 3, 8, 8], "mask": [4, 4, 8, 8]}
    result = convert_deploy(qmodel, "tensorrt", shapes, output_path=tmp_path, model_name="two")
    assert result.input_names == ["image", "mask"]
    report = verify_deploy(qmodel, result, {"image": image, "mask": mask})
    assert report.passed, report.failures()


def test_arguments_indexed_otherwise_are_left_as_they_are():
    class Indexed(nn.Module):
        def forward(self, pair):
            return pair[0] + pair[1]

    traced = trace(Indexed())
    assert [n.target for n in traced.graph.nodes if n.op == "placeholder"] == ["pair"]
    assert torch.equal(traced((torch.ones(2), torch.ones(2))), torch.full((2,), 2.0))


class CachedBias(nn.Module):
    """Keeps a value its forward computes in a dict while in eval mode, as timm's LeViT keeps its attention biases
    (keyed by device): tracing puts a Proxy there."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.bias_table = nn.Parameter(torch.randn(4))
        self.cache: dict[str, Any] = {}
        self.seen: list[Any] = []

    def forward(self, x):
        if not self.training:
            if "cpu" not in self.cache:
                self.cache["cpu"] = self.bias_table * 2.0
            self.seen.append(self.cache["cpu"])
            return self.linear(x) + self.cache["cpu"]
        return self.linear(x) + self.bias_table * 2.0


def test_tracing_leaves_the_models_python_state_as_it_was():
    torch.manual_seed(0)
    model = nn.Sequential(CachedBias(), nn.ReLU()).eval()
    model[0].cache["kept"] = 1  # a value the model had before: it stays
    x = torch.randn(3, 4)
    expected = model(x)
    model[0].cache.pop("cpu")
    model[0].seen.clear()
    traced = trace(model)
    assert model[0].cache == {"kept": 1} and model[0].seen == []  # the Proxy taken out, the same objects kept
    torch.testing.assert_close(traced(x), expected, rtol=0, atol=0)
    qmodel = prepare_by_platform(model, "tensorrt")  # traced again: before, the stale Proxy broke this graph
    disable_all(qmodel)
    torch.testing.assert_close(qmodel(x), expected, rtol=1e-6, atol=1e-6)
    assert not any(isinstance(v, fx.Proxy) for v in model[0].cache.values())
    torch.testing.assert_close(model(x), expected, rtol=0, atol=0)  # the user's model still runs
