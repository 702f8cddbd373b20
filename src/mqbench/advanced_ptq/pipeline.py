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

``device``: each segment's parameters and buffers are moved to that device while the segment is gathered,
quantized and run, and moved back after it (the model ends where it was); the cached boundaries stay on the host.
A model kept on the host thus runs block by block on a GPU holding one block and one batch at a time. Tensors are
moved in place (``param.data``), so tied weights stay one tensor; constants the capture wrote into the graph
(``torch.arange(..., device="cpu")`` in the mask code) are created on the segment's device.

A model whose weights are on disk (:func:`~mqbench.advanced_ptq.attach_weights`) has each segment's weights
loaded when the segment is entered (onto ``device`` if set; :meth:`Pipeline.with_sites` calibrates their weight
quantizers there) and, once the segment is left, written to the offload folder and memory-mapped from it (and the
heap's freed pages given back to the system): one block's weights are in memory at a time.

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

from mqbench.advanced_ptq.boundary import Boundary
from mqbench.advanced_ptq.reconstruction import calibration_batches, call_with
from mqbench.fake_quantize.quantize_base import QuantizeBase
from mqbench.utils.lazy_weights import pending_weights, store_of
from mqbench.utils.logger import logger
from mqbench.utils.memory import release_freed_memory
from mqbench.utils.state import calibrate_weights

__all__ = [
    "PIPELINE_DEFAULTS",
    "Pipeline",
    "Segment",
    "check_keys",
    "one_pass",
    "run_device",
    "segments_of",
    "token_mask",
    "weights_quantized_only",
]

PIPELINE_DEFAULTS: Mapping[str, Any] = {
    "by_block": True,  # run the calibration data block by block (False: the whole model for every gathering)
    "cache_budget_mb": 2048,  # past this, the cached boundary values go to memory-mapped temporary files
    "device": None,  # where each block runs ("cuda", "cuda:1", ...; None: where the model is), then moved back
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


def _rows(x: Tensor, mask: Tensor | None) -> Tensor:
    """``x`` ``[..., features]`` as rows; with a batch's token mask ``[N, L]``, an ``[N, L, features]`` (or ``[N * L,
    features]``) value keeps only the rows of its tokens, not of its padding."""
    if mask is not None and tuple(x.shape[:-1]) in (tuple(mask.shape), (mask.numel(),)):
        return x.reshape(-1, x.shape[-1])[mask.reshape(-1)]
    return x.reshape(-1, x.shape[-1])


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
        device: str | torch.device | None = None,
    ) -> None:
        check_keys({"by_block": by_block, "cache_budget_mb": cache_budget_mb, "device": device}, what)
        self.model = model
        self.what = what
        self.device = run_device(device, what)
        self.store = store_of(model)  # weights on disk, loaded segment by segment
        on_meta = [name for name, tensor in model.named_parameters() if tensor.is_meta]
        if on_meta:
            raise ValueError(
                f"{what}: the model's parameters are on the meta device ({', '.join(on_meta[:3])}, ...); give them "
                "their weights with mqbench.advanced_ptq.attach_weights(model, checkpoint) first"
            )
        self._on: Segment | None = None  # the segment whose tensors are on self.device (and loaded)
        self.batches = calibration_batches(cali_data)
        self.segments = segments_of(model, together, by_block)
        self._graph_size = len(model.graph.nodes)
        self._position = {node: i for i, node in enumerate(model.graph.nodes)}
        self._named = {node.name: node for node in model.graph.nodes}
        self._last_use = {
            node: max((self._position[user] for user in node.users), default=-1) for node in model.graph.nodes
        }
        # the attributes (norm weights, tables) a segment reads that the graph gets before it: fetched afresh
        # where the segment starts, never kept in the boundaries (they are the model's tensors, not values)
        self._attributes = {segment.index: _attributes_read(segment) for segment in self.segments}
        self._interpreter = (
            fx.Interpreter(model, garbage_collect_values=False)
            if self.device is None
            else _OnDevice(model, self.device)
        )
        self._budget = None if cache_budget_mb is None else float(cache_budget_mb) * 2**20
        self._folder: tempfile.TemporaryDirectory[str] | None = None
        self._reached = 0  # the segment whose start the boundaries hold
        self._checkpoints: dict[int, tuple[int, int, dict[fx.Node, Any]]] = {}  # batch: (segment, node index, env)
        self._boundaries = [Boundary(self._inputs(batch)) for batch in self.batches]
        self._started = time.perf_counter()

    @classmethod
    def for_sites(
        cls, model: fx.GraphModule, cali_data: Any, sites: Sequence[Any], config: Mapping[str, Any], what: str
    ) -> Pipeline:
        """A pipeline for layer sites (objects with ``layers``, each with a ``node``), each site's layers in one
        segment, with ``config``'s ``by_block`` and ``cache_budget_mb``."""
        together = [[layer.node for layer in site.layers] for site in sites]
        by_block, budget, device = config["by_block"], config["cache_budget_mb"], config.get("device")
        return cls(model, cali_data, together, by_block, budget, what, device)

    def with_sites(self, sites: Sequence[Any]) -> Iterator[tuple[Segment, list[Any], bool]]:
        """Each segment in turn with the sites whose last layer it holds and whether sites remain after it, until
        the segment of the last site."""
        left = list(sites)
        for segment in self.segments:
            here = [site for site in left if site.layers[-1].node in segment]
            left = [site for site in left if site not in here]
            with self.on_device(segment):  # the algorithm's work on the segment's layers happens there too
                if self.store is not None:  # the weights just loaded need their quantizers' ranges
                    calibrate_weights(self.model, skip=pending_weights(self.model))
                yield segment, here, bool(left)
            if not left:
                return

    @contextmanager
    def on_device(self, segment: Segment) -> Iterator[None]:
        """``segment``'s parameters and buffers on the pipeline's device (if it has one) while in the block, moved
        back after it; weights on disk loaded for the block and written back after it."""
        if (self.device is None and self.store is None) or self._on is segment:
            yield
            return
        outer, self._on = self._on, segment
        slots = _slots(self.model, segment)
        loaded: list[Tensor] = []
        if self.store is not None:  # its weights from disk (or from the file an earlier pass wrote)
            held = [getattr(module, name) for module, name in slots]
            loaded = self.store.load([t for t in held if isinstance(t, Tensor)], self.device)
        homes = _move(slots, self.device) if self.device is not None else []
        try:
            yield
        finally:  # by slot: an algorithm may have put a new tensor in one (new quantization parameters)
            if self.device is not None:
                host = next((home for home in homes if home is not None), torch.device("cpu"))
                for (module, name), home in zip(slots, homes, strict=True):
                    tensor, home = getattr(module, name, None), home or host
                    if isinstance(tensor, Tensor) and tensor.device != home:
                        tensor.data = tensor.data.to(home)
            if self.store is not None:  # written to disk, memory-mapped back; the heap's freed pages given back
                self.store.offload(loaded, segment.name)
                release_freed_memory()
            self._on = outer

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

    def _start(self, segment: Segment, batch: int) -> int:
        """Where the next run of ``segment`` on batch ``batch`` starts: the index of the node kept at, or 0."""
        kept = self._checkpoints.get(batch)
        return kept[1] if kept is not None and kept[0] == segment.index else 0

    def _run(
        self,
        segment: Segment,
        batch: int,
        stop: fx.Node | None,
        checkpoint: fx.Node | None = None,
        keep_after_stop: bool = False,
    ) -> dict[str, Any]:
        """Segment ``segment`` on batch ``batch`` from its boundary (or from the state kept at its checkpoint), up to
        ``stop`` (included) or its end; the env. ``checkpoint``: keep the state met just before that node runs;
        ``keep_after_stop``: keep the state just after ``stop`` has run instead."""
        kept = self._checkpoints.get(batch)
        if kept is not None and kept[0] == segment.index:
            start, values = kept[1], dict(kept[2])
        else:
            boundary = self._boundaries[batch].load()
            if self.device is not None:
                boundary = {name: _to(value, self.device) for name, value in boundary.items()}
            start, values = 0, {self._named[name]: value for name, value in boundary.items()}
            for attribute in self._attributes[segment.index]:
                if attribute not in segment:
                    values[attribute] = self._interpreter.fetch_attr(str(attribute.target))
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
                if keep_after_stop:
                    self._checkpoints[batch] = (segment.index, index + 1, dict(values))
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
            stack.enter_context(self.on_device(segment))
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

        def hook_of(layer: Any) -> Callable[[nn.Module, tuple[Any, ...]], None]:
            return lambda module, args: reduce(layer, _rows(args[0].detach(), tokens[0]).to(dtype))

        hooks = {layer.module: hook_of(layer) for layer in layers}
        switches = weights_quantized_only(self.model, weights)
        tokens_of = lambda batch: tokens.__setitem__(0, token_mask(batch))  # noqa: E731
        self.run(segment, hooks, switches, until, advance, tokens_of, checkpoint)

    @torch.no_grad()
    def gather_value(
        self,
        segment: Segment,
        node: fx.Node,
        reduce: Callable[[Tensor], None],
        weights: bool = True,
        dtype: torch.dtype = torch.float64,
    ) -> bool:
        """Run ``segment`` on every batch up to ``node`` (weights quantized or float, as for :meth:`gather`) and
        call ``reduce(rows)`` with its value as rows ``[tokens, features]`` (of ``dtype``; a batch's padding
        left out as for :meth:`gather`); keep each batch's state just after ``node``, where the next run starts
        (the caller changes nothing that ``node`` and the nodes before it compute).

        The layers reading ``node`` do not run: what :meth:`gather` with hooks on them computes, for less. False
        (nothing run) where the runs cannot reach ``node``: not a node this segment runs, or before the state kept.
        """
        if node not in segment or node.op == "placeholder" or segment.index != self._reached:
            return False
        where = segment.nodes.index(node)
        if any(self._start(segment, batch) > where for batch in range(len(self.batches))):
            return False
        self._check_graph()
        with ExitStack() as stack:
            stack.enter_context(self.on_device(segment))
            stack.enter_context(weights_quantized_only(self.model, weights))
            for i, batch in enumerate(self.batches):
                env = self._run(segment, i, node, keep_after_stop=True)
                reduce(_rows(env[node.name].detach(), token_mask(batch)).to(dtype))
        return True

    @torch.no_grad()
    def run_all(
        self,
        hooks: Mapping[nn.Module, Callable[[nn.Module, tuple[Any, ...]], None]] | None = None,
        switches: AbstractContextManager[Any] | None = None,
        after: Callable[[Segment], None] | None = None,
    ) -> None:
        """One pass of the calibration data through the segments not run yet, each to its end (``hooks`` and
        ``switches`` as for :meth:`run`); ``after(segment)`` once each segment has run on every batch."""
        with switches if switches is not None else nullcontext():
            for segment in self.segments[self._reached :]:
                self.run(segment, hooks, advance=segment is not self.segments[-1])
                if after is not None:
                    after(segment)

    @torch.no_grad()
    def advance(self, segment: Segment, weights: bool = True) -> None:
        """Run ``segment`` to its end on every batch (weights quantized or float) and keep the next boundary."""
        self.run(segment, None, weights_quantized_only(self.model, weights), advance=True)

    def _keep(self, segment: Segment, batch: int, env: dict[str, Any]) -> None:
        end = self._position[segment.nodes[-1]]
        live = {
            name: value
            for name, value in env.items()
            if self._last_use[self._named[name]] > end and self._named[name].op != "get_attr"
        }
        if self.device is not None:  # the boundaries wait on the host
            live = {name: _to(value, "cpu") for name, value in live.items()}
        self._boundaries[batch].drop()
        self._boundaries[batch] = Boundary(live)

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


def check_keys(config: Mapping[str, Any], what: str) -> None:
    """The pipeline's keys of ``config`` (``by_block``, ``cache_budget_mb``, ``device``) checked, each error naming
    ``what`` and the key: called by an algorithm before it changes anything."""
    by_block, budget = config.get("by_block", True), config.get("cache_budget_mb")
    if not isinstance(by_block, bool):
        raise ValueError(f"{what} config by_block must be true or false, got {by_block!r}")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float)) or budget < 0):
        raise ValueError(
            f"{what} config cache_budget_mb must be a number of MiB >= 0 (or None: never spill), got {budget!r}"
        )
    run_device(config.get("device"), what)


