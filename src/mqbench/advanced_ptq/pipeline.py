"""Calibration data through a prepared model block by block: how the data flows, apart from what algorithms do.

A transformer is a stack of repeated blocks (``model.layers.0``, ``model.layers.1``, ...). An algorithm that
quantizes layer by layer and wants each layer's inputs computed with the layers before it already quantized
(GPTQ's order) would otherwise run the whole model once per layer group: a cost growing with the square of the
depth. :class:`Pipeline` instead cuts the prepared graph into *segments*: what comes before the first block (the
embeddings, the attention mask, the rotary tables), one segment per block, the rest (the final norm and the head)
with the last block. It keeps, for every calibration batch, the values live at the boundary of the segment reached
so far (the residual stream, and the mask and tables the later blocks read), and runs one segment at a time from
them: ``gather`` runs the current segment on every batch with forward hooks on some layers (stopping after a given
node when the rest of the segment is not needed), ``advance`` runs it to its end and keeps the new boundary. The
total cost is a few block forwards per block per batch, linear in depth; the memory is the boundary values of the
calibration set, spilled to memory-mapped files past ``cache_budget_mb``.

A model without a stack of blocks is one segment: ``gather`` then runs the whole model, as before.

The segments are found from the modules' names: the container path followed by an index that most modules share
(``model.layers``, ``encoder.layer``, ``transformer.h``), the blocks in the graph's order one after another. Layers
that must be gathered together (the layers of one site) never straddle a cut: the segments they span are merged.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from mqbench.prepare_by_platform import prepare_by_platform
    >>> class Stack(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
    ...     def forward(self, x):
    ...         for layer in self.layers:
    ...             x = x + layer(x)
    ...         return x
    >>> qmodel = prepare_by_platform(Stack().eval(), "llm_w8a16")
    >>> [segment.name for segment in segments_of(qmodel)]
    ['start', 'layers.0', 'layers.1', 'layers.2']
"""

from __future__ import annotations

import inspect
import itertools
import re
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, fx, nn

from mqbench.advanced_ptq.reconstruction import calibration_batches, call_with
from mqbench.fake_quantize.quantize_base import QuantizeBase
from mqbench.utils.logger import logger

__all__ = [
    "PIPELINE_DEFAULTS",
    "Pipeline",
    "Segment",
    "one_pass",
    "segments_of",
    "token_mask",
    "weights_quantized_only",
]

PIPELINE_DEFAULTS: Mapping[str, Any] = {
    "by_block": True,  # run the calibration data block by block (False: the whole model for every gathering)
    "cache_budget_mb": 2048,  # past this, the cached boundary values go to memory-mapped temporary files
}

_INDEXED = re.compile(r"^(?P<container>.+?)\.(?P<index>\d+)(?:\.|$)")


@dataclass
class Segment:
    """Consecutive nodes of the graph (in graph order); ``name`` is the block's module path, ``start`` for what
    comes before the first block, ``model`` for a model without blocks."""

    index: int
    name: str
    nodes: list[fx.Node]

    def __contains__(self, node: object) -> bool:
        return node in self._members

    def __post_init__(self) -> None:
        self._members = set(self.nodes)


def _module_path(node: fx.Node) -> str | None:
    return str(node.target) if node.op == "call_module" else None


def _stack(nodes: Sequence[fx.Node]) -> tuple[str, dict[int, int]] | None:
    """The container of the repeated blocks and, per block index, the position of its first node; None when no
    container holds two or more blocks appearing one after another in the graph."""
    firsts: dict[str, dict[int, int]] = {}
    lasts: dict[str, dict[int, int]] = {}
    for position, node in enumerate(nodes):
        path = _module_path(node)
        match = _INDEXED.match(path) if path else None
        if match is None:
            continue
        container, index = match["container"], int(match["index"])
        firsts.setdefault(container, {}).setdefault(index, position)
        lasts.setdefault(container, {})[index] = position
    ranked = sorted(firsts, key=lambda c: len(firsts[c]), reverse=True)
    for container in ranked:
        first, last = firsts[container], lasts[container]
        if len(first) < 2:
            return None
        order = sorted(first)
        if all(last[a] < first[b] for a, b in itertools.pairwise(order)):
            return container, {index: first[index] for index in order}
    return None


