"""A BackendConfig registered as a backend: prepare_by_platform, convert_deploy and verify_deploy run on it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mqbench.nn.intrinsic as nni
import mqbench.nn.intrinsic.qat as nniqat
from backend_configs import config_for
from mqbench.backend_config import (
    BackendConfig,
    BackendPatternConfig,
    DTypeConfig,
    DTypeWithConstraints,
    ObservationType,
    quantization_report,
)
from mqbench.backends import ParamsTable, register_backend
from mqbench.convert_deploy import convert_deploy
from mqbench.deploy.verify import verify_deploy
from mqbench.fake_quantize import QuantizeBase
from mqbench.prepare_by_platform import BackendType, prepare_by_platform
from mqbench.utils.state import enable_calibration, enable_quantization

ACTIVATION = DTypeWithConstraints(dtype=torch.quint8, scale_min_lower_bound=2**-12)
INT8 = DTypeConfig(input_dtype=ACTIVATION, output_dtype=ACTIVATION, weight_dtype=torch.qint8, bias_dtype=torch.float)


def npu_config() -> BackendConfig:
    """Conv-ReLU and Linear quantized on both sides; everything else float."""
    observed = ObservationType.OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT
    return (
        BackendConfig("declared_npu")
        .set_backend_pattern_config(BackendPatternConfig((nn.Conv2d, nn.ReLU)).set_fused_module(nni.ConvReLU2d))
        .set_backend_pattern_config(
            BackendPatternConfig(nni.ConvReLU2d).set_observation_type(observed).add_dtype_config(INT8)
        )
        .set_backend_pattern_config(
            BackendPatternConfig(nn.Linear).set_observation_type(observed).add_dtype_config(INT8)
        )
    )


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.relu = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool2d(2)
        self.fc = nn.Linear(16, 5)

    def forward(self, x):
        return torch.sigmoid(self.fc(self.pool(self.relu(self.conv(x))).flatten(1)))


@pytest.fixture
def declared_backend():
    register_backend("declared_npu", npu_config(), replace=True)
    yield "declared_npu"
    ParamsTable.unregister("declared_npu")


def test_a_registered_backend_config_prepares_deploys_and_verifies(declared_backend, tmp_path):
    torch.manual_seed(0)
    qmodel = prepare_by_platform(Net().eval(), declared_backend)
    quantizers = {name for name, m in qmodel.named_modules() if isinstance(m, QuantizeBase)}
    # Inputs and outputs of the conv-relu and of the linear, and their two weights; the pool and the
    # sigmoid have no pattern and get nothing of their own.
    assert quantizers == {
        "x_post_act_fake_quantizer",
        "conv_post_act_fake_quantizer",
        "flatten_post_act_fake_quantizer",
        "fc_post_act_fake_quantizer",
        "conv.weight_fake_quant",
        "fc.weight_fake_quant",
    }
    assert type(qmodel.conv) is nniqat.ConvReLU2d  # fused by the declared pattern, then its QAT module
    report = quantization_report(qmodel)
    assert "pool" in report and "no pattern of the backend matches AdaptiveAvgPool2d" in report
    enable_calibration(qmodel)
    with torch.no_grad():
        qmodel(torch.randn(8, 1, 8, 8))
    enable_quantization(qmodel)
    result = convert_deploy(qmodel, declared_backend, {"x": [2, 1, 8, 8]}, output_path=tmp_path)
    assert sorted(result.artifacts) == ["deploy_onnx", "onnx"]
    assert len(result.table) == 6
    verified = verify_deploy(qmodel, result, torch.randn(2, 1, 8, 8))
    assert verified.max_lsb_diff <= 1


@pytest.mark.parametrize(
    "exclusion",
    [{"exclude_node_name": ["fc"]}, {"exclude_module_name": ["fc"]}],
    ids=["node_name", "module_name"],
)
def test_extra_quantizer_dict_exclusions_mean_the_same_on_a_declared_backend(declared_backend, exclusion):
    """Each exclusion key leaves the layer float, as on a built-in backend, and the report says why."""
    qmodel = prepare_by_platform(Net().eval(), declared_backend, {"extra_quantizer_dict": exclusion})
    quantizers = {name for name, m in qmodel.named_modules() if isinstance(m, QuantizeBase)}
    assert not any(name.startswith("fc") for name in quantizers)
    assert "conv.weight_fake_quant" in quantizers and type(qmodel.fc) is nn.Linear
    assert "excluded by prepare_custom_config_dict['extra_quantizer_dict']" in quantization_report(qmodel)


def test_a_declared_backend_refuses_additions_that_only_its_patterns_can_declare(declared_backend):
    for key, value in [
        ("extra_quantizer_dict", {"additional_node_name": ["pool"]}),
        ("extra_fuse_dict", {"additional_fusion_pattern": {(nn.Linear, nn.ReLU): lambda *m: m}}),
    ]:
        with pytest.raises(ValueError, match=r"declared by a BackendConfig.*add a BackendPatternConfig"):
            prepare_by_platform(Net().eval(), declared_backend, {key: value})


def test_register_backend_rejects_other_objects_and_empty_configs():
    with pytest.raises(ValueError, match="BackendSpec or a BackendConfig"):
        register_backend("nothing", object())
    with pytest.raises(ValueError, match="quantizes nothing"):
        register_backend("empty_npu", BackendConfig("empty"))
    assert "empty_npu" not in ParamsTable


def test_a_builtin_backend_read_back_as_a_backend_config_quantizes_the_same_layers():
    from mqbench.backend_config import QConfig, QConfigMapping, get_backend_config, prepare_fx
    from mqbench.backends import resolve_backend

    spec = resolve_backend("tensorrt")
    own = QConfig(activation=spec.activation.factory(), weight=spec.weight.factory())
    with pytest.warns(UserWarning, match="left in float"):  # the ops TensorRT leaves in float are reported
        declared = prepare_fx(
            Net().eval(),
            QConfigMapping().set_global(own),
            (torch.randn(1, 1, 8, 8),),
            backend_config=get_backend_config("tensorrt"),
        )
    builtin = prepare_by_platform(Net().eval(), "tensorrt")

    def quantized_inputs(model):
        modules = dict(model.named_modules())
        return sorted(
            str(user.target)
            for node in model.graph.nodes
            if node.op == "call_module" and isinstance(modules[str(node.target)], QuantizeBase)
            for user in node.users
        )

    # The conv (fused with its ReLU), the pool and the linear read quantized inputs in both.
    assert quantized_inputs(declared) == quantized_inputs(builtin)
    assert "conv" in quantized_inputs(declared) and "fc" in quantized_inputs(declared)


def test_get_backend_config_of_a_declared_backend_is_its_config(declared_backend):
    from mqbench.backend_config import get_backend_config

    assert get_backend_config(declared_backend).name == "declared_npu"


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3, padding=1)
        self.up = nn.ConvTranspose2d(2, 2, 2, stride=2)

    def forward(self, x):
        return self.up(self.conv(x) + x)


def test_convert_fx_lowers_additions_and_transposed_convolutions_within_one_lsb():
    import operator

    from mqbench.backend_config import QConfig, QConfigMapping, convert_fx, default_weight_observer, prepare_fx
    from mqbench.nn import quantized as nnq
    from mqbench.observer import MinMaxObserver

    observed = ObservationType.OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT
    config = BackendConfig("residual")
    for op in (nn.Conv2d, nn.ConvTranspose2d, operator.add):
        config.set_backend_pattern_config(
            BackendPatternConfig(op).set_observation_type(observed).add_dtype_config(INT8)
        )
    qconfig = QConfig(activation=MinMaxObserver.with_args(eps=2**-12), weight=default_weight_observer)
    torch.manual_seed(0)
    prepared = prepare_fx(Residual().eval(), QConfigMapping().set_global(qconfig), (torch.randn(1, 2, 6, 6),), config)
    with torch.no_grad():
        for _ in range(4):
            prepared(torch.randn(4, 2, 6, 6))
    converted = convert_fx(prepared)
    kinds = {type(m) for m in converted.modules()}
    assert {nnq.Conv2d, nnq.Add, nnq.ConvTranspose2d} <= kinds
    simulated = copy_in_quantize_mode(prepared)
    x = torch.randn(8, 2, 6, 6)
    with torch.no_grad():
        out, reference = converted(x), simulated(x)
    lsb = converted.up.scale
    # One rounding tie may go the other way in each integer layer, and a 1-LSB input step moves the
    # transposed convolution's output by at most max |w| * (kernel taps) * input LSB: bound it by 3 output LSBs.
    assert (out - reference).abs().max().item() <= 3 * lsb + 1e-6
    assert (out == reference).float().mean().item() >= 0.97


def copy_in_quantize_mode(prepared):
    import copy

    from mqbench.utils.state import enable_quantization

    model = copy.deepcopy(prepared).eval()
    enable_quantization(model)
    return model


def test_prepare_qat_fx_folds_batchnorm_while_training():
    from mqbench.backend_config import QConfig, QConfigMapping, default_weight_observer, prepare_qat_fx
    from mqbench.fake_quantize import LearnableFakeQuantize
    from mqbench.nn.intrinsic.qat import ConvBnReLU2d
    from mqbench.observer import EMAMinMaxObserver
    from mqbench.utils.state import enable_calibration

    observed = ObservationType.OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT
    config = (
        BackendConfig("qat")
        .set_backend_pattern_config(
            BackendPatternConfig((nn.Conv2d, nn.BatchNorm2d, nn.ReLU)).set_fused_module(nni.ConvBnReLU2d)
        )
        .set_backend_pattern_config(
            BackendPatternConfig(nni.ConvBnReLU2d).set_observation_type(observed).add_dtype_config(INT8)
        )
    )
    activation = LearnableFakeQuantize.with_args(observer=EMAMinMaxObserver, eps=2**-12)
    qconfig = QConfig(activation=activation, weight=default_weight_observer)
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU()).train()
    prepared = prepare_qat_fx(model, QConfigMapping().set_global(qconfig), (torch.randn(2, 1, 6, 6),), config)
    assert isinstance(prepared.get_submodule("0"), ConvBnReLU2d) and prepared.training
    enable_calibration(prepared)
    prepared(torch.randn(4, 1, 6, 6))
    enable_quantization(prepared)
    optimizer = torch.optim.SGD(prepared.parameters(), lr=0.05)
    x, target = torch.randn(16, 1, 6, 6), torch.rand(16, 4, 4, 4)
    losses = []
    for _ in range(60):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(prepared(x), target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0]


class ConvBnNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.relu = nn.ReLU()
        self.head = nn.Conv2d(4, 3, 1)

    def forward(self, x):
        return self.head(self.relu(self.bn(self.conv(x))))


@pytest.mark.parametrize(
    ("backend", "lowered", "kept"), [("snpe", {"conv", "head"}, None), ("tensorrt", {"conv"}, "head")]
)
def test_convert_fx_lowers_a_prepare_by_platform_model_and_names_what_it_keeps(backend, lowered, kept):
    """A built-in backend's prepared model (no per-node decisions): its layers are found from the graph,
    BatchNorm merged as deployment does; each integer layer computes its quantized output within 1 LSB."""
    from mqbench.backend_config import convert_fx
    from mqbench.nn import quantized as nnq

    torch.manual_seed(0)
    model = ConvBnNet().eval()
    with torch.no_grad():
        model.bn.running_mean.uniform_(-0.2, 0.2), model.bn.running_var.uniform_(0.5, 2.0)
    qmodel = prepare_by_platform(model, backend)
    enable_calibration(qmodel)
    with torch.no_grad():
        qmodel(torch.randn(16, 1, 8, 8))
    if kept:
        with pytest.warns(UserWarning, match=rf"convert_fx keeps 1 quantized op.*{kept}: its output is not quantized"):
            converted = convert_fx(qmodel)
    else:
        converted = convert_fx(qmodel)
    integer = {name for name, m in converted.named_modules() if isinstance(m, nnq.QuantizedModule)}
    assert integer == lowered
    enable_quantization(qmodel.eval())
    simulated: dict[str, torch.Tensor] = {}
    for name in lowered:  # the simulation's quantized output of each lowered layer
        quantizer = qmodel.get_submodule(f"{name}_post_act_fake_quantizer")
        quantizer.register_forward_hook(lambda m, i, o, name=name: simulated.__setitem__(name, o))
    got: dict[str, torch.Tensor] = {}
    for name in lowered:
        converted.get_submodule(name).register_forward_hook(lambda m, i, o, name=name: got.__setitem__(name, o))
    x = torch.randn(4, 1, 8, 8)
    with torch.no_grad():
        qmodel(x), converted(x)
    for name in lowered:
        step = float(qmodel.get_submodule(f"{name}_post_act_fake_quantizer").scale.max())
        assert float((got[name] - simulated[name]).abs().max()) <= step * 1.001, name


@pytest.mark.parametrize("backend", [b.value for b in BackendType])
def test_get_qconfig_mapping_quantizes_what_prepare_by_platform_quantizes(backend):
    """prepare_fx with a backend's own BackendConfig and qconfig mapping puts weight quantizers where
    prepare_by_platform does; PyTorch's default mapping is refused by most backends, with a warning."""
    import warnings

    from mqbench.backend_config import get_backend_config, get_qconfig_mapping, prepare_fx
    from mqbench.models import DigitsCNN

    extra = (config_for(backend) or {}).get("extra_qconfig_dict")
    model = DigitsCNN().eval()
    x = torch.randn(4, 1, 8, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ops a backend leaves float are named: not the point here
        declared = prepare_fx(
            model, get_qconfig_mapping(backend, extra), (x,), backend_config=get_backend_config(backend)
        )
    builtin = prepare_by_platform(model, backend, config_for(backend))

    def weighted(prepared):
        return {n.rsplit(".", 1)[0] for n, m in prepared.named_modules() if n.endswith("weight_fake_quant")}

    # the NLP backends quantize no convolution's input, but their weights: weight-only patterns say so
    assert weighted(declared) == weighted(builtin) and weighted(builtin)
    declared(x)  # calibrates


def test_a_qconfig_mapping_that_quantizes_nothing_is_named():
    from mqbench.backend_config import get_backend_config, get_default_qconfig_mapping, prepare_fx
    from mqbench.models import DigitsCNN

    x = torch.randn(4, 1, 8, 8)
    with pytest.warns(UserWarning, match=r"quantizes nothing.*get_qconfig_mapping\(backend\)"):
        prepare_fx(
            DigitsCNN().eval(), get_default_qconfig_mapping(), (x,), backend_config=get_backend_config("tensorrt")
        )
