"""prepare_by_platform: a float model in, the backend's quantization simulation out.

Example:
    >>> import torch
    >>> from mqbench.prepare_by_platform import prepare_by_platform, BackendType
    >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU()).eval()
    >>> qmodel = prepare_by_platform(model, BackendType.Tensorrt)
    >>> [name for name, _ in qmodel.named_children()]
    ['0', 'input_1_post_act_fake_quantizer']
    >>> type(qmodel.get_submodule("0")).__name__, hasattr(qmodel.get_submodule("0"), "weight_fake_quant")
    ('ConvReLU2d', True)
    >>> qmodel.mqbench_backend  # convert_deploy checks it against the backend it deploys for
    'tensorrt'
"""

from __future__ import annotations

import contextlib
import copy
import gc
import types
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import Tensor, fx, nn
from torch.fx.graph_module import _USER_PRESERVED_ATTRIBUTES_KEY

from mqbench.backends.registry import BackendType, ParamsTable, resolve_backend
from mqbench.backends.spec import Placement, check_float_layers
from mqbench.custom_quantizer.model_quantizer import build_model_quantizer
from mqbench.custom_quantizer.ops import normalizes_layers
from mqbench.custom_quantizer.placement import quantized_residual_adds
from mqbench.custom_quantizer.qconfig import QConfigPair, resolve_qconfig
from mqbench.fake_quantize import FakeQuantizeDict
from mqbench.fake_quantize.quantize_base import QuantizeBase
from mqbench.nn.intrinsic.qat import freeze_bn_stats
from mqbench.nn.modules.norms import norm_classes, norm_of
from mqbench.observer import ObserverDict
from mqbench.utils.config import check_keys
from mqbench.utils.export_capture import CAPTURE_ATTRIBUTE, CAPTURES, DYNAMIC_AXES, export_capture, trace_or_export
from mqbench.utils.hf_capture import REPLACED_LAYERS, SOURCE_CONFIG, linear_layers, source_config
from mqbench.utils.tracer import QuantizationTracer, TracingError, check_model, trace, unwrap_model

__all__ = [
    "BACKEND_ATTRIBUTE",
    "CAPTURE_ATTRIBUTE",
    "CONFIG_KEYS",
    "BackendType",
    "CustomedTracer",
    "FakeQuantizeDict",
    "ObserverDict",
    "ParamsTable",
    "get_qconfig_by_platform",
    "prepare_by_platform",
]

CONFIG_KEYS = (
    "extra_qconfig_dict",
    "extra_quantizer_dict",
    "extra_fuse_dict",
    "preserve_attr",
    "concrete_args",
    "leaf_module",
    "reduce_range",
    "quantizer_bits",
    "float_layers",
    "capture",
    "example_inputs",
    "dynamic_shapes",
    "inplace",
)

# The prepared GraphModule's attribute naming the backend it was prepared for (a str, not state).
BACKEND_ATTRIBUTE = "mqbench_backend"


class CustomedTracer(QuantizationTracer):
    """MQBench's tracer name: ``CustomedTracer(customed_leaf_module=[...])`` keeps those module types whole."""

    def __init__(self, *args: Any, customed_leaf_module: Any = None, **kwargs: Any) -> None:
        super().__init__(tuple(customed_leaf_module or ()), *args, **kwargs)


def get_qconfig_by_platform(deploy_backend: Any, extra_qparams: dict[str, Any] | None = None) -> QConfigPair:
    """The weight and activation quantizer factories of ``deploy_backend`` with ``extra_qparams`` applied.

    MQBench's function: ``extra_qparams`` is an ``extra_qconfig_dict`` (``w_qscheme``, ``a_observer``,
    ...). The result's ``weight`` and ``activation`` build the fake quantizers (``qconfig.weight()``).
    """
    return resolve_qconfig(resolve_backend(deploy_backend), extra_qparams)


def _keep_attribute(prepared: fx.GraphModule, name: str, value: Any) -> None:
    """Set a plain attribute on the GraphModule that survives ``copy.deepcopy`` (which rebuilds GraphModules)."""
    setattr(prepared, name, value)
    prepared.meta.setdefault(_USER_PRESERVED_ATTRIBUTES_KEY, {})[name] = value