def segments_of(
    model: fx.GraphModule, together: Sequence[Sequence[fx.Node]] = (), by_block: bool = True
) -> list[Segment]:
    """The segments of ``model``'s graph (without its output node); each group of ``together`` within one."""
    nodes = [node for node in model.graph.nodes if node.op != "output"]
    stack = _stack(nodes) if by_block else None
    if stack is None:
        return [Segment(0, "model", nodes)]
    container, firsts = stack
    cuts = [0, *firsts.values(), len(nodes)]
    names = ["start", *(f"{container}.{index}" for index in firsts)]
    if cuts[1] == 0:  # nothing before the first block
        cuts, names = cuts[1:], names[1:]
    position = {node: i for i, node in enumerate(nodes)}
    for group in together:  # merge the segments a group spans
        spots = [position[node] for node in group if node in position]
        if not spots:
            continue
        low, high = min(spots), max(spots)
        keep = [0] + [i for i in range(1, len(cuts) - 1) if not low < cuts[i] <= high] + [len(cuts) - 1]
        cuts, names = [cuts[i] for i in keep], [names[i] for i in keep[:-1]]
    return [Segment(i, names[i], nodes[cuts[i] : cuts[i + 1]]) for i in range(len(names))]


@contextmanager
def weights_quantized_only(model: nn.Module, weights: bool = True) -> Iterator[None]:
    """Every quantizer's observer off; weight quantizers quantizing (``weights``) or not, activation quantizers as
    they were (their fake quantization kept, their observers off); restored afterwards."""
    saved = {}
    for name, q in model.named_modules():
        if isinstance(q, QuantizeBase):
            saved[name] = (q.observer_enabled.clone(), q.fake_quant_enabled.clone())
            q.disable_observer()
            if name.endswith(".weight_fake_quant"):
                q.enable_fake_quant(weights)
    try:
        yield
    finally:
        for name, q in model.named_modules():
            if name in saved:
                observer, fake_quant = saved[name]
                q.enable_observer(bool(observer[0]))
                q.enable_fake_quant(bool(fake_quant[0]))


def token_mask(batch: Any) -> Tensor | None:
    """The tokens (True) and the padding (False) of a dict batch with a 2-D ``attention_mask``; None otherwise."""
    mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
    if isinstance(mask, Tensor) and mask.dim() == 2 and not bool(mask.all()):
        return mask != 0
    return None


Reduce = Callable[[Any, Tensor], None]


