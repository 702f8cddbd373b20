"""``prepare_fx`` / ``convert_fx`` with PyTorch's signatures, on mqbench's engine and integer modules.

``prepare_fx`` traces the model, applies the backend's decisions (see
:mod:`mqbench.backend_config.engine`) and returns a GraphModule in calibration mode:
observers record, outputs stay float (as PyTorch's prepared models do). ``convert_fx``
switches the quantizers to quantization and lowers every quantized layer that has both its
input and output quantizers to its :mod:`mqbench.nn.quantized` module (int8 weights, int32
bias, integer accumulation, fixed-point requantization), and quantized additions and
multiplications to ``nnq.Add`` / ``nnq.Mul``. What is not lowered keeps its fake quantizers.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from mqbench.backend_config import (BackendConfig, BackendPatternConfig, DTypeConfig, QConfig,
    ...     QConfigMapping, default_weight_observer, prepare_fx, convert_fx)
    >>> from mqbench.observer import MinMaxObserver
    >>> int8 = DTypeConfig(input_dtype=torch.quint8, output_dtype=torch.quint8, weight_dtype=torch.qint8)
    >>> backend = BackendConfig("b").set_backend_pattern_config(BackendPatternConfig(nn.Linear).add_dtype_config(int8))
    >>> qconfig = QConfig(activation=MinMaxObserver.with_args(), weight=default_weight_observer)
    >>> model = nn.Sequential(nn.Linear(4, 3), nn.Sigmoid())
    >>> prepared = prepare_fx(model, QConfigMapping().set_global(qconfig), (torch.randn(2, 4),), backend_config=backend)
    >>> _ = prepared(torch.randn(8, 4))
    >>> converted = convert_fx(prepared)
    >>> type(converted.get_submodule("0")).__name__
    'Linear'
    >>> converted.get_submodule("0").__module__
    'mqbench.nn.quantized.linear'
"""

from __future__ import annotations

import copy
import operator
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx, nn

from mqbench.backend_config.backend_config import BackendConfig
from mqbench.backend_config.engine import apply_backend_config
from mqbench.backend_config.qconfig_mapping import QConfigMapping
from mqbench.custom_quantizer.passes import set_submodule
from mqbench.custom_quantizer.plan import PLAN_ATTRIBUTE, plan_of
from mqbench.fake_quantize import QuantizeBase
from mqbench.nn import quantized as nnq
from mqbench.nn.intrinsic.qat.modules.bn_folding import BnFoldingModule
from mqbench.utils.export_capture import trace_or_export
from mqbench.utils.hf_capture import linear_layers
from mqbench.utils.state import enable_calibration, enable_quantization
from mqbench.utils.tracer import trace

__all__ = ["convert_fx", "prepare_fx", "prepare_qat_fx"]

_ELEMENTWISE: dict[Any, Any] = {operator.add: nnq.Add, torch.add: nnq.Add, operator.mul: nnq.Mul, torch.mul: nnq.Mul}


def _prepare(
    model: nn.Module,
    qconfig_mapping: QConfigMapping,
    example_inputs: Sequence[Any],
    backend_config: BackendConfig,
    is_qat: bool,
    concrete_args: dict[str, Any] | None,
) -> fx.GraphModule:
    if not isinstance(qconfig_mapping, QConfigMapping):
        raise ValueError(f"qconfig_mapping must be a QConfigMapping, got {type(qconfig_mapping).__name__}")
    if not isinstance(backend_config, BackendConfig):
        raise ValueError(f"backend_config must be a BackendConfig, got {type(backend_config).__name__}")
    if not isinstance(example_inputs, (tuple, list)):
        raise ValueError("example_inputs must be a tuple of the model's positional inputs")
    training = model.training
    copied = copy.deepcopy(model).train(is_qat)
    linear_layers(copied)  # transformers' Conv1D (GPT-2) is prepared as the nn.Linear it is
    if concrete_args:  # torch.fx's options: traced with torch.fx alone
        graph_module = trace(copied, concrete_args, (), None)
    else:  # torch.fx, and torch.export on the example inputs where fx cannot follow the forward
        graph_module, _ = trace_or_export(copied, tuple(example_inputs))

    def qconfig_for(name: str, op: Any, index: int | None) -> Any:
        return qconfig_mapping.qconfig_for(name, op, index=index)

    prepared = apply_backend_config(graph_module, backend_config, qconfig_for, is_qat)
    enable_calibration(prepared)
    return prepared.train(training)


