"""Annotate first: every prepare decision written on the captured graph's nodes before a pass runs.

A front end (a built-in backend's placement rules, or a BackendConfig) answers, per node of the
captured graph, the questions prepare has, and the answers are stored in ``node.meta`` as an
:class:`Annotation`:

* ``fusion``: on the first node of a chain the backend runs as one op (Conv-BN-ReLU ...): the
  chain and the function that builds its module. Written on the captured graph, read by the
  fusion pass.
* ``weight``: the weight quantizer of a layer (its factory and, where the plan sets one, its
  width), read by the swap to QAT modules.
* ``output`` / ``inputs``: the activation quantizer a value is read through, for every reader
  (``output``, on the value's node) or for this reader (``inputs``, on the reader, by value
  name). One :class:`SharedQuantizer` object is one quantizer module: values the backend
  requires to share a quantizer (the inputs of a concatenation, one tensor under two names)
  hold the same object. Read by quantizer insertion.
* ``decision``: quantized or float, and how or why (what the report and ``convert_fx`` read).

The quantization decisions are made on the graph after fusion, since a fused chain is one op
to the backend; fusion itself is decided on the captured graph first. No pass decides
anything: fusion, the swap and insertion carry out what the annotations say, and the
:class:`~mqbench.custom_quantizer.plan.QuantizationPlan` stored on the prepared model is read
from them.

Example:
    >>> import torch
    >>> from mqbench.prepare_by_platform import prepare_by_platform
    >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Flatten()).eval()
    >>> qmodel = prepare_by_platform(model, "tensorrt")
    >>> conv = next(n for n in qmodel.graph.nodes if n.name == "_0")
    >>> annotation = annotation_of(conv)
    >>> annotation.fusion.chain, annotation.decision.quantized, annotation.weight is not None
    ('Conv2d-ReLU', True, True)
    >>> [(name, q.module) for name, q in annotation.inputs.items()]
    [('input_1', 'input_1_post_act_fake_quantizer')]
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import fx, nn

from mqbench.custom_quantizer.bits import quant_range_for_bits
from mqbench.functional import bits_of_range
from mqbench.utils.factory import Factory

__all__ = [
    "ANNOTATION",
    "Annotation",
    "Fusion",
    "NodeDecision",
    "SharedQuantizer",
    "activation_quantizer_name",
    "annotated_inputs",
    "annotation_of",
    "check_widths",
    "graph_annotations",
    "weight_quantizer_name",
]

ANNOTATION = "mqbench_annotation"  # a key of fx.Node.meta


@dataclass(frozen=True)
class NodeDecision:
    """What was decided for one op node: quantized or float, and how or why."""

    node: str
    op: str
    quantized: bool
    reason: str  # for a quantized node: how (its pattern, or what is quantized); for a float one: why
    pattern: str = ""  # the backend pattern or op kind that matched, or the chain that was seen


@dataclass
class Fusion:
    """A chain of ops the backend runs as one: its nodes (first to last), the name of the chain, its fuser.

    On the captured graph the chain is named by its first node, which holds the annotations of the fused op (its
    weight quantizer, its output's quantizer, its decision); its readers name it so in their ``inputs``. ``module``
    is the fused module once built (the fuser is called once per chain) until :func:`fuse_patterns` puts it in
    place."""

    nodes: tuple[str, ...]
    chain: str  # "Conv2d-BatchNorm2d-ReLU"
    fuser: Callable[..., nn.Module] = field(repr=False, compare=False)
    module: nn.Module | None = field(default=None, repr=False, compare=False)


@dataclass(eq=False)
class SharedQuantizer:
    """One activation quantizer module and the values it quantizes.

    Sharing is identity: every value and reader annotated with one object reads one module. ``readers`` is
    None where the values are quantized for every reader.
    """

    values: list[str]
    factory: Factory = field(repr=False)
    readers: set[str] | None = field(default_factory=set)
    reasons: tuple[str, ...] = ()
    bits: int | None = None  # a width the plan sets (quantizer_bits); None: the factory's own
    module: str = ""  # the module holding it, once inserted

    @property
    def name(self) -> str:
        """The module name it gets: ``<first value>_post_act_fake_quantizer``."""
        return activation_quantizer_name(self.values[0])


@dataclass
class Annotation:
    """What prepare does at one node (see the module docstring)."""

    fusion: Fusion | None = None
    weight: Factory | None = None
    weight_bits: int | None = None
    inputs: dict[str, SharedQuantizer] = field(default_factory=dict)  # value name -> the quantizer read through
    output: SharedQuantizer | None = None
    decision: NodeDecision | None = None


def annotation_of(node: fx.Node) -> Annotation:
    """The node's annotation, created empty where there is none yet."""
    annotation = node.meta.get(ANNOTATION)
    if not isinstance(annotation, Annotation):
        annotation = node.meta[ANNOTATION] = Annotation()
    return annotation


def annotated_inputs(node: fx.Node) -> Mapping[str, SharedQuantizer]:
    """The quantizers ``node`` reads its inputs through, by value name (none for a node without annotation)."""
    annotation = node.meta.get(ANNOTATION)
    return annotation.inputs if isinstance(annotation, Annotation) else {}


def graph_annotations(graph: fx.Graph) -> dict[str, Annotation]:
    """The annotated nodes of a graph, by name."""
    found = {node.name: node.meta.get(ANNOTATION) for node in graph.nodes}
    return {name: annotation for name, annotation in found.items() if isinstance(annotation, Annotation)}


def weight_quantizer_name(layer: str) -> str:
    return f"{layer}.weight_fake_quant"


def activation_quantizer_name(value: str) -> str:
    return f"{value}_post_act_fake_quantizer"


def _own_width(factory: Factory) -> int:
    low, high = factory.kwargs.get("quant_min"), factory.kwargs.get("quant_max")
    if low is None or high is None:
        quantizer = factory()
        low, high = quantizer.quant_min, quantizer.quant_max
    return bits_of_range(int(low), int(high))


def check_widths(graph: fx.Graph, widths: Mapping[str, Any], spec: Any) -> None:
    """Write ``quantizer_bits`` (quantizer name -> width) onto the annotations of the quantizers they name.

    The names are those the quantizers will have (``<layer>.weight_fake_quant``,
    ``<value>_post_act_fake_quantizer``); an unknown name or a width the backend cannot deploy is an error
    naming it.
    """
    if not isinstance(widths, Mapping):
        raise ValueError(f"quantizer_bits maps quantizer names to bit widths, got {type(widths).__name__}")
    if not widths:
        return
    planned: dict[str, tuple[Factory, Callable[[int], None]]] = {}
    for node in graph.nodes:
        annotation = node.meta.get(ANNOTATION)
        if not isinstance(annotation, Annotation):
            continue
        if annotation.weight is not None:
            target = annotation

            def set_weight(bits: int, target: Annotation = target) -> None:
                target.weight_bits = bits

            planned.setdefault(weight_quantizer_name(str(node.target)), (annotation.weight, set_weight))
        for quantizer in [annotation.output, *annotation.inputs.values()]:
            if quantizer is not None:

                def set_activation(bits: int, quantizer: SharedQuantizer = quantizer) -> None:
                    quantizer.bits = bits

                planned.setdefault(quantizer.name, (quantizer.factory, set_activation))
    allowed = tuple(getattr(spec, "mixed_precision_bits", ()))
    backend = getattr(spec, "name", "this backend")
    for name, bits in widths.items():
        if name not in planned:
            close = difflib.get_close_matches(str(name), list(planned), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else f"; the model has {len(planned)} quantizers"
            raise ValueError(f"quantizer_bits names {name!r}, which is not a quantizer of the prepared model{hint}")
        factory, write = planned[name]
        quant_range_for_bits(-1, 1, bits)  # the width itself: an integer from 2 to 16
        current = _own_width(factory)
        if bits == current:
            continue
        if bits not in allowed:
            choices = ", ".join(map(str, allowed)) if allowed else f"only its own ({current}-bit)"
            raise ValueError(
                f"backend {backend!r} deploys {name} at {choices} bits, not {bits}: its format has one width per "
                "quantizer kind. Mixed precision needs a backend that lists mixed_precision_bits (academic, "
                "academic_nlp)"
            )
        write(bits)
