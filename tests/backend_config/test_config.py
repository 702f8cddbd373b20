"""mqbench.backend_config: the BackendConfig tutorial's configuration, constraint checks, qconfig resolution."""

from __future__ import annotations

import operator
import pathlib
import pickle
import re

import pytest
import torch
from torch import nn

import mqbench.backend_config as bc
import mqbench.nn.intrinsic as nni
import mqbench.nn.intrinsic.qat as nniqat
import mqbench.nn.qat as nnqat
from backend_config_tutorial import fuse_conv2d_relu, tutorial_objects
from mqbench.backend_config import (
    BackendConfig,
    BackendPatternConfig,
    DTypeConfig,
    DTypeWithConstraints,
    FixedQParamsObserver,
    ObservationType,
    QConfig,
    QConfigMapping,
    check_dtype_config,
    default_observer,
    default_qconfig,
    default_weight_observer,
    first_matching_dtype_config,
    get_default_qconfig_mapping,
    observer_info,
)
from mqbench.fake_quantize import FixedFakeQuantize, LearnableFakeQuantize
from mqbench.nn import quantized as nnq
from mqbench.observer import MinMaxObserver


@pytest.fixture
def tutorial():
    return tutorial_objects()


def names(violations):
    return [v.constraint for v in violations]


def test_tutorial_backend_config_reads_back(tutorial):
    backend = tutorial["backend"]
    assert backend.name == "my_backend"
    assert backend.configs == [tutorial["linear"], tutorial["conv_relu"], tutorial["fused_conv_relu"]]
    assert backend.config_for(nn.Linear) is tutorial["linear"]
    assert backend.config_for((nn.Conv2d, nn.ReLU)) is tutorial["conv_relu"]
    assert backend.config_for(nni.ConvReLU2d) is tutorial["fused_conv_relu"]
    assert backend.config_for((nn.Conv2d, nn.BatchNorm2d, nn.ReLU)) is None

    fusion = tutorial["conv_relu"]
    assert fusion.dtype_configs == []
    assert fusion.fused_module is nni.ConvReLU2d
    fused = fusion.fuser_method(False, nn.Conv2d(3, 3, 3), nn.ReLU())
    assert isinstance(fused, nni.ConvReLU2d)

    linear = tutorial["linear"]
    assert linear.observation_type is ObservationType.OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT
    assert linear.dtype_configs == [tutorial["dtype_config"]]
    assert (linear.root_module, linear.qat_module, linear.reference_quantized_module) == (
        nn.Linear,
        nnqat.Linear,
        nnq.Linear,
    )
    assert tutorial["fused_conv_relu"].qat_module is nniqat.ConvReLU2d

    dtype_config = tutorial["dtype_config"]
    assert (dtype_config.input_dtype, dtype_config.output_dtype) == (torch.quint8, torch.quint8)
    assert (dtype_config.weight_dtype, dtype_config.bias_dtype, dtype_config.is_dynamic) == (
        torch.qint8,
        torch.float,
        None,
    )
    assert dtype_config.constraints_of("input") is tutorial["constraints"]
    assert dtype_config.dtype_of("weight") is torch.qint8
    assert not dtype_config.constraints_of("weight").has_constraints


def test_tutorial_qconfig_meets_the_backend(tutorial):
    mapping, backend = tutorial["mapping"], tutorial["backend"]
    for qualname, op, pattern in (("linear", nn.Linear, nn.Linear), ("conv", nn.Conv2d, nni.ConvReLU2d)):
        qconfig = mapping.qconfig_for(qualname, op)
        assert qconfig is tutorial["qconfig"]
        assert check_dtype_config(qconfig, tutorial["dtype_config"]) == []
        assert first_matching_dtype_config(qconfig, backend.config_for(pattern)) == (tutorial["dtype_config"], [])
    assert mapping.qconfig_for("sigmoid", nn.Sigmoid) is None  # no global qconfig: left in float


