"""mqbench.backend_config.get_backend_config: every built-in backend read back as a BackendConfig."""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
from torch import nn

import mqbench.nn.intrinsic as nni
import mqbench.nn.intrinsic.qat as nniqat
import mqbench.nn.qat as nnqat
import mqbench.nn.quantized as nnq
from mqbench.backend_config import (
    BackendConfig,
    ObservationType,
    QConfig,
    check_dtype_config,
    get_backend_config,
)
from mqbench.backends import BackendSpec, Placement, QuantizerSpec, resolve_backend
from mqbench.custom_quantizer.ops import FUNCTION_KINDS, METHOD_KINDS, MODULE_KINDS, WEIGHTED_KINDS
from mqbench.fuser_method_mapping import FUSER_METHODS
from mqbench.prepare_by_platform import BackendType
from mqbench.scheme import QuantScheme

BACKENDS = list(BackendType)


@functools.cache
def config_of(backend: BackendType) -> BackendConfig:
    return get_backend_config(backend)


def expanded_fusion_patterns() -> dict[tuple, object]:
    """FUSER_METHODS with each tuple matcher (RELU) expanded into one pattern per member."""
    out = {}
    for key, fuser in FUSER_METHODS.items():
        choices = [entry if isinstance(entry, tuple) else (entry,) for entry in key]
        for pattern in itertools.product(*choices):
            out[pattern] = fuser
    return out


def quantized_kinds(spec: BackendSpec) -> frozenset[str]:
    return spec.placement.inputs_of | spec.placement.outputs_of | spec.placement.passthrough


def schemes(spec: BackendSpec) -> tuple[QuantScheme, QuantScheme]:
    """(activation, weight) schemes; the documented 8-bit defaults where the spec has none."""
    activation = spec.activation.scheme if spec.activation else QuantScheme(8, symmetric=False)
    weight = spec.weight.scheme if spec.weight else QuantScheme(8, symmetric=True)
    return activation, weight


def quantization_configs(config: BackendConfig) -> list:
    return [entry for entry in config.configs if entry.fuser_method is None]


def bounds(entry) -> tuple[int | None, int | None]:
    return entry.quant_min_lower_bound, entry.quant_max_upper_bound


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.value)
def test_named_after_the_backend_and_covers_every_quantized_op(backend):
    spec = resolve_backend(backend)
    config = config_of(backend)
    assert isinstance(config, BackendConfig)
    assert config.name == spec.name == backend.value
    patterns = {entry.pattern for entry in quantization_configs(config)}
    activations = quantized_kinds(spec)
    kinds = activations | WEIGHTED_KINDS  # every layer's weights are quantized
    assert {cls for cls, kind in MODULE_KINDS.items() if kind in kinds} <= patterns
    assert {fn for fn, kind in FUNCTION_KINDS.items() if kind in kinds} <= patterns
    assert {name for name, kind in METHOD_KINDS.items() if kind in kinds} <= patterns
    # nothing of a kind the backend leaves in float
    others = {cls for cls, kind in MODULE_KINDS.items() if kind not in kinds}
    assert not others & patterns
    # a layer whose activations stay float: weight-only (float input and output, the weight grid)
    for entry in quantization_configs(config):
        if MODULE_KINDS.get(entry.pattern) in WEIGHTED_KINDS - activations:
            for dtype_config in entry.dtype_configs:
                assert dtype_config.input_dtype == dtype_config.output_dtype == torch.float
                assert dtype_config.weight_dtype in (torch.qint8, torch.quint8)


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.value)
def test_fusion_patterns_are_the_fuser_methods(backend):
    spec = resolve_backend(backend)
    fusions = {entry.pattern: entry for entry in config_of(backend).configs if entry.fuser_method is not None}
    expected = expanded_fusion_patterns() if spec.fuse else {}
    assert set(fusions) == set(expected)
    for pattern, entry in fusions.items():
        assert entry.fuser_method is expected[pattern]
        assert entry.dtype_configs == []
        assert issubclass(entry.fused_module, nni.FusedModule)


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.value)
def test_dtype_ranges_are_the_schemes(backend):
    spec = resolve_backend(backend)
    activation, weight = schemes(spec)
    ranges = {(activation.quant_min, activation.quant_max)}
    if spec.placement.unsigned_after and activation.quant_min < 0:
        ranges.add((0, activation.quant_max - activation.quant_min))
    for entry in quantization_configs(config_of(backend)):
        assert entry.dtype_configs, entry
        for dtype_config in entry.dtype_configs:
            weight_only = dtype_config.input_dtype == torch.float  # a layer whose activations stay float
            assert weight_only or bounds(dtype_config.constraints_of("input")) in ranges
            output = dtype_config.constraints_of("output")
            if output.dtype is not None and output.dtype.is_floating_point:
                assert entry.observation_type is ObservationType.OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT
            else:
                assert bounds(output) in ranges
            if isinstance(entry.pattern, type) and entry.pattern in MODULE_KINDS:
                weighted = MODULE_KINDS[entry.pattern] in WEIGHTED_KINDS
                assert (dtype_config.weight_dtype is not None) == weighted, entry
            if dtype_config.weight_dtype is not None:
                assert bounds(dtype_config.constraints_of("weight")) == (weight.quant_min, weight.quant_max)
                assert dtype_config.bias_dtype == torch.float
    first = next(c for c in quantization_configs(config_of(backend)) if c.dtype_configs[0].input_dtype != torch.float)
    first = first.dtype_configs[0]
    assert first.input_dtype == (torch.qint8 if activation.quant_min < 0 else torch.quint8) or activation.bits > 8


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.value)
def test_to_dict_round_trips(backend):
    config = config_of(backend)
    data = config.to_dict()
    assert data["name"] == backend.value
    assert len(data["configs"]) == len(config.configs)
    assert BackendConfig.from_dict(data).to_dict() == data