def _preserve_attributes(model: nn.Module, prepared: fx.GraphModule, preserve: dict[str, list[str]]) -> None:
    for qualname, names in preserve.items():
        source = model.get_submodule(qualname) if qualname else model
        try:
            target: nn.Module = prepared.get_submodule(qualname) if qualname else prepared
        except AttributeError:
            target = prepared
        for name in names:
            if not hasattr(source, name):
                raise ValueError(f"preserve_attr: {qualname or 'the model'} has no attribute {name!r}")
            value = getattr(source, name)
            if isinstance(value, types.MethodType) and value.__self__ is source:
                value = types.MethodType(value.__func__, target)  # rebind methods to the prepared model
            setattr(target, name, value)


def _quantizes_adds(placement: Placement) -> bool:
    return "add" in placement.inputs_of or "add" in placement.outputs_of


def _warn_quantized_residual_stream(prepared: fx.GraphModule, backend: str) -> None:
    """Say so when a decoder's residual stream (RMSNorm: an LLM's) is quantized: its outlier channels, hundreds of
    times the median one, leave nothing of the rest on a per-tensor 8-bit grid."""
    modules = dict(prepared.named_modules())
    if not any((norm := norm_of(module)) is not None and not norm.centered for module in modules.values()):
        return
    adds = quantized_residual_adds(prepared.graph, modules)
    if not adds:
        return
    keeping = sorted(
        name
        for name, spec in ParamsTable.items()
        if spec.activation is not None and (spec.placement.float_residual_adds or not _quantizes_adds(spec.placement))
    )
    warnings.warn(
        f"backend {backend!r} quantizes {len(adds)} residual add(s) of this model's RMSNorm stream "
        f"({', '.join(adds[:3])}{' ...' if len(adds) > 3 else ''}): a language model's residual stream carries "
        "outlier channels that an 8-bit grid of one scale cannot hold (SmolLM2-135M: perplexity in the billions, "
        f"float 10.1). A backend that keeps them float: {', '.join(keeping)}",
        stacklevel=3,
    )


def _warn_fused_attention(prepared: fx.GraphModule, backend: str, quantizes_matmul: bool) -> None:
    """Say so when attention runs as one fused call that a matmul-quantizing backend leaves float."""
    fused = [
        n.name for n in prepared.graph.nodes if n.op == "call_function" and n.target is F.scaled_dot_product_attention
    ]
    if fused and quantizes_matmul:
        warnings.warn(
            f"backend {backend!r} quantizes the inputs of attention's matmuls, but this model computes attention "
            f"with scaled_dot_product_attention ({len(fused)} call(s): {', '.join(fused[:3])}"
            f"{' ...' if len(fused) > 3 else ''}), which stays float; load a Hugging Face model with "
            'attn_implementation="eager" to quantize the attention products',
            stacklevel=3,
        )


_TABLE_LAYERS = (nn.Embedding, nn.EmbeddingBag)  # lookups: their rows pass through, quantized where they are used


def _float_layers(prepared: nn.Module, excluded: Iterable[str] = ()) -> dict[str, int]:
    """The layers whose weights the prepared model keeps in float, each with its weight count: every module
    with a weight of two or more dimensions (see :func:`_layer_weights`) and no weight quantizer (a recurrent
    layer, a layer type the backend does not quantize, the inside of a module kept whole, a weight used
    functionally). Lookup tables (embeddings) and the ``excluded`` names (``exclude_node_name``, module or
    node spelling) are not counted as left out."""
    skip = set(excluded)
    found: dict[str, int] = {}
    for name, module in prepared.named_modules():
        if isinstance(module, QuantizeBase) or hasattr(module, "weight_fake_quant"):
            continue
        count = _layer_weights(module)
        if count and not isinstance(module, _TABLE_LAYERS) and not {name, name.replace(".", "_")} & skip:
            found[name] = count
    return found