def run_device(device: str | torch.device | None, what: str = "calibration") -> torch.device | None:
    """``device`` checked: None, or a device torch knows and this machine has."""
    if device is None:
        return None
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(
            f"{what} config device must be a torch device such as 'cuda' or 'cuda:0' (or None: where the model is), "
            f"got {device!r}"
        ) from error
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"{what} config device {device!r}: this machine has no CUDA device that torch can use "
            f"(torch {torch.__version__}); leave device unset to calibrate where the model is"
        )
    if parsed.type == "cuda" and parsed.index is not None and parsed.index >= torch.cuda.device_count():
        raise ValueError(f"{what} config device {device!r}: only {torch.cuda.device_count()} CUDA device(s) here")
    if parsed.type == "meta":
        raise ValueError(f"{what} config device 'meta' holds no values; name a device that computes")
    return parsed


def _to(value: Any, device: torch.device | str) -> Any:
    if isinstance(value, Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(_to(v, device) for v in value)
    return value


def _attributes_read(segment: Segment) -> list[fx.Node]:
    """The ``get_attr`` nodes whose values ``segment``'s nodes read (the graph may get them in an earlier segment:
    torch.export's graphs get every attribute at their start)."""
    read = {arg: None for node in segment.nodes for arg in node.all_input_nodes if arg.op == "get_attr"}
    return list(read)


def _slots(model: fx.GraphModule, segment: Segment) -> list[tuple[nn.Module, str]]:
    """The (module, name) of each parameter and buffer ``segment``'s nodes read: of the modules it calls, and the
    attributes it reads."""
    slots = []
    for node in [*segment.nodes, *_attributes_read(segment)]:
        if node.op == "call_module":
            for module in model.get_submodule(str(node.target)).modules():
                slots += [(module, name) for name in itertools.chain(module._parameters, module._buffers)]
        elif node.op == "get_attr" and any(user in segment for user in node.users):
            owner_path, _, name = str(node.target).rpartition(".")
            owner = model.get_submodule(owner_path) if owner_path else model
            value = getattr(owner, name)
            if isinstance(value, nn.Module):
                for module in value.modules():
                    slots += [(module, n) for n in itertools.chain(module._parameters, module._buffers)]
            elif isinstance(value, Tensor):
                slots.append((owner, name))
    return slots


def _move(slots: Sequence[tuple[nn.Module, str]], to: torch.device) -> list[torch.device | None]:
    """Move the tensor in each slot to ``to`` in place (``tensor.data``, so a tensor held in two
    slots, a tied weight, stays one); the device each was on (a tensor met again: where it was first)."""
    before: list[torch.device | None] = []
    first: dict[int, torch.device] = {}
    for module, name in slots:
        tensor = getattr(module, name, None)
        if not isinstance(tensor, Tensor):
            before.append(None)
            continue
        before.append(first.setdefault(id(tensor), tensor.device))
        if tensor.device != to:
            tensor.data = tensor.data.to(to)
    return before


class _OnDevice(fx.Interpreter):
    """Runs nodes with any ``device=`` argument the capture wrote (the host's, as a constant) set to ``device``."""

    def __init__(self, model: fx.GraphModule, device: torch.device) -> None:
        super().__init__(model, garbage_collect_values=False)
        self.device = device

    def fetch_args_kwargs_from_env(self, n: fx.Node) -> tuple[tuple[Any, ...], dict[str, Any]]:
        args, kwargs = super().fetch_args_kwargs_from_env(n)
        if n.op == "call_function" and kwargs.get("device") is not None:
            kwargs = {**kwargs, "device": self.device}
        return args, kwargs


def one_pass(
    model: nn.Module,
    cali_data: Any,
    hooks: Mapping[nn.Module, Callable[[nn.Module, tuple[Any, ...]], None]] | None = None,
    switches: AbstractContextManager[Any] | None = None,
    what: str = "calibration",
    after: Callable[[Segment | None], None] | None = None,
) -> None:
    """The calibration batches through ``model`` once (block by block on a prepared model with a stack of blocks,
    its memory the boundary values; a model that is not a GraphModule is called batch by batch), with forward
    pre-hooks ``hooks`` and the quantizers as ``switches`` sets them (None: as they are). ``after(segment)`` is
    called once each segment has run on every batch (``after(None)`` at the end for a model that is not a
    GraphModule): what a segment's statistics decide can be decided, and the statistics dropped, there."""
    if isinstance(model, fx.GraphModule):
        with Pipeline(model, cali_data, what=what) as pipeline:
            pipeline.run_all(hooks, switches, after)
        return
    with ExitStack() as stack, torch.no_grad():
        for module, hook in (hooks or {}).items():
            stack.callback(module.register_forward_pre_hook(hook).remove)
        if switches is not None:
            stack.enter_context(switches)
        for batch in calibration_batches(cali_data):
            call_with(model, batch)
        if after is not None:
            after(None)