def test_tensorrt_conv_weights_are_symmetric_int8():
    conv = config_of(BackendType.Tensorrt).config_for(nn.Conv2d)
    assert conv is not None
    for dtype_config in conv.dtype_configs:
        assert dtype_config.weight_dtype == torch.qint8
        assert dtype_config.constraints_of("weight").quant_min_lower_bound == -127
        assert dtype_config.constraints_of("weight").quant_max_upper_bound == 127
    assert conv.root_module is nn.Conv2d
    assert conv.qat_module is nnqat.Conv2d
    assert conv.reference_quantized_module is nnq.Conv2d


def test_observation_types_follow_the_placement():
    # TensorRT quantizes inputs only: the output dtype is float.
    conv = config_of(BackendType.Tensorrt).config_for(nn.Conv2d)
    assert conv.observation_type is ObservationType.OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT
    assert conv.dtype_configs[0].output_dtype == torch.float
    # SNPE is all-integer: outputs quantized; reshape/relu pass through sharing the input's grid.
    snpe = config_of(BackendType.SNPE)
    assert snpe.config_for(nn.Conv2d).dtype_configs[0].output_dtype == torch.quint8
    for op in ("view", nn.ReLU, nn.Flatten, torch.reshape):
        entry = snpe.config_for(op)
        assert entry.observation_type is ObservationType.OUTPUT_SHARE_OBSERVER_WITH_INPUT
        assert (
            entry.dtype_configs[0].input_dtype_with_constraints == entry.dtype_configs[0].output_dtype_with_constraints
        )
    # Vitis lists relu in outputs_of and passthrough: outputs_of wins.
    relu = config_of(BackendType.Vitis).config_for(nn.ReLU)
    assert relu.observation_type is ObservationType.OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT


def _instance(op):
    """A small module for a fusion pattern's op (functions and method names are passed as they are)."""
    if not isinstance(op, type):
        return op
    if issubclass(op, nn.modules.batchnorm._BatchNorm):
        return op(2)
    if op is nn.Linear:
        return op(2, 2)
    if issubclass(op, nn.modules.conv._ConvNd):
        return op(2, 2, 1)
    return op()


def test_fused_module_is_what_the_fuser_builds_for_qat():
    config = config_of(BackendType.Tensorrt)
    for entry in config.configs:
        if entry.fuser_method is None:
            continue
        fused = entry.fuser_method(True, *(_instance(op) for op in entry.pattern))
        assert type(fused) is entry.fused_module, entry.pattern