def prepare_fx(
    model: nn.Module,
    qconfig_mapping: QConfigMapping,
    example_inputs: Sequence[Any],
    backend_config: BackendConfig,
    prepare_custom_config: Any = None,
    concrete_args: dict[str, Any] | None = None,
) -> fx.GraphModule:
    """Post-training quantization: BatchNorm folded, observers on; run calibration data through the result.

    The model is traced with torch.fx; where fx cannot follow its forward, it is captured with
    ``torch.export`` called on ``example_inputs`` (the positional arguments), as
    ``prepare_by_platform`` does. ``prepare_custom_config`` is accepted for signature compatibility
    and must be None.
    """
    if prepare_custom_config is not None:
        raise ValueError("prepare_custom_config is not supported; use concrete_args for tracing options")
    return _prepare(model, qconfig_mapping, example_inputs, backend_config, False, concrete_args)


def prepare_qat_fx(
    model: nn.Module,
    qconfig_mapping: QConfigMapping,
    example_inputs: Sequence[Any],
    backend_config: BackendConfig,
    concrete_args: dict[str, Any] | None = None,
) -> fx.GraphModule:
    """Quantization-aware training: BatchNorm kept and folded while training; observers on."""
    return _prepare(model, qconfig_mapping, example_inputs, backend_config, True, concrete_args)


def _quantizer(gm: fx.GraphModule, node: Any) -> QuantizeBase | None:
    if isinstance(node, fx.Node) and node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        if isinstance(module, QuantizeBase):
            return module
    return None


def _output_quantizer_node(gm: fx.GraphModule, node: fx.Node) -> fx.Node | None:
    users = list(node.users)
    if len(users) == 1 and _quantizer(gm, users[0]) is not None:
        return users[0]
    return None


def _bypass_absorbed_inputs(gm: fx.GraphModule, lowered: set[str]) -> None:
    """Remove input quantizers read only by integer modules (which quantize their input themselves)."""
    for node in list(gm.graph.nodes):
        if _quantizer(gm, node) is None or not node.users:
            continue
        if all(user.op == "call_module" and str(user.target) in lowered for user in node.users):
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)