def _layer_weights(module: nn.Module) -> int:
    """How many weights of two or more dimensions the module itself holds (``weight``, ``in_proj_weight``,
    ``weight_ih_l0`` ...; not a position embedding or a class token, which are added to activations)."""
    return sum(p.numel() for n, p in module.named_parameters(recurse=False) if "weight" in n and p.dim() >= 2)


def _weight_count(model: nn.Module) -> int:
    return sum(_layer_weights(m) for m in model.modules() if not isinstance(m, QuantizeBase))


def _warn_float_layers(prepared: fx.GraphModule, backend: str, excluded: list[str]) -> None:
    """Name the layers left in float and their share of the model's weights: deployed, they run in float."""
    found = _float_layers(prepared, excluded)
    if not found:
        return
    total = max(_weight_count(prepared), 1)
    largest = sorted(found.items(), key=lambda item: -item[1])
    listed = ", ".join(
        f"{name} ({type(prepared.get_submodule(name)).__name__}, {count / total:.1%})" for name, count in largest[:5]
    )
    warnings.warn(
        f"backend {backend!r} leaves {len(found)} layer(s) in float, {sum(found.values()) / total:.1%} of the "
        f"model's weights: {listed}{' ...' if len(found) > 5 else ''}. Their weights are not quantized and they run "
        "in float where deployed; a layer type the backend quantizes is listed in its BackendSpec (recurrent layers "
        "and modules kept whole with leaf_module are not)",
        stacklevel=3,
    )


_HALF_TYPES = (torch.float16, torch.bfloat16)


def _as_float32(inputs: Any) -> Any:
    """``inputs`` with every float16 / bfloat16 tensor in it as float32 (the prepared model's type)."""
    return pytree.tree_map(lambda t: t.float() if isinstance(t, Tensor) and t.dtype in _HALF_TYPES else t, inputs)


def _half_types(model: nn.Module) -> list[str]:
    """The float16 / bfloat16 types among the model's parameters and buffers."""
    found = {t.dtype for t in (*model.parameters(), *model.buffers()) if t.dtype in _HALF_TYPES}
    return sorted(str(dtype).removeprefix("torch.") for dtype in found)


def _to_float32(model: nn.Module) -> None:
    """Quantize a float16 / bfloat16 model in float32: its parameters and buffers converted, with a warning."""
    halves = _half_types(model)
    if not halves:
        return
    warnings.warn(
        f"the model holds {' and '.join(halves)} parameters; mqbench calibrates, simulates and deploys in float32, "
        "so the prepared model is a float32 copy (float16 / bfloat16 inputs are converted to float32 when it runs; "
        "the deployed model takes float32 inputs). The model you passed is unchanged",
        stacklevel=3,
    )
    model.float()


def _convert_half_inputs(prepared: fx.GraphModule) -> None:
    """Make the prepared model take the float16 / bfloat16 inputs its half-precision original took."""
    graph = prepared.graph
    for placeholder in [n for n in graph.nodes if n.op == "placeholder"]:
        if not placeholder.users:
            continue
        with graph.inserting_after(placeholder):
            converted = graph.call_function(_as_float32, (placeholder,))
        for user in [u for u in placeholder.users if u is not converted]:
            user.replace_input_with(placeholder, converted)
    graph.lint()
    prepared.recompile()