def test_default_qconfig_mapping_breaks_the_tutorial_scale_bound(tutorial):
    qconfig = get_default_qconfig_mapping().qconfig_for("linear", nn.Linear)
    assert qconfig is default_qconfig
    match, reasons = first_matching_dtype_config(qconfig, tutorial["linear"])
    assert match is None
    assert reasons == ["scale_min_lower_bound: the activation observer's eps 1.19e-07 is below 2**-12"]
    assert names(reasons) == ["scale_min_lower_bound"]
    assert reasons[0].kind == "input"


def test_default_observers_mirror_pytorch_settings():
    weight = default_weight_observer()
    assert (weight.dtype, weight.qscheme, weight.quant_min, weight.quant_max) == (
        torch.qint8,
        torch.per_tensor_symmetric,
        -128,
        127,
    )
    assert weight.eps == torch.finfo(torch.float32).eps
    act = default_observer()
    assert (act.dtype, act.qscheme, act.quant_min, act.quant_max) == (torch.quint8, torch.per_tensor_affine, 0, 127)
    assert (default_qconfig.activation, default_qconfig.weight) == (default_observer, default_weight_observer)


# -- check_dtype_config: one passing and one failing case per constraint ---------------------------------

ACT = MinMaxObserver.with_args(quant_min=0, quant_max=127, eps=2**-12)


def _config(**constraints):
    spec = DTypeWithConstraints(dtype=torch.quint8, **constraints)
    return DTypeConfig(input_dtype=spec, output_dtype=spec, weight_dtype=torch.qint8)


def _fixed(scale, zero_point):
    return FixedQParamsObserver.with_args(scale=scale, zero_point=zero_point)


@pytest.mark.parametrize(
    ("constraints", "activation", "broken"),
    [
        ({"quant_min_lower_bound": 0}, ACT, []),
        ({"quant_min_lower_bound": 1}, ACT, ["quant_min_lower_bound"]),
        ({"quant_max_upper_bound": 127}, ACT, []),
        ({"quant_max_upper_bound": 127}, MinMaxObserver.with_args(eps=2**-12), ["quant_max_upper_bound"]),
        ({"scale_min_lower_bound": 2**-12}, ACT, []),
        (
            {"scale_min_lower_bound": 2**-12},
            MinMaxObserver.with_args(quant_min=0, quant_max=127),
            ["scale_min_lower_bound"],
        ),
        ({"scale_min_lower_bound": 2**-12}, _fixed(2**-8, 0), []),
        ({"scale_min_lower_bound": 2**-6}, _fixed(2**-8, 0), ["scale_min_lower_bound"]),
        ({"scale_max_upper_bound": 1.0}, ACT, []),  # a computed scale is only known after calibration
        ({"scale_max_upper_bound": 1.0}, _fixed(0.5, 0), []),
        ({"scale_max_upper_bound": 0.25}, _fixed(0.5, 0), ["scale_max_upper_bound"]),
        ({"scale_exact_match": 1 / 256}, _fixed(1 / 256, 0), []),
        ({"scale_exact_match": 1 / 256}, _fixed(1 / 128, 0), ["scale_exact_match"]),
        ({"scale_exact_match": 1 / 256}, ACT, ["scale_exact_match"]),
        ({"zero_point_exact_match": 128}, _fixed(1 / 128, 128), []),
        ({"zero_point_exact_match": 128}, _fixed(1 / 128, 0), ["zero_point_exact_match"]),
        (
            {"scale_exact_match": 1 / 256, "zero_point_exact_match": 0},
            ACT,
            ["scale_exact_match", "zero_point_exact_match"],
        ),
        ({"scale_min_lower_bound": 2**-12, "quant_max_upper_bound": 127}, MinMaxObserver, None),
    ],
)
def test_each_constraint_passes_and_fails(constraints, activation, broken):
    qconfig = QConfig(activation=activation, weight=default_weight_observer)
    found = check_dtype_config(qconfig, _config(**constraints))
    expected = ["quant_max_upper_bound", "scale_min_lower_bound"] if broken is None else broken
    assert sorted(names(found)) == sorted(expected)
    assert all(str(v).startswith(f"{v.constraint}: ") and v.explanation for v in found)


