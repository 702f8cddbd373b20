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

Every decision is kept in the prepared model's quantization plan
(:mod:`mqbench.custom_quantizer.plan`), which :func:`~mqbench.backend_config.quantization_report`
and :func:`~mqbench.backend_config.convert_fx` read.
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
from mqbench.backends.spec import BackendSpec, Placement
from mqbench.custom_quantizer.model_quantizer import activation_variant
from mqbench.custom_quantizer.ops import WEIGHTED_KINDS, node_kind
from mqbench.custom_quantizer.passes import sole_followers
from mqbench.custom_quantizer.placement import ActivationSite, Rules
from mqbench.custom_quantizer.plan import (
    EXCLUDED,
    FrontEnd,
    NodeDecision,
    node_op,
    op_name,
    plan_of,
    prepare_graph,
)
from mqbench.fake_quantize import FixedFakeQuantize, QuantizeBase
from mqbench.fuser_method_mapping import QAT_MODULE_MAPPING
from mqbench.utils.factory import Factory

__all__ = ["NodeDecision", "apply_backend_config", "decisions_of", "fake_quantize_factory"]

_CHAIN_KINDS = frozenset({"bn", "relu"})  # what may follow a layer in a fusion chain (custom_quantizer.ops kinds)


def decisions_of(model: nn.Module) -> dict[str, NodeDecision]:
    """The per-node decisions of a prepared (or converted) model's plan; {} for a model without one."""
    plan = plan_of(model)
    return dict(plan.decisions) if plan is not None else {}


