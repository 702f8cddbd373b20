"""prepare_by_platform on models and configurations users bring: identity shortcuts, side effects,
partial schemes, reduce_range, compiled models, quantizing before calibration."""

from __future__ import annotations

import copy
import io
import operator

import pytest
import torch
from torch import fx, nn

from backend_configs import config_for
from mqbench.custom_quantizer.ops import is_identity
from mqbench.fake_quantize import QuantizeBase
from mqbench.prepare_by_platform import CONFIG_KEYS, BackendType, prepare_by_platform
from mqbench.utils.state import UncalibratedError, enable_calibration, enable_quantization

BACKENDS = [backend.value for backend in BackendType]


class IdentityShortcut(nn.Module):
    """A stem conv + ReLU feeding a block and an ``nn.Identity`` shortcut: ``block(x) + shortcut(x)``."""

    def __init__(self, shortcut: nn.Module | None = None) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
        self.block = nn.Sequential(
            nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1)
        )
        self.short = shortcut if shortcut is not None else nn.Identity()
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))

    def forward(self, x):
        x = self.stem(x)
        return self.head(self.block(x) + self.short(x))


def deployed_value(node: fx.Node, modules) -> fx.Node:
    """The tensor a value is once exported: identity-like ops (Identity, Dropout, clone) vanish."""
    while is_identity(node, modules) or (
        node.op == "call_module" and isinstance(modules[str(node.target)], QuantizeBase)
    ):
        node = node.args[0]
    return node


def quantizers_per_deployed_tensor(gm: fx.GraphModule) -> dict[str, set[str]]:
    modules = dict(gm.named_modules())
    found: dict[str, set[str]] = {}
    for node in gm.graph.nodes:
        if node.op == "call_module" and isinstance(modules[str(node.target)], QuantizeBase):
            source = deployed_value(node.args[0], modules)
            found.setdefault(source.name, set()).add(str(node.target))
    return found


# -- 1. one quantizer per deployed tensor -----------------------------------------------------------
@pytest.mark.parametrize("shortcut", [nn.Identity(), nn.Dropout(0.1)], ids=["identity", "dropout"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_an_identity_shortcut_shares_the_quantizer_of_its_input(backend, shortcut):
    qmodel = prepare_by_platform(IdentityShortcut(copy.deepcopy(shortcut)).eval(), backend, config_for(backend))
    for tensor, modules in quantizers_per_deployed_tensor(qmodel).items():
        assert len(modules) == 1, f"{tensor} is quantized by {sorted(modules)}"


def test_openvino_identity_shortcut_reads_the_unsigned_quantizer_of_the_relu():
    qmodel = prepare_by_platform(IdentityShortcut().eval(), "openvino")
    modules = dict(qmodel.named_modules())
    (short,) = [n for n in qmodel.graph.nodes if n.target == "short"]
    (quantized,) = short.users
    shared = modules[str(quantized.target)]
    assert quantized.target == "stem_0_post_act_fake_quantizer"
    assert (shared.quant_min, shared.quant_max) == (0, 255)  # after a ReLU: OpenVINO's unsigned grid
    # the block's conv reads the same module
    readers = [n for n in qmodel.graph.nodes if n.op == "call_module" and n.target == quantized.target]
    assert len(readers) == 2


def test_an_identity_after_an_already_quantized_value_gets_no_second_quantizer():
    class TwoUsers(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 1)
            self.conv2 = nn.Conv2d(4, 4, 1)
            self.keep = nn.Identity()

        def forward(self, x):
            y = self.conv(x)
            return self.conv2(y) + self.keep(y)

    # All-integer backends quantize the conv's output for every reader: the Identity's output is that tensor.
    qmodel = prepare_by_platform(TwoUsers().eval(), "snpe")
    modules = dict(qmodel.named_modules())
    (keep,) = [n for n in qmodel.graph.nodes if n.target == "keep"]
    assert not any(isinstance(modules.get(str(u.target)), QuantizeBase) for u in keep.users if u.op == "call_module")
    assert isinstance(modules[str(keep.args[0].target)], QuantizeBase)


# -- 3. the prepared model remembers its backend ----------------------------------------------------
def test_the_prepared_model_remembers_its_backend_outside_the_state_dict():
    qmodel = prepare_by_platform(IdentityShortcut().eval(), BackendType.OPENVINO)
    assert qmodel.mqbench_backend == "openvino"
    assert copy.deepcopy(qmodel).mqbench_backend == "openvino"
    buffer = io.BytesIO()
    torch.save(qmodel, buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=False).mqbench_backend == "openvino"
    assert not any("mqbench_backend" in key for key in qmodel.state_dict())


# -- 4. partial schemes merge with the backend's ---------------------------------------------------
def weight_quantizer(qmodel: nn.Module) -> QuantizeBase:
    return next(m for n, m in qmodel.named_modules() if n.endswith("weight_fake_quant"))


@pytest.mark.parametrize(
    ("backend", "w_qscheme", "expected"),
    [
        ("tensorrt", {"bit": 4}, (-7, 7, torch.per_channel_symmetric)),
        ("tensorrt", {"bit": 4, "symmetric_range": False}, (-8, 7, torch.per_channel_symmetric)),
        ("tensorrt", {"per_channel": False}, (-127, 127, torch.per_tensor_symmetric)),
        ("tensorrt", {"symmetry": False}, (0, 255, torch.per_channel_affine)),  # no narrow range when asymmetric
        ("onnx_qnn", {"bit": 4}, (0, 15, torch.per_tensor_affine)),
        ("openvino", {"bit": 6}, (-32, 31, torch.per_channel_symmetric)),
    ],
)
def test_a_partial_weight_scheme_changes_only_the_keys_it_names(backend, w_qscheme, expected):
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()).eval()
    qmodel = prepare_by_platform(model, backend, {"extra_qconfig_dict": {"w_qscheme": w_qscheme}})
    quantizer = weight_quantizer(qmodel)
    assert (quantizer.quant_min, quantizer.quant_max, quantizer.qscheme) == expected


def test_a_partial_activation_scheme_changes_only_the_keys_it_names():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()).eval()
    qmodel = prepare_by_platform(model, "tensorrt", {"extra_qconfig_dict": {"a_qscheme": {"bit": 6}}})
    activation = next(m for n, m in qmodel.named_modules() if n.endswith("post_act_fake_quantizer"))
    assert (activation.quant_min, activation.quant_max, activation.qscheme) == (-32, 31, torch.per_tensor_symmetric)