def test_explanations_name_the_values():
    qconfig = QConfig(activation=MinMaxObserver.with_args(eps=2**-12), weight=default_weight_observer)
    (found,) = check_dtype_config(qconfig, _config(quant_max_upper_bound=127))
    assert found == "quant_max_upper_bound: the activation observer's quant_max 255 is above 127"
    (found,) = check_dtype_config(
        QConfig(activation=_fixed(1 / 128, 0), weight=None), _config(scale_exact_match=1 / 256), kind="input"
    )
    assert found == "scale_exact_match: the activation observer's fixed scale 0.00781 differs from 2**-8"


def test_dtype_mismatch_is_reported_as_dtype():
    int8_activation = QConfig(
        activation=MinMaxObserver.with_args(dtype=torch.qint8, eps=2**-12), weight=default_weight_observer
    )
    found = check_dtype_config(int8_activation, _config(scale_min_lower_bound=2**-12))
    assert names(found) == ["dtype", "dtype"]  # input and output; the kind's limits are then skipped
    assert [v.kind for v in found] == ["input", "output"]
    assert "torch.qint8" in found[0] and "torch.quint8" in found[0]
    # the weight the other way round
    uint8_weight = QConfig(activation=ACT, weight=MinMaxObserver.with_args(dtype=torch.quint8))
    assert names(check_dtype_config(uint8_weight, _config())) == ["dtype"]
    # a missing weight observer cannot provide a quantized weight; a float expectation is met by None
    no_weight = QConfig(activation=ACT, weight=None)
    assert names(check_dtype_config(no_weight, _config())) == ["dtype"]
    assert check_dtype_config(no_weight, _config(), kind=("input", "output")) == []
    float_weight = DTypeConfig(input_dtype=torch.quint8, output_dtype=torch.quint8, weight_dtype=torch.float)
    assert check_dtype_config(no_weight, float_weight) == []


def test_kinds_selection_and_weight_constraints():
    weight_spec = DTypeWithConstraints(dtype=torch.qint8, quant_min_lower_bound=-127, quant_max_upper_bound=127)
    config = DTypeConfig(input_dtype=torch.quint8, output_dtype=torch.quint8, weight_dtype=weight_spec)
    qconfig = QConfig(activation=ACT, weight=default_weight_observer)  # [-128, 127]
    (found,) = check_dtype_config(qconfig, config)
    assert (found.constraint, found.kind) == ("quant_min_lower_bound", "weight")
    assert "weight observer's quant_min -128 is below -127" in found
    assert check_dtype_config(qconfig, config, kind="input") == []
    assert check_dtype_config(qconfig, config, kind="bias") == []
    narrow = QConfig(activation=ACT, weight=MinMaxObserver.with_args(dtype=torch.qint8, quant_min=-127, quant_max=127))
    assert check_dtype_config(narrow, config) == []
    with pytest.raises(ValueError, match="unknown dtype kind 'activation'"):
        check_dtype_config(qconfig, config, kind="activation")
    with pytest.raises(ValueError, match="expected a QConfig"):
        check_dtype_config(None, config)  # type: ignore[arg-type]


def test_dynamic_configs():
    dynamic = DTypeConfig(input_dtype=torch.quint8, output_dtype=torch.float, weight_dtype=torch.qint8, is_dynamic=True)
    qconfig = QConfig(activation=ACT, weight=default_weight_observer)
    (found,) = check_dtype_config(qconfig, dynamic)  # the output is float by design; the input must be dynamic
    assert (found.constraint, found.kind) == ("dtype", "input")
    assert "dynamically" in found
    static = DTypeConfig(
        input_dtype=torch.quint8, output_dtype=torch.quint8, weight_dtype=torch.qint8, is_dynamic=False
    )
    assert check_dtype_config(qconfig, static) == []