def test_fused_and_qat_modules_of_weighted_kinds():
    config = config_of(BackendType.Tensorrt)
    fused = config.config_for(nni.ConvBnReLU2d)
    assert fused.root_module is nn.Conv2d
    assert fused.qat_module is nniqat.ConvBnReLU2d
    assert fused.reference_quantized_module is nnq.ConvReLU2d
    assert config.config_for(nni.LinearBn1d).reference_quantized_module is nnq.Linear
    qat = config.config_for(nniqat.ConvBnReLU2d)
    assert (qat.root_module, qat.qat_module, qat.reference_quantized_module) == (nn.Conv2d, None, nnq.ConvReLU2d)
    deconv = config.config_for(nnqat.ConvTranspose1d)
    assert (deconv.root_module, deconv.reference_quantized_module) == (nn.ConvTranspose1d, None)
    assert config.config_for(torch.add).reference_quantized_module is nnq.Add
    assert config.config_for(torch.cat).reference_quantized_module is nnq.Cat


def test_schemeless_backends_use_8bit_defaults():
    for backend in (BackendType.Academic, BackendType.Academic_NLP):
        linear = config_of(backend).config_for(nn.Linear).dtype_configs[0]
        assert (linear.input_dtype, bounds(linear.constraints_of("input"))) == (torch.quint8, (0, 255))
        assert (linear.weight_dtype, bounds(linear.constraints_of("weight"))) == (torch.qint8, (-128, 127))


def test_16_bit_activations():
    conv = config_of(BackendType.PPLW8A16).config_for(nn.Conv2d).dtype_configs[0]
    assert conv.input_dtype == getattr(torch, "uint16", torch.qint32)
    assert bounds(conv.constraints_of("output")) == (0, 65535)
    assert (conv.weight_dtype, bounds(conv.constraints_of("weight"))) == (torch.quint8, (0, 255))


def test_unsigned_after_adds_an_unsigned_input_config():
    conv = config_of(BackendType.OPENVINO).config_for(nn.Conv2d)
    signed, unsigned = conv.dtype_configs
    assert (signed.input_dtype, bounds(signed.constraints_of("input"))) == (torch.qint8, (-128, 127))
    assert (unsigned.input_dtype, bounds(unsigned.constraints_of("input"))) == (torch.quint8, (0, 255))
    assert len(config_of(BackendType.SNPE).config_for(nn.Conv2d).dtype_configs) == 1


@pytest.mark.parametrize("backend", [b for b in BACKENDS if resolve_backend(b).weight], ids=lambda b: b.value)
def test_the_backends_own_quantizers_meet_its_constraints(backend):
    spec = resolve_backend(backend)
    qconfig = QConfig(activation=spec.activation.factory(), weight=spec.weight.factory())
    checked = set()
    for entry in quantization_configs(config_of(backend)):
        dtype_config = entry.dtype_configs[0]
        if dtype_config in checked:
            continue
        checked.add(dtype_config)
        float_output = dtype_config.output_dtype is not None and dtype_config.output_dtype.is_floating_point
        kinds = ("input", "weight", "bias") if float_output else None
        violations = check_dtype_config(qconfig, dtype_config, kinds)
        if spec.activation.scheme.bits > 8:  # mqbench observers report quint8 for a 16-bit grid
            assert {v.constraint for v in violations} <= {"dtype"}
        else:
            assert violations == [], (entry, violations)


def test_a_spec_and_its_flags():
    scheme = QuantScheme(8, symmetric=True)
    spec = BackendSpec(
        name="custom",
        weight=QuantizerSpec(scheme),
        activation=QuantizerSpec(scheme),
        placement=Placement(inputs_of={"linear"}, passthrough={"relu"}),
        fuse=False,
    )
    config = get_backend_config(spec)
    assert config.name == "custom"
    assert all(entry.fuser_method is None for entry in config.configs)
    assert config.config_for(nni.LinearReLU) is None  # no fusion, no fused modules
    assert config.config_for(nnqat.Linear) is not None
    assert config.config_for(nn.ReLU).observation_type is ObservationType.OUTPUT_SHARE_OBSERVER_WITH_INPUT
    conv = config.config_for(nn.Conv2d)  # its input stays float, its weights are quantized (as prepare does)
    assert conv.dtype_configs[0].input_dtype == torch.float and conv.dtype_configs[0].weight_dtype == torch.qint8


def test_unknown_backends_raise():
    with pytest.raises(ValueError, match="unknown backend 'nope'"):
        get_backend_config("nope")
    with pytest.raises(ValueError, match="a backend is named by"):
        get_backend_config(3)  # type: ignore[arg-type]
