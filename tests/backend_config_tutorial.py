"""The configuration of PyTorch's BackendConfig tutorial (steps 2, 4 and 5) with mqbench imports.

Only the imports differ from the tutorial, and the module names: mqbench's fused (``nni``), QAT
(``nnqat``, ``nniqat``) and integer reference (``nnq``) modules stand where it names torch.ao.nn ones.
"""

from __future__ import annotations

import torch

import mqbench.nn.intrinsic as nni
import mqbench.nn.intrinsic.qat as nniqat
import mqbench.nn.qat as nnqat
from mqbench.backend_config import (
    BackendConfig,
    BackendPatternConfig,
    DTypeConfig,
    DTypeWithConstraints,
    ObservationType,
    QConfig,
    QConfigMapping,
    default_weight_observer,
)
from mqbench.nn import quantized as nnq
from mqbench.observer import MinMaxObserver


def fuse_conv2d_relu(is_qat, conv, relu):
    """Return a fused ConvReLU2d from individual conv and relu modules."""
    return nni.ConvReLU2d(conv, relu)


def tutorial_objects():
    quint8_with_constraints = DTypeWithConstraints(
        dtype=torch.quint8,
        quant_min_lower_bound=0,
        quant_max_upper_bound=255,
        scale_min_lower_bound=2**-12,
    )
    weighted_int8_dtype_config = DTypeConfig(
        input_dtype=quint8_with_constraints,
        output_dtype=quint8_with_constraints,
        weight_dtype=torch.qint8,
        bias_dtype=torch.float,
    )
    linear_config = (
        BackendPatternConfig()
        .set_pattern(torch.nn.Linear)
        .set_observation_type(ObservationType.OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT)
        .add_dtype_config(weighted_int8_dtype_config)
        .set_root_module(torch.nn.Linear)
        .set_qat_module(nnqat.Linear)
        .set_reference_quantized_module(nnq.Linear)
    )
    conv_relu_config = (
        BackendPatternConfig()
        .set_pattern((torch.nn.Conv2d, torch.nn.ReLU))
        .set_fused_module(nni.ConvReLU2d)
        .set_fuser_method(fuse_conv2d_relu)
    )
    fused_conv_relu_config = (
        BackendPatternConfig()
        .set_pattern(nni.ConvReLU2d)
        .set_observation_type(ObservationType.OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT)
        .add_dtype_config(weighted_int8_dtype_config)
        .set_root_module(torch.nn.Conv2d)
        .set_qat_module(nniqat.ConvReLU2d)
        .set_reference_quantized_module(nnq.ConvReLU2d)
    )
    backend_config = (
        BackendConfig("my_backend")
        .set_backend_pattern_config(linear_config)
        .set_backend_pattern_config(conv_relu_config)
        .set_backend_pattern_config(fused_conv_relu_config)
    )
    activation_observer = MinMaxObserver.with_args(quant_min=0, quant_max=127, eps=2**-12)
    qconfig = QConfig(activation=activation_observer, weight=default_weight_observer)
    qconfig_mapping = (
        QConfigMapping()
        .set_object_type(torch.nn.Linear, qconfig)
        .set_object_type(torch.nn.Conv2d, qconfig)
        .set_object_type(torch.nn.BatchNorm2d, qconfig)
        .set_object_type(torch.nn.ReLU, qconfig)
    )
    return {
        "constraints": quint8_with_constraints,
        "dtype_config": weighted_int8_dtype_config,
        "linear": linear_config,
        "conv_relu": conv_relu_config,
        "fused_conv_relu": fused_conv_relu_config,
        "backend": backend_config,
        "qconfig": qconfig,
        "mapping": qconfig_mapping,
    }