def test_fake_quantizer_factories_are_read_with_their_observer():
    fq = FixedFakeQuantize.with_args(observer=MinMaxObserver, quant_min=0, quant_max=127, eps=2**-12)
    qconfig = QConfig(activation=fq, weight=default_weight_observer)
    assert check_dtype_config(qconfig, _config(scale_min_lower_bound=2**-12, quant_max_upper_bound=127)) == []
    info = observer_info(fq)
    assert (info.name, info.dtype, info.quant_max, info.eps) == (
        "FixedFakeQuantize(MinMaxObserver)",
        torch.quint8,
        127,
        2**-12,
    )
    fixed = FixedFakeQuantize.with_args(observer=FixedQParamsObserver, scale=1 / 256, zero_point=0)
    exact = _config(scale_exact_match=1 / 256, zero_point_exact_match=0)
    assert check_dtype_config(QConfig(activation=fixed, weight=None), exact, kind=("input", "output")) == []
    module = fixed()
    module(torch.randn(16))
    assert module.scale.item() == 1 / 256 and module.zero_point.item() == 0
    per_channel = observer_info(LearnableFakeQuantize.with_args(ch_axis=0, qscheme=torch.per_channel_symmetric))
    assert per_channel.is_per_channel and per_channel.symmetric and per_channel.ch_axis == 0


def test_first_matching_dtype_config_tries_in_order(tutorial):
    strict = _config(quant_max_upper_bound=63)
    pattern = BackendPatternConfig(nn.Linear).set_dtype_configs([strict, tutorial["dtype_config"]])
    assert first_matching_dtype_config(tutorial["qconfig"], pattern) == (tutorial["dtype_config"], [])
    match, reasons = first_matching_dtype_config(default_qconfig, pattern)
    assert match is None
    assert sorted(names(reasons)) == ["quant_max_upper_bound", "scale_min_lower_bound"]
    assert first_matching_dtype_config(None, pattern) == (None, [])
    assert first_matching_dtype_config(tutorial["qconfig"], tutorial["conv_relu"]) == (None, [])


def test_observer_build_failures_are_value_errors():
    broken = MinMaxObserver.with_args(quant_min=5, quant_max=1)
    with pytest.raises(ValueError, match="could not build an observer"):
        check_dtype_config(QConfig(activation=broken, weight=None), _config())


def test_violations_pickle():
    violation = bc.ConstraintViolation("scale_min_lower_bound", "why", "input")
    copy = pickle.loads(pickle.dumps(violation))
    assert (copy, copy.constraint, copy.kind) == ("scale_min_lower_bound: why", "scale_min_lower_bound", "input")
    assert set(bc.CONSTRAINT_NAMES) == {
        "dtype",
        "quant_min_lower_bound",
        "quant_max_upper_bound",
        "scale_min_lower_bound",
        "scale_max_upper_bound",
        "scale_exact_match",
        "zero_point_exact_match",
    }


# -- QConfigMapping -----------------------------------------------------------------------------------

QA, QB, QC, QD, QE = (
    QConfig(activation=MinMaxObserver.with_args(quant_max=100 + i, quant_min=0), weight=None) for i in range(5)
)


def test_qconfig_mapping_precedence():
    mapping = (
        QConfigMapping()
        .set_global(QA)
        .set_object_type(nn.Linear, QB)
        .set_module_name_regex(r"encoder\.layer\d+", QC)
        .set_module_name("encoder.layer1", QD)
        .set_module_name_object_type_order("encoder.layer1", operator.add, 1, QE)
    )
    assert mapping.qconfig_for("head", nn.Conv2d) is QA  # global
    assert mapping.qconfig_for("head", nn.Linear) is QB  # object type
    assert mapping.qconfig_for("encoder.layer2.fc", nn.Linear) is QC  # regex beats object type
    assert mapping.qconfig_for("encoder.layer1", nn.Linear) is QD  # module name beats regex
    assert mapping.qconfig_for("encoder.layer1.fc", nn.Linear) is QD  # ... and covers submodules
    assert mapping.qconfig_for("encoder.layer1", operator.add, index=0) is QD
    assert mapping.qconfig_for("encoder.layer1", operator.add, index=1) is QE  # order beats module name
    assert mapping.qconfig_for("encoder.layer1.sub", operator.add, index=1) is QD  # order needs the exact module
    assert mapping.qconfig_for("x.encoder.layer2", nn.Linear) is QB  # regexes use re.match (anchored at the start)


