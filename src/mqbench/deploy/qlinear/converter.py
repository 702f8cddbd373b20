"""The driver of the QLinear conversion: the graph being rewritten, its passes, and the building blocks rules use.

:class:`Converter` keeps the context (the detached nodes, the constants, which tensors were moved
between the 8-bit types or folded into others) and runs the passes of :func:`~mqbench.deploy.qlinear.to_qlinear`.
What one operator becomes is not written here: :meth:`Converter.convert` looks the operator up in
its table of :data:`OperatorRule` (integer operators) and the sinking and hoisting passes in its table
of :data:`CommutingRule` (operators that commute with quantization), so an operator family is one
rule in one table.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from mqbench.deploy.onnx_graph import all_names, constant, eliminate_dead_nodes, topological_sort
from mqbench.deploy.onnx_graph import unique_name as _unique
from mqbench.deploy.qlinear.grid import EIGHT_BIT_TYPES, Grid, Input, attributes, shift

__all__ = [
    "CONTRIB_DOMAIN",
    "METADATA_KEY",
    "CommutingRule",
    "Converter",
    "IntegerTensors",
    "OperatorRule",
]

CONTRIB_DOMAIN = "com.microsoft"
METADATA_KEY = "mqbench.integer_tensors"  # model metadata: the integer tensors, as JSON

IntegerTensors = dict[str, tuple[str, float | np.ndarray, int | np.ndarray]]

OperatorRule = Callable[["Converter", onnx.NodeProto, list[Input | None], onnx.NodeProto, Grid], bool]
"""``rule(converter, node, inputs, q, out)``: write ``node``'s integer operator, whose output is that of the
QuantizeLinear ``q`` (on ``out``); ``inputs`` are the dequantized inputs (None where an input is not one).
True when written; False, having written nothing, where the operator has no integer form here."""

CommutingRule = Callable[["Converter", onnx.NodeProto, str, str, Grid, bool], "bool | None"]
"""``rule(converter, node, source, target, grid, sinking)``: write ``node`` on the integers ``source`` (on the
per-tensor ``grid``) into ``target``. True when written, None when the operator is the identity on that grid,
False (nothing written) when it does not commute with quantization. ``sinking``: a DequantizeLinear moves
below ``node`` (its float output must equal the dequantized integer result exactly)."""

# Read only their input's shape, which the integers have too: they read the integers, with no DequantizeLinear.
_SHAPE_READERS = frozenset({"Shape", "Size"})


class Converter:
    """A Q/DQ model being rewritten into integer operators (see :func:`~mqbench.deploy.qlinear.to_qlinear`)."""

    def __init__(
        self,
        model: onnx.ModelProto,
        weight_type: np.dtype | None,
        operator_rules: Mapping[str, OperatorRule],
        commuting_rules: Mapping[str, CommutingRule],
    ) -> None:
        self.weight_type = weight_type
        self.operator_rules = operator_rules
        self.commuting_rules = commuting_rules
        self.model = onnx.ModelProto.FromString(model.SerializeToString())
        self.graph = self.model.graph
        self.nodes = [onnx.NodeProto.FromString(n.SerializeToString()) for n in self.graph.node]  # detached
        self.inits = {i.name: numpy_helper.to_array(i) for i in self.graph.initializer}
        self.outputs = {v.name for v in self.graph.output}
        self.taken = all_names(self.graph)
        self.consts: dict[tuple[str, tuple[int, ...], bytes], str] = {}
        self.alias: dict[str, str] = {}  # a folded Q output -> the integer tensor it equals
        self.variants: dict[str, list[Input]] = defaultdict(list)  # weight -> its copies in the other type
        self.regrid: dict[str, Grid] = {}  # integer tensor -> its grid after the activation type moved
        self.int_clips: dict[str, np.dtype] = {}
        self.dropped: set[int] = set()
        self._maps: tuple[dict[str, onnx.NodeProto], dict[str, list[onnx.NodeProto]]] | None = None

    # -- graph bookkeeping -----------------------------------------------------------------
    def producer(self, name: str) -> onnx.NodeProto | None:
        return self._index()[0].get(name)

    def readers(self, name: str) -> list[onnx.NodeProto]:
        return self._index()[1].get(name, [])

    def _index(self) -> tuple[dict[str, onnx.NodeProto], dict[str, list[onnx.NodeProto]]]:
        if self._maps is None:
            readers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
            for n in self.nodes:
                for name in dict.fromkeys(n.input):
                    readers[name].append(n)
            self._maps = {out: n for n in self.nodes for out in n.output if out}, readers
        return self._maps

    def add(self, op: str, inputs: list[str], output: str, base: str, domain: str = "", **attrs: Any) -> None:
        name = _unique(f"{base}_{op}", self.taken)
        self.nodes.append(helper.make_node(op, inputs, [output], name=name, domain=domain or None, **attrs))
        self._maps = None

    def remove(self, *nodes: onnx.NodeProto) -> None:
        self.dropped.update(id(n) for n in nodes)
        self.nodes = [n for n in self.nodes if id(n) not in self.dropped]
        self._maps = None

    def rename_readers(self, old: str, new: str) -> None:
        for node in self.nodes:
            node.input[:] = [new if name == old else name for name in node.input]
        self._maps = None

    def const(self, value: np.ndarray, base: str) -> str:
        value = np.array(value, copy=True, order="C")  # (0-d arrays stay 0-d)
        key = (value.dtype.str, value.shape, value.tobytes())
        if key not in self.consts:
            self.consts[key] = _unique(base, self.taken)
            self.inits[self.consts[key]] = value
        return self.consts[key]

    def qparams(self, grid: Grid, base: str) -> list[str]:
        scale, zero = grid.scale.astype(np.float32), grid.zero_point
        if grid.per_tensor:
            scale, zero = scale.reshape(()), zero.reshape(())
        return [self.const(scale, f"{base}_scale"), self.const(zero, f"{base}_zero_point")]

    def grid_of(self, node: onnx.NodeProto | None, op: str) -> Grid | None:
        """The constants of a QuantizeLinear (``op="Q"``) or DequantizeLinear (``"DQ"``) node, if constant."""
        if node is None or node.op_type != {"Q": "QuantizeLinear", "DQ": "DequantizeLinear"}[op]:
            return None
        scale = self.inits.get(node.input[1])
        zero = self.inits.get(node.input[2]) if len(node.input) > 2 and node.input[2] else np.zeros((), np.uint8)
        attrs = attributes(node)
        if scale is None or zero is None or scale.dtype != np.float32 or zero.dtype not in EIGHT_BIT_TYPES:
            return None
        if scale.size != zero.size or scale.ndim > 1 or attrs.get("block_size", 0):
            return None
        return Grid(scale, zero, int(attrs.get("axis", 1)))

    def dequantized(self, name: str) -> Input | None:
        node = self.producer(name)
        grid = self.grid_of(node, "DQ")
        return (node.input[0], grid) if node is not None and grid is not None else None

    def sole_quantize(self, name: str) -> tuple[onnx.NodeProto, Grid] | None:
        """The QuantizeLinear (per tensor) that is the only reader of ``name``, if any."""
        readers = self.readers(name)
        grid = self.grid_of(readers[0], "Q") if len(readers) == 1 and name not in self.outputs else None
        return (readers[0], grid) if grid is not None and grid.per_tensor and readers[0].input[0] == name else None

    def sweep(self, rewrite: Callable[[onnx.NodeProto], bool]) -> None:
        progress = True
        while progress:
            progress = False
            for node in list(self.nodes):  # the snapshot keeps dropped nodes alive, so their ids stay unique
                if id(node) not in self.dropped and rewrite(node):
                    progress = True
            self.dropped.clear()

    # -- integer building blocks (for the rules) ---------------------------------------------
    def weight_as(self, weight: Input, dtype: np.dtype) -> Input:
        """A constant weight in the type the kernel takes: int8 beside int8 activations, else ``weight_type``."""
        name, grid = weight
        target = np.dtype(np.int8) if dtype == np.int8 else (self.weight_type or grid.dtype)
        if grid.dtype == target:
            return weight
        moved = self.const(shift(self.inits[name], target), f"{name}_{target.name}"), grid.shifted(target)
        self.variants[name].append(moved)
        return moved

    def int_clip(self, source: str, target: str, low: int | None, high: int | None, dtype: np.dtype) -> None:
        bound = lambda v, tag: "" if v is None else self.const(np.array(v, dtype), f"clip_{tag}")  # noqa: E731
        self.add("Clip", [source, bound(low, "min"), bound(high, "max")], target, target)
        self.int_clips[target] = dtype

    def weights(self, found: Input | None, axis: int, ndim: int | None) -> Input | None:
        """A constant integer weight (of rank ``ndim`` if given), per tensor or per channel along ``axis``."""
        if found is None or found[0] not in self.inits:
            return None
        shape = self.inits[found[0]].shape
        if (ndim is not None and len(shape) != ndim) or len(shape) <= axis:
            return None
        grid = found[1]
        return found if grid.per_tensor or (grid.axis % len(shape) == axis and grid.scale.size == shape[axis]) else None

    def bias(self, node: onnx.NodeProto, index: int, accumulator: np.ndarray, channels: int) -> np.ndarray | None:
        """The int32 bias at the accumulator scale (one per channel); an empty array when it cannot be one."""
        if len(node.input) <= index or not node.input[index]:
            return None
        values, found = self.inits.get(node.input[index]), self.dequantized(node.input[index])
        if values is None and found is not None and found[0] in self.inits:
            values = found[1].dequantize(self.inits[found[0]])
        if values is None or values.dtype.kind != "f" or values.size not in (1, channels):
            return np.zeros(0, np.int32)
        if values.ndim > 1 and values.shape[-1] != values.size:
            return np.zeros(0, np.int32)
        scaled = np.rint(np.broadcast_to(values.astype(np.float64).reshape(-1), (channels,)) / accumulator)
        return np.zeros(0, np.int32) if np.any(np.abs(scaled) >= 2**31) else scaled.astype(np.int32)

    @staticmethod
    def same_type(inputs: list[Input | None], out: Grid) -> bool:
        """Per-tensor activations all in the output's 8-bit type (onnxruntime's kernels take one type)."""
        return bool(inputs) and all(i is not None and i[1].per_tensor and i[1].dtype == out.dtype for i in inputs)

    def emit(self, op: str, node: onnx.NodeProto, args: list[str], q: onnx.NodeProto, out: Grid, **attrs: Any) -> bool:
        """The integer op writing ``q``'s output; ``"Y"`` in ``args`` stands for y_scale, y_zero_point."""
        i = args.index("Y")
        args[i : i + 1] = self.qparams(out, q.output[0])
        domain = "" if op in ("QLinearConv", "QLinearMatMul") else CONTRIB_DOMAIN
        self.add(op, args, q.output[0], node.name or op, domain, **attrs)
        return True

    def commute(self, node: onnx.NodeProto, source: str, target: str, grid: Grid, sinking: bool) -> bool | None:
        """``node`` on the integers by its :data:`CommutingRule`; False where it has none."""
        rule = self.commuting_rules.get(node.op_type)
        if rule is None or not grid.per_tensor:
            return False
        return rule(self, node, source, target, grid, sinking)

    # -- passes ----------------------------------------------------------------------------
    def fold_constant(self, node: onnx.NodeProto) -> bool:
        """Constant nodes, Identity of a constant (shared biases) and Q of a constant (weights) become initializers."""
        value = None
        if not node.output or node.output[0] in self.outputs:
            return False
        if node.op_type == "Constant" and [a.name for a in node.attribute] == ["value"]:
            value = numpy_helper.to_array(node.attribute[0].t)
        elif node.op_type == "Identity" and node.input[0] in self.inits:
            value = self.inits[node.input[0]]
        elif node.input and node.input[0] in self.inits and (grid := self.grid_of(node, "Q")) is not None:
            value = grid.quantize(self.inits[node.input[0]])
        if value is None:
            return False
        self.inits[node.output[0]] = value
        self.remove(node)
        return True

    def switch_activation_type(self, dtype: np.dtype) -> None:
        """Every Q -> DQ pair on an activation in ``dtype`` (integers and zero point move by 128)."""
        for node in list(self.nodes):
            grid = self.grid_of(node, "Q")
            if grid is None or not grid.per_tensor or grid.dtype == dtype or node.output[0] in self.outputs:
                continue
            readers = self.readers(node.output[0])
            grids = [self.grid_of(r, "DQ") for r in readers]
            if not readers or not all(g is not None and g.same(grid) for g in grids):
                continue
            moved = grid.shifted(dtype)
            zero = self.const(moved.zero_point.reshape(()), f"{node.output[0]}_zero_point")
            for user in (node, *readers):
                user.input[:] = [*user.input[:2], zero]
            self.regrid[node.output[0]] = moved
        self._maps = None

    def sink_dequantize(self, node: onnx.NodeProto) -> bool:
        grid = self.grid_of(node, "DQ")
        if grid is None:
            return False
        for reader in self.readers(node.output[0]):
            if reader.op_type in _SHAPE_READERS and reader.input[0] == node.output[0]:
                reader.input[0] = node.input[0]
                self._maps = None
                return True
            if reader.output[0] in self.outputs or list(reader.input).count(node.output[0]) != 1:
                continue
            target = _unique(f"{reader.output[0]}_quantized", self.taken)
            made = reader.input[0] == node.output[0] and self.commute(reader, node.input[0], target, grid, True)
            if made is False:
                continue
            if made is None:
                self.rename_readers(reader.output[0], node.output[0])
            else:
                self.add("DequantizeLinear", [target, *node.input[1:]], reader.output[0], reader.output[0])
            self.remove(reader)
            return True
        return False

    def hoist_quantize(self, node: onnx.NodeProto) -> bool:
        grid = self.grid_of(node, "Q")
        source = self.producer(node.input[0]) if grid is not None else None
        if grid is None or source is None or not source.input or source.input[0] in self.inits:
            return False
        if source.output[0] in self.outputs or self.readers(source.output[0]) != [node]:
            return False
        middle = _unique(f"{source.input[0]}_quantized", self.taken)
        made = self.commute(source, middle, node.output[0], grid, False)
        if made is False:
            return False
        target = middle if made else node.output[0]
        self.add("QuantizeLinear", [source.input[0], *node.input[1:]], target, middle, **attributes(node))
        self.remove(source, node)
        return True

    def fold_requantize(self, node: onnx.NodeProto) -> bool:
        grid = self.grid_of(node, "Q")
        found = self.dequantized(node.input[0]) if grid is not None else None
        if grid is None or found is None or node.output[0] in self.outputs or not found[1].same(grid):
            return False
        self.rename_readers(node.output[0], found[0])
        self.alias[node.output[0]] = found[0]
        self.remove(node)
        return True

    def merge_clips(self, node: onnx.NodeProto) -> bool:
        inner = self.producer(node.input[0]) if node.output[0] in self.int_clips else None
        if inner is None or inner.output[0] not in self.int_clips or self.readers(inner.output[0]) != [node]:
            return False
        get = lambda n, i: None if len(n.input) <= i or not n.input[i] else int(self.inits[n.input[i]])  # noqa: E731
        lows = [v for v in (get(inner, 1), get(node, 1)) if v is not None]
        highs = [v for v in (get(inner, 2), get(node, 2)) if v is not None]
        low, high = (max(lows) if lows else None), (min(highs) if highs else None)
        if low is not None and high is not None and low > high:
            return False
        self.remove(inner, node)
        self.int_clip(inner.input[0], node.output[0], low, high, self.int_clips[node.output[0]])
        return True

    def convert(self, node: onnx.NodeProto) -> bool:
        """DQ -> ``node`` -> Q becomes ``node``'s integer operator, by its :data:`OperatorRule`."""
        rule = self.operator_rules.get(node.op_type) if node.domain in ("", "ai.onnx") else None
        found = self.sole_quantize(node.output[0]) if rule is not None and len(node.output) == 1 else None
        if rule is None or found is None:
            return False
        inputs = [self.dequantized(name) if name else None for name in node.input]
        if rule(self, node, inputs, *found):
            self.remove(node, found[0])
            return True
        return False

    # -- result ------------------------------------------------------------------------------
    def finish(self, sources: dict[str, Input]) -> tuple[onnx.ModelProto, IntegerTensors]:
        """The rewritten model, and where each of ``sources``' tensors now is as an integer tensor."""
        graph = self.graph
        del graph.node[:]
        graph.node.extend(self.nodes)
        del graph.initializer[:]
        graph.initializer.extend(constant(name, value) for name, value in self.inits.items())
        del graph.value_info[:]  # element types changed
        topological_sort(graph)
        eliminate_dead_nodes(graph)
        domains = {o.domain for o in self.model.opset_import}
        if any(n.domain == CONTRIB_DOMAIN for n in graph.node) and CONTRIB_DOMAIN not in domains:
            self.model.opset_import.append(helper.make_opsetid(CONTRIB_DOMAIN, 1))
        present = {i.name for i in graph.initializer} | {o for n in graph.node for o in n.output}
        integers: IntegerTensors = {}
        for tensor, (name, grid) in sources.items():
            grid = self.regrid.get(name, grid)
            while name in self.alias:
                name = self.alias[name]
            found = next((c for c in [(name, grid), *self.variants.get(name, [])] if c[0] in present), None)
            if found is not None:
                integers[tensor] = (found[0], *found[1].public())
        listed = {t: [n, np.asarray(s).tolist(), np.asarray(z).tolist()] for t, (n, s, z) in integers.items()}
        helper.set_model_props(
            self.model, {**{p.key: p.value for p in self.model.metadata_props}, METADATA_KEY: json.dumps(listed)}
        )
        return self.model, integers