def _capture(
    model: nn.Module, config: dict[str, Any], leaf_modules: tuple[type, ...], custom_tracer: fx.Tracer | None
) -> tuple[fx.GraphModule, str]:
    """The model as a module-level graph, and how it was captured ("fx" or "export")."""
    how = config.get("capture", "auto")
    if how not in CAPTURES:
        raise ValueError(f"prepare_custom_config_dict['capture'] must be one of {CAPTURES}, got {how!r}")
    example = config.get("example_inputs")
    dynamic = config.get("dynamic_shapes")
    if how == "export":
        if example is None:
            raise ValueError(
                "prepare_custom_config_dict['capture'] = 'export' needs prepare_custom_config_dict['example_inputs']: "
                "what the model is called with (a tensor, a tuple of positional arguments or a dict of keyword "
                "arguments)"
            )
        if custom_tracer is not None or config.get("concrete_args"):
            raise ValueError(
                "custom_tracer and concrete_args are torch.fx's; capture = 'export' takes example_inputs (and "
                "dynamic_shapes) instead: drop them or capture with 'fx'"
            )
        return export_capture(model, example, dynamic, leaf_modules), "export"
    if how == "fx" or example is None or custom_tracer is not None:
        try:
            return trace(model, config.get("concrete_args"), leaf_modules, custom_tracer), "fx"
        except TracingError as error:
            if how == "fx" or custom_tracer is not None:
                raise
            raise TracingError(
                f"{error}\nOr capture it with torch.export: pass prepare_custom_config_dict['example_inputs'] "
                "(what the model is called with) and prepare tries torch.export where torch.fx fails."
            ) from error
    return trace_or_export(model, example, config.get("concrete_args"), leaf_modules, dynamic)