def seen_chain(node: fx.Node, modules: Mapping[str, nn.Module]) -> list[fx.Node]:
    """The node and the BatchNorm / ReLU nodes that follow it alone (what a fusion pattern would have to name)."""
    return sole_followers(node, lambda user, _: node_kind(user, modules) in _CHAIN_KINDS)


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
                fused_names[config.fused_module] = "-".join(op_name(op) for op in ops)
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
        name = op_name(op)
        qconfig = qconfigs.get(node.name)
        config = compiled.patterns.get(op)
        if qconfig is None:
            decisions[node.name] = NodeDecision(node.name, name, False, "no qconfig (QConfigMapping gives None)")
            continue
        if config is None:
            chain = seen_chain(node, modules)
            seen = compiled.fused_names.get(op) if isinstance(op, type) else None  # type: ignore[call-overload]
            seen = seen or "-".join(op_name(node_op(n, modules)) for n in chain)
            reason = f"no pattern of the backend matches {seen}"
            decisions[node.name] = NodeDecision(node.name, name, False, reason, seen)
            for follower in chain[1:]:
                covered.add(follower.name)
                decisions[follower.name] = NodeDecision(
                    follower.name, op_name(node_op(follower, modules)), False, f"part of the unmatched {seen}", seen
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


class _DeclaredFrontEnd(FrontEnd):
    """A BackendConfig's decisions: its fusion patterns, and per node its pattern, dtype configs and qconfig."""

    name = "backend_config"

    def __init__(
        self,
        backend_config: BackendConfig,
        qconfigs: dict[str, QConfig | None],
        left_out: set[str],
        backend: str,
        reduce_range: bool,
    ) -> None:
        self.compiled = compile_backend_config(backend_config)
        self.config_name = backend_config.name
        self.qconfigs = qconfigs
        self.left_out = left_out
        self.backend = backend
        self.reduce_range = reduce_range
        self.decisions: dict[str, NodeDecision] = {}
        self.chosen: dict[str, tuple[BackendPatternConfig, QConfig]] = {}

    def fusion(self) -> tuple[Mapping[Any, Callable[..., nn.Module]], Callable[[fx.Node], bool]]:
        return self.compiled.fusers, lambda node: self.qconfigs.get(node.name) is None

    def qat_mapping(self) -> Mapping[type, Any]:
        mapping: dict[type, Any] = dict(QAT_MODULE_MAPPING)
        for config in self.compiled.patterns.values():
            root = config.pattern
            if isinstance(root, type) and config.qat_module is not None and hasattr(config.qat_module, "from_float"):
                mapping[root] = config.qat_module
        return mapping

    def decide(self, gm: fx.GraphModule) -> None:
        self.decisions, self.chosen = _decide(gm, self.compiled, self.qconfigs)
        for name in self.left_out & self.decisions.keys():
            self.decisions[name] = dataclasses.replace(self.decisions[name], reason=EXCLUDED)

    def weight_quantizer(self, node: fx.Node, module: nn.Module) -> Factory | None:
        chosen = self.chosen.get(node.name)
        if chosen is None or chosen[1].weight is None:
            return None
        return fake_quantize_factory(chosen[1].weight)

    def rules(self, gm: fx.GraphModule) -> Rules:
        inputs_of = {
            name
            for name, (config, qconfig) in self.chosen.items()
            if config.observation_type is not ObservationType.INPUT_OUTPUT_NOT_OBSERVED
            and not _float_input(config, qconfig)
        }
        outputs_of = {
            name
            for name, (config, qconfig) in self.chosen.items()
            if config.observation_type is ObservationType.OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT
            and not _float_output(config, qconfig)
        }
        shared = {name for name, (config, _) in self.chosen.items() if config.shared_input_quantizer}
        return Rules(
            Placement(),
            quantize_input=lambda node: node.name in inputs_of,
            excluded=lambda node: False,
            quantize_output=lambda node: node.name in outputs_of,
            share_inputs=lambda node: node.name in shared,
        )

    def activation_quantizer(self, site: ActivationSite) -> Factory:
        owner = self.chosen.get(site.value.name)
        if owner is None:
            readers = [c for c in (site.consumers or site.value.users) if c.name in self.chosen]
            owner = self.chosen[readers[0].name]
        return activation_variant(fake_quantize_factory(owner[1].activation), site, self.reduce_range, self.backend)

    def declared_decisions(self) -> Mapping[str, NodeDecision]:
        return self.decisions

    def nothing_quantized(self) -> str:
        if any(q is not None for q in self.qconfigs.values()):
            return (
                f"BackendConfig {self.config_name!r} quantizes nothing in this model with these qconfigs: every "
                "op stays float (see quantization_report); get_qconfig_mapping(backend) gives the qconfigs a "
                "built-in backend's dtype configs accept"
            )
        return f"BackendConfig {self.config_name!r}: every qconfig is None, so every op stays float"


def apply_backend_config(
    gm: fx.GraphModule,
    backend_config: BackendConfig,
    qconfig_for: Callable[[str, Op, int | None], QConfig | None],
    is_qat: bool,
    excluded: Callable[[fx.Node], bool] | None = None,
    backend: str | None = None,
    reduce_range: bool = False,
    spec: BackendSpec | None = None,
    widths: Mapping[str, int] | None = None,
) -> fx.GraphModule:
    """Prepare ``gm`` with the decisions ``backend_config`` and the qconfigs make (see the module docstring).

    ``excluded`` nodes (the user's exclusions) stay float, neither fused nor quantized.
    ``backend`` names the registered backend in the plan (none for a BackendConfig used directly); ``reduce_range``
    narrows the signed right operand of products of two activations, as on built-in backends; ``spec`` is the
    registered backend's spec, carried on the plan; ``widths`` the plan's bit widths by quantizer name
    (``quantizer_bits``).
    """
    qconfigs = node_qconfigs(gm, qconfig_for)
    left_out = {node.name for node in gm.graph.nodes if excluded is not None and excluded(node)}
    qconfigs.update(dict.fromkeys(left_out))
    front_end = _DeclaredFrontEnd(backend_config, qconfigs, left_out, backend or "", reduce_range)
    front_end.spec = spec
    gm = prepare_graph(gm, front_end, is_qat, widths)
    _warn_once_per_reason(front_end.decisions)
    return gm


def _float_output(config: BackendPatternConfig, qconfig: QConfig) -> bool:
    dtype_config, _ = first_matching_dtype_config(qconfig, config)
    if dtype_config is None:
        return False
    return bool(dtype_config.is_dynamic) or dtype_config.output_dtype in (torch.float, torch.float16, torch.float64)


def _float_input(config: BackendPatternConfig, qconfig: QConfig) -> bool:
    """A weight-only pattern: the matched dtype config keeps the input float."""
    dtype_config, _ = first_matching_dtype_config(qconfig, config)
    dtype = dtype_config.input_dtype if dtype_config is not None else None
    return isinstance(dtype, torch.dtype) and dtype.is_floating_point