def test_none_disables_at_every_level():
    base = QConfigMapping().set_global(QA)
    assert QConfigMapping().qconfig_for("a", nn.Linear) is None
    assert QConfigMapping().set_global(None).qconfig_for("a", nn.Linear) is None
    assert base.set_object_type(nn.Linear, None).qconfig_for("a", nn.Linear) is None
    assert base.qconfig_for("a", nn.Conv2d) is QA
    mapping = QConfigMapping().set_global(QA).set_object_type(nn.Conv2d, QB).set_module_name_regex("skip.*", None)
    assert mapping.qconfig_for("skip_me", nn.Conv2d) is None
    mapping.set_module_name("skip_me.keep", QC)
    assert mapping.qconfig_for("skip_me.keep.conv", nn.Conv2d) is QC
    mapping.set_module_name("skip_me.keep", None)  # re-setting replaces
    assert mapping.qconfig_for("skip_me.keep.conv", nn.Conv2d) is None


def test_regexes_match_in_registration_order_and_methods_are_object_types():
    mapping = QConfigMapping().set_module_name_regex("block.*", QA).set_module_name_regex(r"block\.0", QB)
    assert mapping.qconfig_for("block.0", nn.ReLU) is QA
    mapping = QConfigMapping().set_object_type("relu", QA).set_object_type(torch.add, QB)
    assert mapping.qconfig_for("", "relu") is QA
    assert mapping.qconfig_for("", torch.add) is QB
    assert mapping.qconfig_for("", "view") is None


def test_qconfig_mapping_round_trip_and_read_access():
    mapping = (
        QConfigMapping()
        .set_global(QA)
        .set_object_type(nn.Linear, None)
        .set_module_name_regex("a.*", QB)
        .set_module_name("b", QC)
        .set_module_name_object_type_order("b", "relu", 0, QD)
    )
    data = mapping.to_dict()
    assert data == {
        "": QA,
        "object_type": [(nn.Linear, None)],
        "module_name_regex": [("a.*", QB)],
        "module_name": [("b", QC)],
        "module_name_object_type_order": [("b", "relu", 0, QD)],
    }
    again = QConfigMapping.from_dict(data)
    assert again.to_dict() == data
    assert again.global_qconfig is QA and again.module_name_qconfigs == {"b": QC}
    assert again.object_type_qconfigs == {nn.Linear: None}
    assert again.module_name_regex_qconfigs == {"a.*": QB}
    assert again.module_name_object_type_order_qconfigs == {("b", "relu", 0): QD}
    assert "global=" not in repr(QConfigMapping()) and "module_name['b']" in repr(again)
    with pytest.raises(ValueError, match="unknown keys"):
        QConfigMapping.from_dict({"module_names": []})
    with pytest.raises(ValueError, match="2-tuples"):
        QConfigMapping.from_dict({"module_name": [("b",)]})


def test_qconfig_mapping_validation():
    mapping = QConfigMapping()
    with pytest.raises(ValueError, match="expected a QConfig or None"):
        mapping.set_global(default_observer)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="invalid regex"):
        mapping.set_module_name_regex("(", QA)
    with pytest.raises(ValueError, match="module name must be a string"):
        mapping.set_module_name(3, QA)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="index must be a non-negative int"):
        mapping.set_module_name_object_type_order("a", operator.add, -1, QA)
    with pytest.raises(ValueError, match="pass the module class Linear"):
        mapping.set_object_type(nn.Linear(2, 2), QA)  # type: ignore[arg-type]


# -- QConfig, setters, round trips, validation ----------------------------------------------------------


def test_qconfig_validation():
    assert QConfig(MinMaxObserver, None).activation is MinMaxObserver
    with pytest.raises(ValueError, match="MinMaxObserver instance"):
        QConfig(activation=MinMaxObserver(), weight=None)
    with pytest.raises(ValueError, match="must build an observer"):
        QConfig(activation=int, weight=None)
    with pytest.raises(ValueError, match="observer factory"):
        QConfig(activation=None, weight=3)  # type: ignore[arg-type]


