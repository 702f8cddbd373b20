"""A BackendConfig on mqbench's quantization engine: per-node decisions, then the engine's passes.

The same passes as every built-in backend (:mod:`mqbench.custom_quantizer.passes`: fuse,
swap in QAT modules with weight quantizers, plan and insert activation quantizers) run here;
what differs is only where the decisions come from. A built-in backend decides by op kind
(its :class:`~mqbench.backends.Placement`); a declared backend decides per node, from the
patterns its :class:`BackendConfig` lists and the dtype constraints of each qconfig:

* fusion patterns (configs without dtype configs) fuse chains whose ops all have a qconfig;
* a node is quantized when a quantization pattern matches its op (its module class after
  fusion, its function or its method name) and its qconfig meets one of the pattern's dtype
  configs; otherwise it stays float and its :class:`NodeDecision` says why (no qconfig, no
  pattern for the chain that was seen, or the names of the broken constraints);
* a quantized node's observation type says where quantizers go: its tensor inputs, and its
  output unless it shares its input's quantizer or is not observed.

Every decision is kept on the prepared model (``decisions_of``) for
:func:`~mqbench.backend_config.quantization_report`.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from mqbench.backend_config.backend_config import BackendConfig, BackendPatternConfig, ObservationType
from mqbench.backend_config.constraints import first_matching_dtype_config
from mqbench.backend_config.dtype_config import DTypeKind
from mqbench.backend_config.pattern import Op, pattern_ops
from mqbench.backend_config.qconfig import QConfig
from mqbench.backends.spec import Placement
from mqbench.custom_quantizer.ops import WEIGHTED_KINDS, node_kind
from mqbench.custom_quantizer.passes import fuse_patterns, insert_activation_quantizers, swap_modules
from mqbench.custom_quantizer.placement import ActivationSite, Rules, plan_activation_quantizers
from mqbench.fake_quantize import FixedFakeQuantize, QuantizeBase
from mqbench.fuser_method_mapping import QAT_MODULE_MAPPING
from mqbench.utils.factory import Factory

__all__ = ["DECISIONS_ATTRIBUTE", "NodeDecision", "apply_backend_config", "decisions_of", "fake_quantize_factory"]

DECISIONS_ATTRIBUTE = "mqbench_quantization_decisions"  # a key of GraphModule.meta (kept by deepcopy)

_CHAIN_KINDS = frozenset({"bn", "relu"})  # what may follow a layer in a fusion chain (custom_quantizer.ops kinds)


@dataclass(frozen=True)
class NodeDecision:
    """What the backend decided for one node of the traced model."""

    node: str
    op: str
    quantized: bool
    reason: str  # for a quantized node: how (its pattern and observation); for a float one: why
    pattern: str = ""  # the backend pattern that matched, or the chain that was seen


def decisions_of(model: nn.Module) -> dict[str, NodeDecision]:
    """The decisions recorded on a model prepared (or converted) from a BackendConfig; {} otherwise."""
    meta = getattr(model, "meta", None)
    return dict(meta.get(DECISIONS_ATTRIBUTE, {})) if isinstance(meta, dict) else {}


def node_op(node: fx.Node, modules: Mapping[str, nn.Module]) -> Op | None:
    """The op a pattern names for this node: module class, function, or method name."""
    if node.op == "call_module":
        return type(modules[str(node.target)])
    if node.op in ("call_function", "call_method"):
        return node.target  # type: ignore[return-value]
    return None


def _short(op: Op | None) -> str:
    if op is None:
        return "?"
    return op if isinstance(op, str) else getattr(op, "__name__", repr(op))


def _follows(node: fx.Node, modules: Mapping[str, nn.Module]) -> bool:
    return node_kind(node, modules) in _CHAIN_KINDS


def seen_chain(node: fx.Node, modules: Mapping[str, nn.Module]) -> list[fx.Node]:
    """The node and the BatchNorm / ReLU nodes that follow it alone (what a fusion pattern would have to name)."""
    chain = [node]
    while len(chain[-1].users) == 1:
        (user,) = chain[-1].users
        if not _follows(user, modules) or not user.args or user.args[0] is not chain[-1]:
            break
        chain.append(user)
    return chain


def fake_quantize_factory(factory: Any) -> Factory:
    """A fake-quantizer factory from a qconfig entry: an observer factory is wrapped in FixedFakeQuantize."""
    cls = factory.cls if isinstance(factory, Factory) else factory
    if isinstance(cls, type) and issubclass(cls, QuantizeBase):
        return factory if isinstance(factory, Factory) else Factory(cls, {})
    kwargs = dict(factory.kwargs) if isinstance(factory, Factory) else {}
    return FixedFakeQuantize.with_args(observer=cls, **kwargs)


@dataclass(frozen=True)
class _Compiled:
    fusers: dict[tuple[Op, ...], Callable[..., nn.Module]]
    patterns: dict[Op, BackendPatternConfig]
    fused_names: dict[type, str]  # fused module class -> the chain it stands for


def _fuser(config: BackendPatternConfig) -> Callable[..., nn.Module]:
    if config.fuser_method is not None:
        return config.fuser_method
    fused = config.fused_module
    if fused is None:
        raise ValueError(f"fusion pattern {config.pattern!r} has neither a fuser method nor a fused module")
    return lambda is_qat, *modules: fused(*modules)


def compile_backend_config(backend_config: BackendConfig) -> _Compiled:
    fusers: dict[tuple[Op, ...], Callable[..., nn.Module]] = {}
    patterns: dict[Op, BackendPatternConfig] = {}
    fused_names: dict[type, str] = {}
    for config in backend_config.configs:
        if config.pattern is None:
            raise ValueError(f"{backend_config.name}: a BackendPatternConfig has no pattern (set_pattern)")
        ops = pattern_ops(config.pattern)
        if len(ops) > 1:
            if config.dtype_configs:
                raise ValueError(
                    f"{backend_config.name}: pattern {config.pattern!r} quantizes a chain without fusing it; declare "
                    "a fusion pattern with set_fused_module and quantize the fused module class"
                )
            fusers[ops] = _fuser(config)
            if config.fused_module is not None:
                fused_names[config.fused_module] = "-".join(_short(op) for op in ops)
        elif config.dtype_configs:
            patterns[ops[0]] = config
    return _Compiled(fusers, patterns, fused_names)


def _enclosing_module(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    return str(next(reversed(stack))) if stack else ""


def node_qconfigs(
    gm: fx.GraphModule, qconfig_for: Callable[[str, Op, int | None], QConfig | None]
) -> dict[str, QConfig | None]:
    """The qconfig of every op node, by node name (resolved on the traced, unfused model)."""
    modules = dict(gm.named_modules())
    counts: dict[tuple[str, Any], int] = {}
    result: dict[str, QConfig | None] = {}
    for node in gm.graph.nodes:
        op = node_op(node, modules)
        if op is None:
            continue
        if node.op == "call_module":
            result[node.name] = qconfig_for(str(node.target), op, None)
        else:
            scope = _enclosing_module(node)
            index = counts.get((scope, op), 0)
            counts[(scope, op)] = index + 1
            result[node.name] = qconfig_for(scope, op, index)
    return result


def _decide(
    gm: fx.GraphModule, compiled: _Compiled, qconfigs: Mapping[str, QConfig | None]
) -> tuple[dict[str, NodeDecision], dict[str, tuple[BackendPatternConfig, QConfig]]]:
    modules = dict(gm.named_modules())
    decisions: dict[str, NodeDecision] = {}
    quantized: dict[str, tuple[BackendPatternConfig, QConfig]] = {}
    covered: set[str] = set()
    for node in gm.graph.nodes:
        op = node_op(node, modules)
        if op is None or isinstance(modules.get(str(node.target)), QuantizeBase) or node.name in covered:
            continue
        name = _short(op)
        qconfig = qconfigs.get(node.name)
        config = compiled.patterns.get(op)
        if qconfig is None:
            decisions[node.name] = NodeDecision(node.name, name, False, "no qconfig (QConfigMapping gives None)")
            continue
        if config is None:
            chain = seen_chain(node, modules)
            seen = compiled.fused_names.get(op) if isinstance(op, type) else None  # type: ignore[call-overload]
            seen = seen or "-".join(_short(node_op(n, modules)) for n in chain)
            reason = f"no pattern of the backend matches {seen}"
            decisions[node.name] = NodeDecision(node.name, name, False, reason, seen)
            for follower in chain[1:]:
                covered.add(follower.name)
                decisions[follower.name] = NodeDecision(
                    follower.name, _short(node_op(follower, modules)), False, f"part of the unmatched {seen}", seen
                )
            continue
        weighted = node_kind(node, modules) in WEIGHTED_KINDS
        kinds: tuple[DTypeKind, ...] = ("input", "output", "weight") if weighted else ("input", "output")
        dtype_config, reasons = first_matching_dtype_config(qconfig, config, kinds)
        if dtype_config is None:
            broken = "; ".join(reasons) or "no dtype config"
            decisions[node.name] = NodeDecision(node.name, name, False, f"the qconfig breaks {broken}", name)
            continue
        observation = config.observation_type
        decisions[node.name] = NodeDecision(node.name, name, True, f"pattern {name}, {observation.name}", name)
        quantized[node.name] = (config, qconfig)
    return decisions, quantized


def _warn_once_per_reason(decisions: Mapping[str, NodeDecision]) -> None:
    reasons: dict[str, list[str]] = {}
    for decision in decisions.values():
        if not decision.quantized and not decision.reason.startswith(("part of", "no qconfig", "excluded")):
            reasons.setdefault(decision.reason, []).append(decision.node)
    for reason, nodes in reasons.items():
        shown = ", ".join(nodes[:5]) + (f" and {len(nodes) - 5} more" if len(nodes) > 5 else "")
        warnings.warn(f"left in float: {shown}: {reason}", stacklevel=3)


_EXCLUDED = "excluded by prepare_custom_config_dict['extra_quantizer_dict']"


def apply_backend_config(
    gm: fx.GraphModule,
    backend_config: BackendConfig,
    qconfig_for: Callable[[str, Op, int | None], QConfig | None],
    is_qat: bool,
    excluded: Callable[[fx.Node], bool] | None = None,
) -> fx.GraphModule:
    """Run the engine's passes on ``gm`` with the decisions ``backend_config`` and the qconfigs make.

    ``excluded`` nodes (the user's exclusions) stay float, neither fused nor quantized.
    """
    compiled = compile_backend_config(backend_config)
    qconfigs = node_qconfigs(gm, qconfig_for)
    left_out = {node.name for node in gm.graph.nodes if excluded is not None and excluded(node)}
    qconfigs.update(dict.fromkeys(left_out))
    gm = fuse_patterns(gm, compiled.fusers, is_qat, skip=lambda node: qconfigs.get(node.name) is None)
    decisions, quantized = _decide(gm, compiled, qconfigs)
    for name in left_out & decisions.keys():
        decisions[name] = dataclasses.replace(decisions[name], reason=_EXCLUDED)
    modules = dict(gm.named_modules())

    def weight_factory(node: fx.Node, module: nn.Module) -> Factory | None:
        chosen = quantized.get(node.name)
        if chosen is None or chosen[1].weight is None:
            return None
        return fake_quantize_factory(chosen[1].weight)

    qat_mapping: dict[type, Any] = dict(QAT_MODULE_MAPPING)
    for config in compiled.patterns.values():
        root = config.pattern
        if isinstance(root, type) and config.qat_module is not None and hasattr(config.qat_module, "from_float"):
            qat_mapping[root] = config.qat_module
    gm = swap_modules(gm, qat_mapping, weight_factory)
    modules = dict(gm.named_modules())
    inputs_of = {
        name
        for name in quantized
        if quantized[name][0].observation_type is not ObservationType.INPUT_OUTPUT_NOT_OBSERVED
    }
    outputs_of = {
        name
        for name, (config, _) in quantized.items()
        if config.observation_type is ObservationType.OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT
        and not _float_output(config, quantized[name][1])
    }
    rules = Rules(
        Placement(),
        quantize_input=lambda node: node.name in inputs_of,
        excluded=lambda node: False,
        quantize_output=lambda node: node.name in outputs_of,
    )
    sites = plan_activation_quantizers(gm.graph, modules, rules)

    def activation_factory(site: ActivationSite) -> Factory:
        owner = quantized.get(site.value.name)
        if owner is None:
            readers = [c for c in (site.consumers or site.value.users) if c.name in quantized]
            owner = quantized[readers[0].name]
        return fake_quantize_factory(owner[1].activation)

    gm = insert_activation_quantizers(gm, sites, activation_factory)
    gm.meta[DECISIONS_ATTRIBUTE] = decisions
    if not quantized and any(q is not None for q in qconfigs.values()):
        warnings.warn(
            f"BackendConfig {backend_config.name!r} quantizes nothing in this model with these qconfigs: every "
            "op stays float (see quantization_report); get_qconfig_mapping(backend) gives the qconfigs a "
            "built-in backend's dtype configs accept",
            stacklevel=3,
        )
    _warn_once_per_reason(decisions)
    return gm


def _float_output(config: BackendPatternConfig, qconfig: QConfig) -> bool:
    dtype_config, _ = first_matching_dtype_config(qconfig, config)
    if dtype_config is None:
        return False
    return bool(dtype_config.is_dynamic) or dtype_config.output_dtype in (torch.float, torch.float16, torch.float64)