# -- 5. calls with side effects survive dead-code elimination ---------------------------------------
class SideEffects(nn.Module):
    """A head that fills containers it does not return directly, and an in-place op."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)
        self.other = nn.Conv2d(3, 4, 1)

    def forward(self, batch: dict):
        batch.update({"y": self.conv(batch["x"])})
        batch["features"].append(self.other(batch["x"]))
        batch.setdefault("z", self.other(batch["x"]))
        scores = batch["scores"]
        scores.add_(1.0)
        return batch


def test_calls_with_side_effects_are_kept():
    torch.manual_seed(0)
    model = SideEffects().eval()
    qmodel = prepare_by_platform(model, "tensorrt")
    enable_calibration(qmodel)
    x = torch.randn(2, 3, 4, 4)
    out = qmodel({"x": x, "features": [], "scores": torch.zeros(2)})
    assert set(out) == {"x", "features", "scores", "y", "z"}
    assert len(out["features"]) == 1
    torch.testing.assert_close(out["scores"], torch.ones(2))
    expected = model({"x": x, "features": [], "scores": torch.zeros(2)})
    torch.testing.assert_close(out["y"], expected["y"])
    torch.testing.assert_close(out["z"], expected["z"])


def test_a_plain_dict_head_still_returns_its_outputs():
    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 1)

        def forward(self, x):
            out = {}
            out.update({"y": self.conv(x)})
            return out

    qmodel = prepare_by_platform(Head().eval(), "tensorrt")
    enable_calibration(qmodel)
    assert set(qmodel(torch.randn(1, 3, 4, 4))) == {"y"}


# -- 7. quantizing before calibration; compiled models ----------------------------------------------
def test_quantizing_before_calibration_names_the_quantizers_and_says_to_calibrate():
    model = nn.Sequential(nn.Conv2d(3, 16, 3), nn.ReLU(), nn.Conv2d(16, 16, 3)).eval()
    qmodel = prepare_by_platform(model, "tensorrt")
    enable_quantization(qmodel)
    # the weight quantizers calibrate on their own weights (no data needed); the activation ones are named
    with pytest.raises(
        UncalibratedError, match=r"2 quantizer\(s\).*post_act_fake_quantizer.*enable_calibration"
    ) as err:
        qmodel(torch.randn(1, 3, 8, 8))
    assert "weight_fake_quant" not in str(err.value)
    enable_calibration(qmodel)
    qmodel(torch.randn(1, 3, 8, 8))
    enable_quantization(qmodel)
    assert qmodel(torch.randn(1, 3, 8, 8)).shape == (1, 16, 4, 4)


def test_many_uncalibrated_quantizers_are_counted():
    model = nn.Sequential(*[nn.Conv2d(4, 4, 1) for _ in range(12)]).eval()
    qmodel = prepare_by_platform(model, "tensorrt")
    enable_quantization(qmodel)
    with pytest.raises(
        UncalibratedError, match=r"12 quantizer\(s\).* and 2 more"
    ):  # the activations'; weights need none
        qmodel(torch.randn(1, 4, 2, 2))


def test_a_calibrated_state_dict_loaded_after_enable_quantization_is_enough():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3), nn.ReLU()).eval()
    calibrated = prepare_by_platform(model, "tensorrt")
    enable_calibration(calibrated)
    calibrated(torch.randn(2, 3, 8, 8))
    enable_quantization(calibrated)
    fresh = prepare_by_platform(model, "tensorrt")
    enable_quantization(fresh)
    fresh.load_state_dict(calibrated.state_dict())
    x = torch.randn(1, 3, 8, 8)
    torch.testing.assert_close(fresh(x), calibrated(x))


def small():
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()).eval()


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda m: torch.jit.script(m), r"TorchScript module .*pass the model before scripting.*leaf_module"),
        (lambda m: torch.jit.trace(m, torch.randn(1, 3, 8, 8)), r"TorchScript module .*torch.jit.trace"),
        (lambda m: torch.compile(m), r"torch.compile wrapper .*model._orig_mod"),
        (lambda m: torch.export.export(m, (torch.randn(1, 3, 8, 8),)), r"ExportedProgram.*pass the module"),
        (lambda m: m.state_dict(), r"takes an nn.Module, got collections.OrderedDict"),
    ],
    ids=["script", "trace", "compile", "export", "state_dict"],
)
def test_compiled_models_are_refused_with_what_to_pass_instead(make, message):
    with pytest.raises(TypeError, match=message):
        prepare_by_platform(make(small()), "tensorrt")


def _scripted_conv_relu() -> torch.jit.ScriptModule:
    with torch.random.fork_rng():  # collection leaves the global generator as it was
        torch.manual_seed(0)
        return torch.jit.script(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()))


# Scripted when the tests are collected, before any test runs. TorchScript finds builtins by the id()
# of Python objects, so once an object it registered that way has been freed, a new object reusing
# the id (once in a full-suite run: Conv2d's padding list) compiles as "builtin cannot be used as a
# value". The test is about prepare keeping the submodule whole, not about scripting late in a run.
SCRIPTED_CONV_RELU = _scripted_conv_relu()


def test_a_scripted_submodule_is_kept_whole():
    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scripted = SCRIPTED_CONV_RELU
            self.conv = nn.Conv2d(4, 4, 1)

        def forward(self, x):
            return self.conv(self.scripted(x))

    torch.manual_seed(0)
    model = Outer().eval()
    qmodel = prepare_by_platform(model, "tensorrt")
    called = [str(n.target) for n in qmodel.graph.nodes if n.op == "call_module"]
    assert "scripted" in called and not any(target.startswith("scripted.") for target in called)
    enable_calibration(qmodel)
    x = torch.randn(1, 3, 8, 8)
    torch.testing.assert_close(qmodel(x), model(x))


# -- 9. reduce_range --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("backend", "expected"),
    [("tensorrt", (-64, 63)), ("qdq", (-64, 63)), ("openvino", (-64, 63)), ("onnx_qnn", (0, 127))],
)
def test_reduce_range_gives_7_bit_weights_of_the_same_signedness(backend, expected):
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 2)).eval()
    qmodel = prepare_by_platform(model, backend, {"reduce_range": True})
    plain = prepare_by_platform(model, backend)
    weights = {n: (m.quant_min, m.quant_max) for n, m in qmodel.named_modules() if n.endswith("weight_fake_quant")}
    assert len(weights) == 2 and set(weights.values()) == {expected}
    activations = {n: (m.quant_min, m.quant_max) for n, m in qmodel.named_modules() if n.endswith("_quantizer")}
    unchanged = {n: (m.quant_min, m.quant_max) for n, m in plain.named_modules() if n.endswith("_quantizer")}
    assert activations == unchanged


def test_reduce_range_also_narrows_first_and_last_layers_widened_to_8_bits():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Conv2d(4, 4, 3), nn.Conv2d(4, 4, 3)).eval()
    config = {**config_for("academic"), "reduce_range": True}
    config["extra_qconfig_dict"] = {
        **config["extra_qconfig_dict"],
        "w_qscheme": {"symmetry": True, "per_channel": True},  # 8-bit: reduce_range sets the width
    }
    qmodel = prepare_by_platform(model, "academic", config)
    ranges = [(m.quant_min, m.quant_max) for n, m in qmodel.named_modules() if n.endswith("weight_fake_quant")]
    assert ranges == [(-64, 63)] * 3


class Attention(nn.Module):
    """softmax(q k^T) v: two products of activations, their right operands k^T (past a transpose) and v."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        scores = torch.matmul(self.q(x), self.k(x).transpose(-2, -1))
        return torch.softmax(scores, dim=-1) @ self.v(x)