def test_setters_chain_and_round_trip(tutorial):
    config = BackendPatternConfig()
    for setter, value in (
        (config.set_pattern, (nn.Conv2d, nn.ReLU)),
        (config.set_observation_type, ObservationType.OUTPUT_SHARE_OBSERVER_WITH_INPUT),
        (config.add_dtype_config, tutorial["dtype_config"]),
        (config.set_dtype_configs, [tutorial["dtype_config"]]),
        (config.set_root_module, nn.Conv2d),
        (config.set_qat_module, nnqat.Conv2d),
        (config.set_reference_quantized_module, nn.Conv2d),
        (config.set_fused_module, nni.ConvReLU2d),
        (config.set_fuser_method, fuse_conv2d_relu),
    ):
        assert setter(value) is config
    assert config.to_dict() == {
        "pattern": (nn.Conv2d, nn.ReLU),
        "observation_type": ObservationType.OUTPUT_SHARE_OBSERVER_WITH_INPUT,
        "dtype_configs": [tutorial["dtype_config"].to_dict()],
        "root_module": nn.Conv2d,
        "qat_module": nnqat.Conv2d,
        "reference_quantized_module_for_root": nn.Conv2d,
        "fused_module": nni.ConvReLU2d,
        "fuser_method": fuse_conv2d_relu,
    }
    assert BackendPatternConfig.from_dict(config.to_dict()) == config
    backend = tutorial["backend"]
    again = BackendConfig.from_dict(backend.to_dict())
    assert again.name == "my_backend" and again.to_dict() == backend.to_dict() and again.configs == backend.configs
    assert BackendConfig("x").set_name("y").set_backend_pattern_configs(backend.configs).name == "y"
    dtype_data = tutorial["dtype_config"].to_dict()
    assert dtype_data["weight_dtype"] is torch.qint8 and dtype_data["input_dtype"] is tutorial["constraints"]
    assert DTypeConfig.from_dict(dtype_data) == tutorial["dtype_config"]
    assert hash(DTypeConfig.from_dict(dtype_data)) == hash(tutorial["dtype_config"])