def convert_fx(
    prepared: fx.GraphModule, backend_config: BackendConfig | None = None, convert_custom_config: Any = None
) -> fx.GraphModule:
    """The quantized model: integer modules where a layer is quantized on both sides, fake quantizers elsewhere.

    The prepared model is not changed. ``backend_config`` may name a pattern's
    ``reference_quantized_module`` (an :mod:`mqbench.nn.quantized` class) to lower to.
    """
    if not isinstance(prepared, fx.GraphModule):
        raise ValueError(f"convert_fx expects the GraphModule prepare_fx returned, got {type(prepared).__name__}")
    if convert_custom_config is not None:
        raise ValueError("convert_custom_config is not supported")
    plan = plan_of(prepared)
    if plan is None:
        raise ValueError(
            "convert_fx expects a model prepared by mqbench (prepare_fx, prepare_qat_fx or prepare_by_platform): "
            "this GraphModule carries no quantization plan"
        )
    model = copy.deepcopy(prepared).eval()
    enable_quantization(model)
    # The layers to lower are those the plan quantizes; BatchNorm is merged first, as deployment does.
    _merge_batchnorm(model)
    lowered: set[str] = set()
    # Read every layer's quantizers first: lowering one layer removes the quantizer its reader shares.
    plans: list[tuple[fx.Node, fx.Node, nn.Module]] = []
    left: dict[str, str] = {}  # quantized layers kept with fake quantizers, and why
    for node in list(model.graph.nodes):
        if not plan.quantized(node.name):
            continue
        module = model.get_submodule(str(node.target)) if node.op == "call_module" else None
        elementwise = node.op == "call_function" and node.target in _ELEMENTWISE
        target = _reference_module(backend_config, module) if module is not None else None
        if target is None and module is not None and hasattr(module, "weight_fake_quant"):
            target = nnq.integer_module_for(type(module))
            if target is None:
                left[node.name] = f"no integer module for {type(module).__name__}"
                continue
        if target is None and not elementwise:
            continue  # an op between quantizers (pooling, ReLU, concatenation ...) computes on the grid as it is
        output_node = _output_quantizer_node(model, node)
        output_quantizer = _quantizer(model, output_node)
        if output_node is None or output_quantizer is None:
            left[node.name] = "its output is not quantized (read in float)"
            continue
        if target is not None:
            input_quantizer = _quantizer(model, node.args[0] if node.args else None)
            if input_quantizer is None:
                left[node.name] = "its input is not quantized right before it"
            else:
                plans.append((node, output_node, target.from_observed(module, input_quantizer, output_quantizer)))
        else:
            quantizers = [_quantizer(model, arg) for arg in node.args[:2]]
            if len(quantizers) == 2 and None not in quantizers:
                plans.append(
                    (node, output_node, _ELEMENTWISE[node.target].from_observed(*quantizers, output_quantizer))
                )
            else:
                left[node.name] = "not both of its inputs are quantized"
    if left:
        shown = "; ".join(f"{name}: {reason}" for name, reason in list(left.items())[:8])
        more = f" and {len(left) - 8} more" if len(left) > 8 else ""
        warnings.warn(
            f"convert_fx keeps {len(left)} quantized op(s) with fake quantizers ({shown}{more})", stacklevel=2
        )
    names: dict[str, str] = {}  # old node name -> new name
    reasons: dict[str, str] = {}
    for node, output_node, integer in plans:
        old = node.name
        if node.op == "call_module":
            set_submodule(model, str(node.target), integer)
            lowered.add(str(node.target))
        else:
            name = f"{node.name}_integer"
            model.add_submodule(name, integer)
            with model.graph.inserting_after(node):
                replacement = model.graph.call_module(name, node.args[:2])
            node.replace_all_uses_with(replacement)
            model.graph.erase_node(node)
            node = replacement
            lowered.add(name)
        # The integer module's output is already on the output grid.
        output_node.replace_all_uses_with(node)
        model.graph.erase_node(output_node)
        names[old] = node.name
        reasons[old] = f"lowered to {type(integer).__module__}.{type(integer).__qualname__}"
    _bypass_absorbed_inputs(model, lowered)
    model.graph.eliminate_dead_code()
    model.delete_all_unused_submodules()
    model.graph.lint()
    model.recompile()
    model.meta[PLAN_ATTRIBUTE] = plan.renamed(names, reasons)
    return model


def _merge_batchnorm(model: fx.GraphModule) -> None:
    """Replace every BatchNorm-folding QAT module by its merged layer (the deployed weights, eval mode)."""
    for name, module in list(model.named_modules()):
        if isinstance(module, BnFoldingModule):
            set_submodule(model, name, module.merge_bn().eval())


def _reference_module(backend_config: BackendConfig | None, module: nn.Module) -> Any:
    if backend_config is None:
        return None
    for config in backend_config.configs:
        reference = config.reference_quantized_module
        if isinstance(reference, type) and issubclass(reference, nnq.QuantizedModule):
            root = config.qat_module or config.pattern
            if isinstance(root, type) and isinstance(module, root):
                return reference
    return None