@pytest.mark.parametrize("backend", ["openvino", "tensorrt_nlp", "snpe", "vitis"])  # those quantizing both operands
# (of both products; OpenVINO of the scores' product only)
def test_reduce_range_narrows_the_right_operand_of_activation_products(backend):
    """It takes the weights' place in int8 kernels: 7-bit like them; the left operands keep 8 bits."""
    model = Attention().eval()
    plain = prepare_by_platform(model, backend, config_for(backend))
    qmodel = prepare_by_platform(model, backend, {**(config_for(backend) or {}), "reduce_range": True})

    def grid(value: fx.Node, modules: dict) -> tuple[int, int] | None:  # its quantizer, before it or its transpose
        while value.op == "call_method" and value.target == "transpose":
            value = value.args[0]
        module = modules.get(str(value.target)) if value.op == "call_module" else None
        return (module.quant_min, module.quant_max) if isinstance(module, QuantizeBase) else None

    operands = {}
    for prepared in (plain, qmodel):
        products = [n for n in prepared.graph.nodes if n.target in (torch.matmul, operator.matmul)]
        assert len(products) == 2
        modules = dict(prepared.named_modules())
        operands[prepared is qmodel] = [[grid(a, modules) for a in n.args] for n in products]
    float_products = [pair for pair in operands[False] if pair == [None, None]]
    assert len(float_products) == (backend == "openvino")  # OpenVINO leaves attention weights x values float
    for (left, right), (left_reduced, right_reduced) in zip(operands[False], operands[True], strict=True):
        assert left_reduced == left
        if backend == "openvino" and [left, right] == [None, None]:
            assert right_reduced is None
            continue
        assert right is not None
        signed_eight_bit = right[0] < 0 and right[1] - right[0] + 1 >= 255
        assert right_reduced == ((-64, 63) if signed_eight_bit else right)  # u8 x u8 products do not saturate
    assert any(right[0] < 0 for _, right in operands[False]) == (backend != "snpe")  # SNPE: unsigned activations
    x = torch.randn(2, 5, 8)
    enable_calibration(qmodel)
    qmodel(x)
    enable_quantization(qmodel)
    torch.testing.assert_close(qmodel(x), model(x), atol=0.1, rtol=0.1)