def test_resetting_a_pattern_replaces_it(tutorial):
    backend = tutorial["backend"]
    replacement = BackendPatternConfig(nn.Linear).set_observation_type(ObservationType.INPUT_OUTPUT_NOT_OBSERVED)
    backend.set_backend_pattern_config(replacement)
    assert len(backend.configs) == 3
    assert backend.configs[0] is replacement and backend.config_for(nn.Linear) is replacement


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda c: c.set_pattern(nn.ReLU()), "pass the module class ReLU"),
        (lambda c: c.set_pattern(int), "torch.nn.Module subclass"),
        (lambda c: c.set_pattern(3), "expected a module class, a function"),
        (lambda c: c.set_pattern([nn.Conv2d, nn.ReLU]), "must be a tuple"),
        (lambda c: c.set_pattern((nn.Conv2d,)), "at least two ops"),
        (lambda c: c.set_pattern((nn.ReLU, (nn.BatchNorm2d, nn.Conv2d))), "nested tuple at position 1"),
        (lambda c: c.set_pattern("not a name"), "Python identifier"),
        (lambda c: c.set_observation_type("OUTPUT_SHARE_OBSERVER_WITH_INPUT"), "expected one of ObservationType"),
        (lambda c: c.add_dtype_config({"input_dtype": torch.quint8}), "expected a DTypeConfig"),
        (lambda c: c.set_dtype_configs(DTypeConfig()), "use add_dtype_config"),
        (lambda c: c.set_dtype_configs([torch.quint8]), "every entry must be a DTypeConfig"),
        (lambda c: c.set_root_module(nn.Linear(2, 2)), "pass the class Linear"),
        (lambda c: c.set_qat_module("Linear"), "torch.nn.Module subclass or None"),
        (lambda c: c.set_fused_module(fuse_conv2d_relu), "torch.nn.Module subclass or None"),
        (lambda c: c.set_fuser_method(nni.ConvReLU2d), "expected a function fuser_method"),
    ],
)
def test_pattern_config_validation(call, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        call(BackendPatternConfig())


def test_backend_config_validation():
    backend = BackendConfig("b")
    with pytest.raises(ValueError, match="has no pattern"):
        backend.set_backend_pattern_config(BackendPatternConfig())
    with pytest.raises(ValueError, match="expected a BackendPatternConfig"):
        backend.set_backend_pattern_config(nn.Linear)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="use set_backend_pattern_config"):
        backend.set_backend_pattern_configs(BackendPatternConfig(nn.Linear))  # type: ignore[arg-type]
    single = BackendPatternConfig(nn.Linear).set_fuser_method(fuse_conv2d_relu)
    with pytest.raises(ValueError, match="needs a fusion pattern"):
        backend.set_backend_pattern_config(single)
    three = BackendPatternConfig((nn.Conv2d, nn.BatchNorm2d, nn.ReLU)).set_fuser_method(fuse_conv2d_relu)
    with pytest.raises(ValueError, match=r"must accept \(is_qat, 3 modules\)"):
        backend.set_backend_pattern_config(three)
    # a fuser method without a fused module is fine (e.g. folding BatchNorm into a plain Linear)
    fold = BackendPatternConfig((nn.Linear, nn.BatchNorm1d)).set_fuser_method(lambda is_qat, linear, bn: linear)
    assert backend.set_backend_pattern_config(fold).configs == [fold]
    with pytest.raises(ValueError, match="unknown keys"):
        BackendConfig.from_dict({"name": "b", "patterns": []})
    with pytest.raises(ValueError, match="unknown keys"):
        BackendPatternConfig.from_dict({"pattern": nn.Linear, "root": nn.Linear})
    with pytest.raises(ValueError, match="name must be a string"):
        BackendConfig(None)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dtype": "quint8"}, "dtype must be a torch.dtype"),
        ({"quant_min_lower_bound": 0.5}, "quant_min_lower_bound must be an int"),
        ({"quant_min_lower_bound": 10, "quant_max_upper_bound": 5}, "must not exceed quant_max_upper_bound"),
        ({"scale_min_lower_bound": 0.0}, "scale_min_lower_bound must be positive"),
        ({"scale_min_lower_bound": 1.0, "scale_max_upper_bound": 0.5}, "must not exceed scale_max_upper_bound"),
        ({"scale_exact_match": float("nan")}, "scale_exact_match must be finite"),
        ({"zero_point_exact_match": True}, "zero_point_exact_match must be an int"),
    ],
)
def test_dtype_with_constraints_validation(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        DTypeWithConstraints(**kwargs)


def test_dtype_config_validation_and_immutability():
    with pytest.raises(ValueError, match=r"input_dtype must be a torch\.dtype"):
        DTypeConfig(input_dtype="quint8")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="is_dynamic must be a bool"):
        DTypeConfig(is_dynamic=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown keys"):
        DTypeConfig.from_dict({"activation_dtype": torch.quint8})
    config = DTypeConfig(input_dtype=torch.quint8)
    with pytest.raises(AttributeError):
        config.is_dynamic = True  # type: ignore[misc]
    with pytest.raises(AttributeError):
        DTypeWithConstraints().dtype = torch.qint8  # type: ignore[misc]


def test_fixed_qparams_observer_validation():
    with pytest.raises(ValueError, match="per-tensor only"):
        FixedQParamsObserver(scale=0.1, zero_point=0, qscheme=torch.per_channel_affine)
    with pytest.raises(ValueError, match="outside"):
        FixedQParamsObserver(scale=0.1, zero_point=-1)
    with pytest.raises(ValueError, match="positive"):
        FixedQParamsObserver(scale=0.0, zero_point=0)
    with pytest.raises(ValueError, match="takes no eps"):
        FixedQParamsObserver(scale=0.1, zero_point=0, eps=1e-3)


def test_package_exports_and_never_imports_torch_ao_quantization():
    for name in bc.__all__:
        assert getattr(bc, name) is not None
    root = pathlib.Path(bc.__file__).parent
    for path in root.glob("*.py"):
        assert "torch.ao" not in path.read_text(), path