class _Boundary:
    """One batch's values live at a segment boundary (node name -> value), in memory or in a memory-mapped file."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.values: dict[str, Any] | None = values
        self.file: Path | None = None

    def nbytes(self) -> int:
        return sum(_nbytes(v) for v in (self.values or {}).values())

    def spill(self, folder: Path, key: str) -> None:
        self.file = folder / f"{key}.pt"
        torch.save(self.values, self.file)
        self.values = None

    def drop(self) -> None:
        if self.file is not None:
            self.file.unlink(missing_ok=True)
        self.values, self.file = None, None

    def load(self) -> dict[str, Any]:
        if self.values is not None:
            return dict(self.values)
        assert self.file is not None
        return dict(torch.load(self.file, mmap=True, weights_only=True))


def _nbytes(value: Any) -> int:
    if isinstance(value, Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(_nbytes(v) for v in value)
    return 0


class Pipeline:
    """The calibration batches of ``cali_data`` through ``model`` segment by segment (see the module docstring).

    ``together``: groups of nodes gathered in one run (never cut apart). Use it as::

        pipeline = Pipeline(model, cali_data, together=[[layer nodes of a site], ...])
        for segment in pipeline.segments:
            pipeline.gather(segment, layers, reduce, until=node)   # as often as the algorithm needs
            pipeline.advance(segment)                              # its boundary for the next segment

    The graph must not change while a pipeline runs over it (an algorithm that inserts nodes does so after).
    """

    def __init__(
        self,
        model: fx.GraphModule,
        cali_data: Any,
        together: Sequence[Sequence[fx.Node]] = (),
        by_block: bool = True,
        cache_budget_mb: float | None = 2048,
        what: str = "calibration",
    ) -> None:
        if not isinstance(by_block, bool):
            raise ValueError(f"{what} config by_block must be true or false, got {by_block!r}")
        if cache_budget_mb is not None and (
            isinstance(cache_budget_mb, bool) or not isinstance(cache_budget_mb, (int, float)) or cache_budget_mb < 0
        ):
            raise ValueError(
                f"{what} config cache_budget_mb must be a number of MiB >= 0 (or None: never spill), "
                f"got {cache_budget_mb!r}"
            )
        self.model = model
        self.what = what
        self.batches = calibration_batches(cali_data)
        self.segments = segments_of(model, together, by_block)
        self._graph_size = len(model.graph.nodes)
        self._position = {node: i for i, node in enumerate(model.graph.nodes)}
        self._named = {node.name: node for node in model.graph.nodes}
        self._last_use = {
            node: max((self._position[user] for user in node.users), default=-1) for node in model.graph.nodes
        }
        self._interpreter = fx.Interpreter(model, garbage_collect_values=False)
        self._budget = None if cache_budget_mb is None else float(cache_budget_mb) * 2**20
        self._folder: tempfile.TemporaryDirectory[str] | None = None
        self._reached = 0  # the segment whose start the boundaries hold
        self._checkpoints: dict[int, tuple[int, int, dict[fx.Node, Any]]] = {}  # batch: (segment, node index, env)
        self._boundaries = [_Boundary(self._inputs(batch)) for batch in self.batches]
        self._started = time.perf_counter()

    @classmethod
    def for_sites(
        cls, model: fx.GraphModule, cali_data: Any, sites: Sequence[Any], config: Mapping[str, Any], what: str
    ) -> Pipeline:
        """A pipeline for layer sites (objects with ``layers``, each with a ``node``), each site's layers in one
        segment, with ``config``'s ``by_block`` and ``cache_budget_mb``."""
        together = [[layer.node for layer in site.layers] for site in sites]
        return cls(model, cali_data, together, config["by_block"], config["cache_budget_mb"], what)

    def with_sites(self, sites: Sequence[Any]) -> Iterator[tuple[Segment, list[Any], bool]]:
        """Each segment in turn with the sites whose last layer it holds and whether sites remain after it, until
        the segment of the last site."""
        left = list(sites)
        for segment in self.segments:
            here = [site for site in left if site.layers[-1].node in segment]
            left = [site for site in left if site not in here]
            yield segment, here, bool(left)
            if not left:
                return

    def _inputs(self, batch: Any) -> dict[str, Any]:
        placeholders = [node for node in self.model.graph.nodes if node.op == "placeholder"]
        args: tuple[Any, ...] = ()
        kwargs: dict[str, Any] = {}
        if isinstance(batch, Mapping):
            kwargs = dict(batch)
        elif isinstance(batch, (tuple, list)):
            args = tuple(batch)
        else:
            args = (batch,)
        try:
            bound = inspect.signature(self.model.forward).bind(*args, **kwargs)
        except TypeError as error:
            raise ValueError(f"{self.what}: a calibration batch does not fit the model's inputs ({error})") from error
        bound.apply_defaults()
        values = {}
        for node in placeholders:
            name = str(node.target).lstrip("*")
            if name in bound.arguments:
                values[node.name] = bound.arguments[name]
            elif node.args:
                values[node.name] = node.args[0]
            else:
                raise ValueError(f"{self.what}: no calibration value for the model's input {name!r}")
        return values

    def _check_graph(self) -> None:
        if len(self.model.graph.nodes) != self._graph_size:
            raise RuntimeError(f"{self.what}: the graph changed while the calibration pipeline ran over it")

    def _run(
        self, segment: Segment, batch: int, stop: fx.Node | None, checkpoint: fx.Node | None = None
    ) -> dict[str, Any]:
        """Segment ``segment`` on batch ``batch`` from its boundary (or from the state kept at its checkpoint), up to
        ``stop`` (included) or its end; the env. ``checkpoint``: keep the state met just before that node runs."""
        kept = self._checkpoints.get(batch)
        if kept is not None and kept[0] == segment.index:
            start, values = kept[1], dict(kept[2])
        else:
            boundary = self._boundaries[batch].load()
            start, values = 0, {self._named[name]: value for name, value in boundary.items()}
        self._interpreter.env = values
        for index in range(start, len(segment.nodes)):
            node = segment.nodes[index]
            if node is checkpoint:
                self._checkpoints[batch] = (segment.index, index, dict(values))
            if node.op == "placeholder":
                continue
            values[node] = self._interpreter.run_node(node)
            for arg in node.all_input_nodes:  # free what nothing later reads
                if self._last_use.get(arg, -1) <= self._position[node] and arg is not stop:
                    values.pop(arg, None)
            if node is stop:
                break
        self._interpreter.env = {}
        return {node.name: value for node, value in values.items()}

    @torch.no_grad()
    def run(
        self,
        segment: Segment,
        hooks: Mapping[nn.Module, Callable[[nn.Module, tuple[Any, ...]], None]] | None = None,
        switches: AbstractContextManager[Any] | None = None,
        until: fx.Node | None = None,
        advance: bool = False,
        each_batch: Callable[[Any], None] | None = None,
        checkpoint: fx.Node | None = None,
    ) -> None:
        """Run ``segment`` on every batch with forward pre-hooks ``hooks`` (module -> hook) and the quantizers as
        ``switches`` sets them (None: as they are); ``until``: stop after that node; ``advance``: run to the end and
        keep the boundary for the next segment. ``each_batch(batch)`` is called before each batch runs.

        ``checkpoint``: keep each batch's state just before that node runs, and start the later runs of this
        segment there rather than at its start: the caller changes nothing the nodes before it compute (GPTQ
        rounds the layers of the site at the checkpoint and after it). A run starts at the last checkpoint kept."""
        if segment.index != self._reached:
            raise RuntimeError(f"{self.what}: segment {segment.name} is not the one the pipeline reached")
        self._check_graph()
        with ExitStack() as stack:
            for module, hook in (hooks or {}).items():
                stack.callback(module.register_forward_pre_hook(hook).remove)
            if switches is not None:
                stack.enter_context(switches)
            for i, batch in enumerate(self.batches):
                if each_batch is not None:
                    each_batch(batch)
                env = self._run(segment, i, None if advance else until, checkpoint)
                if advance:
                    self._keep(segment, i, env)
                    self._checkpoints.pop(i, None)
        if advance:
            self._advanced(segment)

    def gather(
        self,
        segment: Segment,
        layers: Sequence[Any],
        reduce: Reduce,
        weights: bool = True,
        until: fx.Node | None = None,
        advance: bool = False,
        checkpoint: fx.Node | None = None,
        dtype: torch.dtype = torch.float64,
    ) -> None:
        """Run ``segment`` on every batch with the weights quantized (``weights``) or float (activation quantizers as
        they are, observers off), calling ``reduce(layer, rows)`` with each layer's input as rows ``[tokens,
        in_features]`` (of ``dtype``) (``layers``: objects with ``module``). A batch given as a dict with an
        ``attention_mask`` ``[N, L]`` contributes only its tokens' rows, not its padding's, to layers whose input
        is ``[N, L, in]`` (or ``[N * L, in]``). ``until``, ``advance`` and ``checkpoint``: as for :meth:`run`.
        """
        tokens: list[Tensor | None] = [None]

        def rows_of(x: Tensor) -> Tensor:
            mask = tokens[0]
            if mask is not None and tuple(x.shape[:-1]) in (tuple(mask.shape), (mask.numel(),)):
                return x.reshape(-1, x.shape[-1])[mask.reshape(-1)]
            return x.reshape(-1, x.shape[-1])

        def hook_of(layer: Any) -> Callable[[nn.Module, tuple[Any, ...]], None]:
            return lambda module, args: reduce(layer, rows_of(args[0].detach()).to(dtype))

        hooks = {layer.module: hook_of(layer) for layer in layers}
        switches = weights_quantized_only(self.model, weights)
        tokens_of = lambda batch: tokens.__setitem__(0, token_mask(batch))  # noqa: E731
        self.run(segment, hooks, switches, until, advance, tokens_of, checkpoint)

    @torch.no_grad()
    def run_all(
        self,
        hooks: Mapping[nn.Module, Callable[[nn.Module, tuple[Any, ...]], None]] | None = None,
        switches: AbstractContextManager[Any] | None = None,
    ) -> None:
        """One pass of the calibration data through the segments not run yet, each to its end (``hooks`` and
        ``switches`` as for :meth:`run`)."""
        with switches if switches is not None else nullcontext():
            for segment in self.segments[self._reached :]:
                self.run(segment, hooks, advance=segment is not self.segments[-1])

    @torch.no_grad()
    def advance(self, segment: Segment, weights: bool = True) -> None:
        """Run ``segment`` to its end on every batch (weights quantized or float) and keep the next boundary."""
        self.run(segment, None, weights_quantized_only(self.model, weights), advance=True)

    def _keep(self, segment: Segment, batch: int, env: dict[str, Any]) -> None:
        end = self._position[segment.nodes[-1]]
        live = {name: value for name, value in env.items() if self._last_use[self._named[name]] > end}
        self._boundaries[batch].drop()
        self._boundaries[batch] = _Boundary(live)

    def _advanced(self, segment: Segment) -> None:
        self._reached = segment.index + 1
        held = sum(boundary.nbytes() for boundary in self._boundaries)
        if self._budget is not None and held > self._budget:
            if self._folder is None:
                self._folder = tempfile.TemporaryDirectory(prefix="mqbench-calibration-")
            for i, boundary in enumerate(self._boundaries):
                boundary.spill(Path(self._folder.name), f"{segment.index}-{i}")
        if len(self.segments) > 1:
            logger.info(
                "%s: %s done (%d/%d), %.1f s, %.1f MiB cached%s",
                self.what,
                segment.name,
                segment.index + 1,
                len(self.segments),
                time.perf_counter() - self._started,
                held / 2**20,
                " (spilled to disk)" if self._folder is not None and held > (self._budget or 0) else "",
            )

    def close(self) -> None:
        """Drop the cached boundaries (and their files)."""
        self._checkpoints = {}
        for boundary in self._boundaries:
            boundary.drop()
        self._boundaries = []
        if self._folder is not None:
            self._folder.cleanup()
            self._folder = None

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def one_pass(
    model: nn.Module,
    cali_data: Any,
    hooks: Mapping[nn.Module, Callable[[nn.Module, tuple[Any, ...]], None]] | None = None,
    switches: AbstractContextManager[Any] | None = None,
    what: str = "calibration",
) -> None:
    """The calibration batches through ``model`` once (block by block on a prepared model with a stack of blocks,
    its memory the boundary values; a model that is not a GraphModule is called batch by batch), with forward
    pre-hooks ``hooks`` and the quantizers as ``switches`` sets them (None: as they are)."""
    if isinstance(model, fx.GraphModule):
        with Pipeline(model, cali_data, what=what) as pipeline:
            pipeline.run_all(hooks, switches)
        return
    with ExitStack() as stack, torch.no_grad():
        for module, hook in (hooks or {}).items():
            stack.callback(module.register_forward_pre_hook(hook).remove)
        if switches is not None:
            stack.enter_context(switches)
        for batch in calibration_batches(cali_data):
            call_with(model, batch)