@pytest.mark.parametrize(
    ("backend", "extra", "message"),
    [
        ("nnie", {}, r"reduce_range needs a linear 8-bit weight grid; backend 'nnie'.*NNIEFakeQuantize.*log"),
        ("tensorrt", {"extra_qconfig_dict": {"w_qscheme": {"bit": 4}}}, r"cannot be combined with .*w_qscheme.* bit=4"),
        ("tensorrt", {"extra_qconfig_dict": {"w_fakeq_params": {"quant_min": -8, "quant_max": 7}}}, r"is \[-8, 7\]"),
    ],
)
def test_reduce_range_refuses_weight_grids_that_are_not_8_bit(backend, extra, message):
    with pytest.raises(ValueError, match=message):
        prepare_by_platform(small(), backend, {"reduce_range": True, **extra})


def test_reduce_range_is_a_listed_key_and_unknown_keys_still_raise():
    assert "reduce_range" in CONFIG_KEYS
    with pytest.raises(ValueError, match=r"unknown prepare_custom_config_dict key 'reduce_ranges'.*reduce_range"):
        prepare_by_platform(small(), "tensorrt", {"reduce_ranges": True})
    with pytest.raises(ValueError, match=r"reduce_range'\] must be True or False"):
        prepare_by_platform(small(), "tensorrt", {"reduce_range": "yes"})