@contextlib.contextmanager
def _garbage_collection_paused() -> Iterator[None]:
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def prepare_by_platform(
    model: nn.Module,
    deploy_backend: Any,
    prepare_custom_config_dict: dict[str, Any] | None = None,
    custom_tracer: fx.Tracer | None = None,
    is_qat: bool | None = None,
    freeze_bn: bool = False,
) -> fx.GraphModule:
    """Trace ``model`` and insert the fake quantizers ``deploy_backend`` calls for.

    Args:
        model: the float model (DataParallel / DistributedDataParallel wrappers are removed).
        deploy_backend: a :class:`BackendType`, a registered backend name, or a ``BackendSpec``.
        prepare_custom_config_dict: ``extra_qconfig_dict``, ``extra_quantizer_dict``,
            ``extra_fuse_dict``, ``preserve_attr``, ``concrete_args``, ``leaf_module``,
            ``reduce_range`` (see ``CONFIG_KEYS``). A partial ``w_qscheme`` / ``a_qscheme``
            changes the keys it names in the backend's scheme. ``reduce_range=True`` makes the
            backend's 8-bit weight grid 7-bit of the same signedness ([-64, 63], or [0, 127] for
            unsigned weights), for CPU int8 kernels without VNNI whose 16-bit pair sums of
            u8 x s8 products saturate otherwise.
            ``capture``: ``"fx"``, ``"export"`` or ``"auto"`` (the default: torch.fx, and
            where it cannot trace the model and ``example_inputs`` is given, ``torch.export``;
            the prepared model's ``mqbench_capture`` says which). ``example_inputs``: what the
            model is called with while capturing with ``torch.export`` (a tensor, a tuple of
            positional arguments or a dict of keyword arguments); ``dynamic_shapes`` as
            ``torch.export.export`` takes them (default: batch, and the sequence of integer
            inputs, ``Dim.AUTO``). ``float_layers``: the roles of layers left float, ``"lm_head"`` (a
            language model's projection onto its vocabulary) and ``"embedding"``, instead of the backend's
            ``BackendSpec.float_layers`` (the LLM backends keep both float; ``[]`` quantizes them).
            ``inplace``: True builds the prepared model from ``model``'s own modules and weights rather than
            copies, so that one copy of the weights is held (a model near the memory's size); ``model`` is then
            changed with it (its weights as algorithms round them): use the prepared model, not ``model``.
        custom_tracer: a ``torch.fx.Tracer`` instance (e.g. transformers' ``HFTracer()``).
        is_qat: fold BatchNorm while training (True) or into the weights now (False);
            None follows ``model.training``.
        freeze_bn: QAT with frozen BatchNorm statistics.

    Returns:
        A ``torch.fx.GraphModule``: weight quantizers are ``<module>.weight_fake_quant``,
        activation quantizers ``<node>_post_act_fake_quantizer``; its ``mqbench_backend``
        attribute names the backend. The model is not changed (unless ``inplace``).

    Raises:
        TypeError: ``model`` is not an eager ``nn.Module`` (a TorchScript module, a
            ``torch.compile`` wrapper or a ``torch.export`` program): pass the original module.
        ValueError: an unknown backend or configuration key, or a configuration that cannot apply.
    """
    check_model(unwrap_model(model))
    spec = resolve_backend(deploy_backend)
    config = dict(prepare_custom_config_dict or {})
    check_keys(config, CONFIG_KEYS, "prepare_custom_config_dict")
    reduce_range = config.get("reduce_range", False)
    if not isinstance(reduce_range, bool):
        raise ValueError(f"prepare_custom_config_dict['reduce_range'] must be True or False, got {reduce_range!r}")
    qconfig = resolve_qconfig(spec, config.get("extra_qconfig_dict"), reduce_range)
    model = unwrap_model(model)
    training = model.training
    source = model
    inplace = config.get("inplace", False)
    if not isinstance(inplace, bool):
        raise ValueError(f"prepare_custom_config_dict['inplace'] must be True or False, got {inplace!r}")
    if not inplace:  # the prepared model owns its modules; the user's model is left as it was
        model = copy.deepcopy(model)
    replaced = linear_layers(model)  # transformers' Conv1D (GPT-2) is prepared as the nn.Linear it is
    half = bool(_half_types(model))
    _to_float32(model)
    if half and "example_inputs" in config:  # captured as it runs once prepared: on float32 inputs
        config["example_inputs"] = _as_float32(config["example_inputs"])
    if is_qat is None:
        is_qat = training
    # a model family's own norm classes (LlamaRMSNorm, ...) stay whole, as nn.LayerNorm does: one node for the
    # rotation to fold into, not a tangle of pow / mean / rsqrt
    leaf_modules = tuple(config.get("leaf_module", ())) + norm_classes(model)
    quantizer = build_model_quantizer(spec, config.get("extra_quantizer_dict"), config.get("extra_fuse_dict"))
    if "quantizer_bits" in config:  # part of the plan: each named quantizer is built at its width
        quantizer.quantizer_bits = config["quantizer_bits"]
    if "float_layers" in config:  # the roles left float, instead of the backend's (BackendSpec.float_layers)
        quantizer.float_layers = check_float_layers(config["float_layers"], "prepare_custom_config_dict")
    with _garbage_collection_paused():  # graph passes allocate many small objects; collect once afterwards
        graph_module, captured_by = _capture(model, config, leaf_modules, custom_tracer)
        if spec.transformer_activation is not None and normalizes_layers(graph_module):
            transformer = replace(spec, activation=spec.transformer_activation)
            own = qconfig.activation  # a product's inputs (queries, keys) keep the backend's grid
            qconfig = resolve_qconfig(transformer, config.get("extra_qconfig_dict"), reduce_range)
            qconfig = replace(qconfig, product_activation=own)
        prepared = quantizer.prepare(graph_module, qconfig, bool(is_qat))
    if half:
        _convert_half_inputs(prepared)
    _warn_fused_attention(prepared, spec.name, "matmul" in spec.placement.inputs_of)
    _warn_quantized_residual_stream(prepared, spec.name)
    excluded = (config.get("extra_quantizer_dict") or {}).get("exclude_node_name", [])
    _warn_float_layers(prepared, spec.name, list(excluded))
    if freeze_bn:
        prepared.apply(freeze_bn_stats)
    _preserve_attributes(source, prepared, config.get("preserve_attr", {}))
    _keep_attribute(prepared, BACKEND_ATTRIBUTE, spec.name)
    _keep_attribute(prepared, CAPTURE_ATTRIBUTE, captured_by)
    configuration = source_config(source)
    if configuration is not None:  # a Hugging Face model: its checkpoint formats are written with it
        configuration[REPLACED_LAYERS] = replaced  # layers its checkpoints store in another form than nn.Linear
        _keep_attribute(prepared, SOURCE_CONFIG, configuration)
    if graph_module.meta.get(DYNAMIC_AXES):  # convert_deploy writes them as the ONNX file's dynamic axes
        _keep_attribute(prepared, DYNAMIC_AXES, graph_module.meta[DYNAMIC_AXES])
    return prepared.train(training)
