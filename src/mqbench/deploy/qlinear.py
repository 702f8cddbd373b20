"""Convert a Q/DQ ONNX model into onnxruntime's integer operator form.

Every float operator whose quantized inputs come from DequantizeLinear and whose output goes
straight into a QuantizeLinear (DQ -> op -> Q) becomes the integer operator onnxruntime runs:
QLinearConv (int32 bias at scale ``x_scale * w_scale``), QGemm (``com.microsoft``, int32 bias)
or QLinearMatMul, and from the ``com.microsoft`` domain QLinearAdd, QLinearMul, QLinearConcat,
QLinearGlobalAveragePool, QLinearAveragePool, QLinearLeakyRelu and QLinearSigmoid.

Operators that commute with quantization move to the integer side first: a DequantizeLinear
sinks below Relu, MaxPool, Resize (nearest) and the shape operators (Flatten, Reshape,
Transpose, Squeeze, Unsqueeze, Identity), and a QuantizeLinear rises above them and above Clip
(quantization is monotone, so ``Q(relu(x)) == max(Q(x), zero_point)``). A Relu or Clip becomes
an integer Clip at the quantized bounds, or nothing when the bound is the lowest integer anyway,
which fuses a Relu into the operator before it. A DequantizeLinear feeding a QuantizeLinear
with the same parameters disappears. Everything else stays float between its DQ and Q, so the
result always runs. The integer kernels accumulate exactly and requantize in float with round
half to even, like QuantizeLinear; they part from the float graph only at near ties (1 LSB).

Integer activations are held in one 8-bit type (uint8 by default; the integers and zero
points of int8 tensors move by 128, which changes no value): onnxruntime's kernels want one
activation type per operator, and its x86 kernels are fastest on uint8 activations.

Example:
    >>> import numpy as np
    >>> from onnx import TensorProto, helper, numpy_helper
    >>> from mqbench.deploy.qdq import insert_qdq
    >>> from mqbench.qparams import QParamTable, TensorQParams
    >>> nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv"), helper.make_node("Relu", ["c"], ["y"])]
    >>> weight = numpy_helper.from_array(np.full((3, 2, 1, 1), 0.25, np.float32), "w")
    >>> graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 4, 4])],
    ...     [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [weight])
    >>> model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    >>> act = TensorQParams(np.array([0.5]), np.array([0]), 0, 255)
    >>> w = TensorQParams(np.full(3, 1 / 64), np.zeros(3), -128, 127, axis=0, kind="weight")
    >>> table = QParamTable({"x": act, "w": w, "y": act})
    >>> qlinear, integers = to_qlinear(insert_qdq(model, table)[0], table)
    >>> [node.op_type for node in qlinear.graph.node]
    ['QuantizeLinear', 'QLinearConv', 'DequantizeLinear', 'Identity']
    >>> integers["y"][1:]
    (0.5, 0)
"""

from __future__ import annotations

import json
import warnings
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from mqbench.deploy.comparison import (
    REDUCE_RANGE_REMEDY,
    UINT8_WEIGHTS_REMEDY,
    ArtifactReport,
    HostReport,
    VerifyRun,
    compare,
    host_verdict,
    may_saturate,
)
from mqbench.deploy.onnx_graph import (
    all_names,
    constant,
    eliminate_dead_nodes,
    ort_session,
    save_model,
    topological_sort,
)
from mqbench.deploy.onnx_graph import unique_name as _unique
from mqbench.deploy.qlinear_qdq import qlinear_as_qdq
from mqbench.deploy.reference import saturated_layers
from mqbench.nn.quantized.saturation import ORT_QLINEAR_AVX2
from mqbench.qparams import QParamTable

if TYPE_CHECKING:
    from mqbench.deploy.context import DeployContext

__all__ = ["CONTRIB_DOMAIN", "METADATA_KEY", "IntegerTensors", "exposed_tensors", "float_ops", "to_qlinear", "write"]

CONTRIB_DOMAIN = "com.microsoft"
METADATA_KEY = "mqbench.integer_tensors"  # model metadata: the integer tensors, as JSON

IntegerTensors = dict[str, tuple[str, float | np.ndarray, int | np.ndarray]]

# Data movement: run on the integers themselves, and not counted as ops left in float.
_SHAPE_OPS = frozenset({"Identity", "Flatten", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Shape", "Gather"})
_UNARY = {
    "GlobalAveragePool": "QLinearGlobalAveragePool",
    "AveragePool": "QLinearAveragePool",
    "LeakyRelu": "QLinearLeakyRelu",
    "Sigmoid": "QLinearSigmoid",
}
_BINARY = {"Add": "QLinearAdd", "Mul": "QLinearMul"}
_TYPES = (np.dtype(np.int8), np.dtype(np.uint8))
_Input = tuple[str, "_Grid"]


@dataclass(frozen=True, eq=False)
class _Grid:
    """A QuantizeLinear/DequantizeLinear's constants: float32 scale and 8-bit zero point, scalar or along axis."""

    scale: np.ndarray
    zero_point: np.ndarray
    axis: int = 1

    @property
    def dtype(self) -> np.dtype:
        return self.zero_point.dtype

    @property
    def per_tensor(self) -> bool:
        return self.scale.size == 1

    @property
    def bounds(self) -> tuple[int, int]:
        info = np.iinfo(self.dtype)
        return int(info.min), int(info.max)

    def same(self, other: _Grid) -> bool:
        return self.per_tensor and other.per_tensor and self.dtype == other.dtype and self.public() == other.public()

    def shifted(self, dtype: np.dtype) -> _Grid:
        """The same grid on the other 8-bit type: integers and zero point move by 128."""
        return self if dtype == self.dtype else _Grid(self.scale, _shift(self.zero_point, dtype), self.axis)

    def _along(self, values: np.ndarray, ndim: int) -> np.ndarray:
        if self.per_tensor:
            return values.reshape(())
        shape = [1] * ndim
        shape[self.axis % ndim] = -1
        return values.reshape(shape)

    def quantize(self, values: np.ndarray) -> np.ndarray:
        """QuantizeLinear as onnxruntime computes it: float32 division, round half to even, saturation."""
        values = np.asarray(values, np.float32)
        scale = self._along(self.scale.astype(np.float32), values.ndim)
        zero = self._along(self.zero_point.astype(np.float32), values.ndim)
        return np.clip(np.rint(values / scale) + zero, *self.bounds).astype(self.dtype)

    def dequantize(self, values: np.ndarray) -> np.ndarray:
        ints = np.asarray(values).astype(np.int32)
        zero = self._along(self.zero_point.astype(np.int32), ints.ndim)
        return (ints - zero).astype(np.float32) * self._along(self.scale.astype(np.float32), ints.ndim)

    def public(self) -> tuple[Any, Any]:
        if self.per_tensor:
            return float(self.scale.reshape(-1)[0]), int(self.zero_point.reshape(-1)[0])
        return self.scale.astype(np.float32).copy(), self.zero_point.astype(np.int32)


def _shift(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Integers moved between int8 and uint8 (+128 towards uint8, -128 towards int8)."""
    return (np.asarray(values).astype(np.int32) + (128 if dtype == np.uint8 else -128)).astype(dtype)


def _attrs(node: onnx.NodeProto, drop: tuple[str, ...] = ()) -> dict[str, Any]:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute if a.name not in drop}


class _Converter:
    def __init__(self, model: onnx.ModelProto, weight_type: np.dtype | None) -> None:
        self.weight_type = weight_type
        self.model = onnx.ModelProto.FromString(model.SerializeToString())
        self.graph = self.model.graph
        self.nodes = [onnx.NodeProto.FromString(n.SerializeToString()) for n in self.graph.node]  # detached
        self.inits = {i.name: numpy_helper.to_array(i) for i in self.graph.initializer}
        self.outputs = {v.name for v in self.graph.output}
        self.taken = all_names(self.graph)
        self.consts: dict[tuple[str, tuple[int, ...], bytes], str] = {}
        self.alias: dict[str, str] = {}  # a folded Q output -> the integer tensor it equals
        self.variants: dict[str, list[_Input]] = defaultdict(list)  # weight -> its copies in the other type
        self.regrid: dict[str, _Grid] = {}  # integer tensor -> its grid after the activation type moved
        self.int_clips: dict[str, np.dtype] = {}
        self.dropped: set[int] = set()
        self._maps: tuple[dict[str, onnx.NodeProto], dict[str, list[onnx.NodeProto]]] | None = None
        self.handlers: dict[str, Callable[[onnx.NodeProto, list, onnx.NodeProto, _Grid], bool]] = {
            "Conv": self._conv,
            "Gemm": self._gemm,
            "MatMul": self._matmul,
            "Concat": self._concat,
            **dict.fromkeys(_BINARY, self._binary),
            **dict.fromkeys(_UNARY, self._unary),
        }

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

    def qparams(self, grid: _Grid, base: str) -> list[str]:
        scale, zero = grid.scale.astype(np.float32), grid.zero_point
        if grid.per_tensor:
            scale, zero = scale.reshape(()), zero.reshape(())
        return [self.const(scale, f"{base}_scale"), self.const(zero, f"{base}_zero_point")]

    def grid_of(self, node: onnx.NodeProto | None, op: str) -> _Grid | None:
        """The constants of a QuantizeLinear (``op="Q"``) or DequantizeLinear (``"DQ"``) node, if constant."""
        if node is None or node.op_type != {"Q": "QuantizeLinear", "DQ": "DequantizeLinear"}[op]:
            return None
        scale = self.inits.get(node.input[1])
        zero = self.inits.get(node.input[2]) if len(node.input) > 2 and node.input[2] else np.zeros((), np.uint8)
        attrs = _attrs(node)
        if scale is None or zero is None or scale.dtype != np.float32 or zero.dtype not in _TYPES:
            return None
        if scale.size != zero.size or scale.ndim > 1 or attrs.get("block_size", 0):
            return None
        return _Grid(scale, zero, int(attrs.get("axis", 1)))

    def dequantized(self, name: str) -> _Input | None:
        node = self.producer(name)
        grid = self.grid_of(node, "DQ")
        return (node.input[0], grid) if node is not None and grid is not None else None

    def sole_quantize(self, name: str) -> tuple[onnx.NodeProto, _Grid] | None:
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

    # -- integer building blocks -----------------------------------------------------------
    def weight_as(self, weight: _Input, dtype: np.dtype) -> _Input:
        """A constant weight in the type the kernel takes: int8 beside int8 activations, else ``weight_type``."""
        name, grid = weight
        target = np.dtype(np.int8) if dtype == np.int8 else (self.weight_type or grid.dtype)
        if grid.dtype == target:
            return weight
        moved = self.const(_shift(self.inits[name], target), f"{name}_{target.name}"), grid.shifted(target)
        self.variants[name].append(moved)
        return moved

    def int_clip(self, source: str, target: str, low: int | None, high: int | None, dtype: np.dtype) -> None:
        bound = lambda v, tag: "" if v is None else self.const(np.array(v, dtype), f"clip_{tag}")  # noqa: E731
        self.add("Clip", [source, bound(low, "min"), bound(high, "max")], target, target)
        self.int_clips[target] = dtype

    def integer_op(self, node: onnx.NodeProto, source: str, target: str, grid: _Grid, sinking: bool) -> bool | None:
        """Write a commuting op's integer form: True when written, None when it is the identity, False if none."""
        if not grid.per_tensor:
            return False
        if node.op_type in ("Relu", "Clip"):
            bounds: list[Any] = [0.0, None] if node.op_type == "Relu" else [None, None]
            for i, name in enumerate(node.input[1:3] if node.op_type == "Clip" else []):
                value = self.inits.get(name) if name else None
                if name and (value is None or value.size != 1):
                    return False
                bounds[i] = None if value is None else float(value.reshape(-1)[0])
            ints = [None if b is None else int(grid.quantize(np.array(b))) for b in bounds]
            exact = all(
                b is None or grid.dequantize(np.array(i)) == np.float32(b) for b, i in zip(bounds, ints, strict=True)
            )
            if sinking and not exact:
                return False  # a bound between grid points: clipping the float is no integer clip
            low = ints[0] if ints[0] is not None and ints[0] > grid.bounds[0] else None
            high = ints[1] if ints[1] is not None and ints[1] < grid.bounds[1] else None
            if low is None and high is None:
                return None
            self.int_clip(source, target, low, high, grid.dtype)
            return True
        attrs = _attrs(node)
        nearest = attrs.get("mode", b"nearest") == b"nearest"
        nearest &= attrs.get("coordinate_transformation_mode", b"") != b"tf_crop_and_resize"
        if not (node.op_type in _SHAPE_OPS or node.op_type == "MaxPool" or (node.op_type == "Resize" and nearest)):
            return False
        if any(node.output[1:]):
            return False
        self.add(node.op_type, [source, *node.input[1:]], target, node.name or node.op_type, node.domain, **attrs)
        return True

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
            if reader.output[0] in self.outputs or list(reader.input).count(node.output[0]) != 1:
                continue
            target = _unique(f"{reader.output[0]}_quantized", self.taken)
            made = reader.input[0] == node.output[0] and self.integer_op(reader, node.input[0], target, grid, True)
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
        made = self.integer_op(source, middle, node.output[0], grid, False)
        if made is False:
            return False
        target = middle if made else node.output[0]
        self.add("QuantizeLinear", [source.input[0], *node.input[1:]], target, middle, **_attrs(node))
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
        handler = self.handlers.get(node.op_type) if node.domain in ("", "ai.onnx") else None
        found = self.sole_quantize(node.output[0]) if handler is not None and len(node.output) == 1 else None
        if handler is None or found is None:
            return False
        inputs = [self.dequantized(name) if name else None for name in node.input]
        if handler(node, inputs, *found):
            self.remove(node, found[0])
            return True
        return False

    # -- operator handlers: check everything, then emit --------------------------------------
    def weights(self, found: _Input | None, axis: int, ndim: int | None) -> _Input | None:
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
    def same_type(inputs: list[_Input | None], out: _Grid) -> bool:
        """Per-tensor activations all in the output's 8-bit type (onnxruntime's kernels take one type)."""
        return bool(inputs) and all(i is not None and i[1].per_tensor and i[1].dtype == out.dtype for i in inputs)

    def emit(self, op: str, node: onnx.NodeProto, args: list[str], q: onnx.NodeProto, out: _Grid, **attrs: Any) -> bool:
        """The integer op writing ``q``'s output; ``"Y"`` in ``args`` stands for y_scale, y_zero_point."""
        i = args.index("Y")
        args[i : i + 1] = self.qparams(out, q.output[0])
        domain = "" if op in ("QLinearConv", "QLinearMatMul") else CONTRIB_DOMAIN
        self.add(op, args, q.output[0], node.name or op, domain, **attrs)
        return True

    def _conv(self, node: onnx.NodeProto, inputs: list, q: onnx.NodeProto, out: _Grid) -> bool:
        x, w = inputs[0], self.weights(inputs[1] if len(inputs) > 1 else None, 0, None)
        if w is None or not self.same_type([x], out):
            return False
        accumulator = x[1].scale.astype(np.float64).reshape(-1) * w[1].scale.astype(np.float64).reshape(-1)
        bias = self.bias(node, 2, accumulator, self.inits[w[0]].shape[0])
        if bias is not None and not bias.size:
            return False
        w = self.weight_as(w, x[1].dtype)
        args = [x[0], *self.qparams(x[1], x[0]), w[0], *self.qparams(w[1], w[0]), "Y"]
        args += [] if bias is None else [self.const(bias, f"{node.name}_bias_int32")]
        return self.emit("QLinearConv", node, args, q, out, **_attrs(node))

    def _gemm(self, node: onnx.NodeProto, inputs: list, q: onnx.NodeProto, out: _Grid) -> bool:
        attrs = _attrs(node)
        alpha, beta, trans_b = float(attrs.get("alpha", 1.0)), float(attrs.get("beta", 1.0)), attrs.get("transB", 0)
        a, b = inputs[0], self.weights(inputs[1] if len(inputs) > 1 else None, 0 if trans_b else 1, 2)
        if b is None or alpha <= 0 or not self.same_type([a], out):
            return False
        channels = self.inits[b[0]].shape[0 if trans_b else 1]
        b_scale = (b[1].scale * np.float32(alpha)).astype(np.float32)  # alpha folds into B's scale
        accumulator = a[1].scale.astype(np.float64).reshape(-1) * b_scale.astype(np.float64).reshape(-1)
        bias = self.bias(node, 2, accumulator / beta, channels) if beta else None  # beta * C / accumulator
        if bias is not None and not bias.size:
            return False
        b = self.weight_as(b, a[1].dtype)
        b_grid = _Grid(b_scale, b[1].zero_point, b[1].axis)
        c = "" if bias is None else self.const(bias, f"{node.name}_bias_int32")
        args = [a[0], *self.qparams(a[1], a[0]), b[0], *self.qparams(b_grid, b[0]), c, "Y"]
        keep = {k: v for k, v in attrs.items() if k in ("transA", "transB")}
        return self.emit("QGemm", node, args, q, out, **keep)

    def _matmul(self, node: onnx.NodeProto, inputs: list, q: onnx.NodeProto, out: _Grid) -> bool:
        a, b = inputs[0], inputs[1]
        if b is None or not self.same_type([a], out):
            return False
        if b[0] in self.inits:  # a constant B may be quantized per column
            b = self.weights(b, 1, 2) if not b[1].per_tensor else b
            b = None if b is None else self.weight_as(b, a[1].dtype)
        elif not b[1].per_tensor or (a[1].dtype == np.int8 and b[1].dtype != np.int8):
            return False  # int8 activations need an int8 B
        if b is None:
            return False
        args = [a[0], *self.qparams(a[1], a[0]), b[0], *self.qparams(b[1], b[0]), "Y"]
        return self.emit("QLinearMatMul", node, args, q, out)

    def _binary(self, node: onnx.NodeProto, inputs: list, q: onnx.NodeProto, out: _Grid) -> bool:
        if len(inputs) != 2 or not self.same_type(inputs, out):
            return False
        args = [name for x, grid in inputs for name in (x, *self.qparams(grid, x))]
        return self.emit(_BINARY[node.op_type], node, [*args, "Y"], q, out)

    def _concat(self, node: onnx.NodeProto, inputs: list, q: onnx.NodeProto, out: _Grid) -> bool:
        if not self.same_type(inputs, out):
            return False
        args = [name for x, grid in inputs for name in (x, *self.qparams(grid, x))]
        return self.emit("QLinearConcat", node, ["Y", *args], q, out, **_attrs(node))

    def _unary(self, node: onnx.NodeProto, inputs: list, q: onnx.NodeProto, out: _Grid) -> bool:
        attrs = _attrs(node, drop=("dilations",))
        if not self.same_type(inputs[:1], out) or any(d != 1 for d in _attrs(node).get("dilations", [])):
            return False
        if node.op_type == "GlobalAveragePool":
            attrs["channels_last"] = 0
        if node.op_type == "LeakyRelu":
            attrs.setdefault("alpha", 0.01)
        x = inputs[0]
        return self.emit(_UNARY[node.op_type], node, [x[0], *self.qparams(x[1], x[0]), "Y"], q, out, **attrs)

    # -- result ------------------------------------------------------------------------------
    def finish(self, sources: dict[str, _Input]) -> tuple[onnx.ModelProto, IntegerTensors]:
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


def _sources(converter: _Converter, table: QParamTable) -> dict[str, _Input]:
    """Table tensor -> (its integer tensor, grid) in the Q/DQ model: the input of its DequantizeLinear."""
    sources: dict[str, _Input] = {}
    for node in converter.nodes:
        grid = converter.grid_of(node, "DQ")
        quantize = converter.producer(node.input[0]) if grid is not None else None
        tensor = quantize.input[0] if quantize is not None and quantize.op_type == "QuantizeLinear" else ""
        while tensor and tensor not in table:  # a narrow range is a Clip (or Max/Min) in front of the Q
            clip = converter.producer(tensor)
            tensor = clip.input[0] if clip is not None and clip.op_type in ("Clip", "Max", "Min") else ""
        if grid is not None and not tensor:  # a quantized network output: DQ -> Identity -> output name
            named = [r.output[0] for r in converter.readers(node.output[0]) if r.op_type == "Identity"]
            tensor = next((t for t in named if t in table), "")
        if grid is not None and tensor and tensor not in sources:
            sources[tensor] = (node.input[0], grid)
    return sources


def to_qlinear(
    qdq_model: onnx.ModelProto, table: QParamTable, activation_type: str = "uint8", weight_type: str | None = None
) -> tuple[onnx.ModelProto, IntegerTensors]:
    """The integer form of ``qdq_model`` (from :func:`~mqbench.deploy.qdq.insert_qdq` with ``table``).

    ``activation_type`` ("uint8" or "int8") holds the integer activations; int8 x int8
    convolution has no fast kernel in onnxruntime on x86. ``weight_type`` ("int8", "uint8" or
    None to keep the Q/DQ model's) does the same for constant weights: "int8" takes the
    uint8 x int8 kernels, about twice as fast as uint8 x uint8 on CPUs with VNNI (without VNNI
    those may saturate 16-bit intermediate sums, which is why weights keep their type unless asked).

    Also returns (and records in the model's metadata, see :func:`exposed_tensors`), for every
    table tensor that exists as an 8-bit integer tensor in the result, ``(integer tensor name,
    scale, zero_point)``: floats per tensor, arrays per channel; the zero point is that of the
    tensor's 8-bit type.
    """
    for label, value, allowed in (("activation_type", activation_type, ("uint8", "int8")),
                                  ("weight_type", weight_type, ("uint8", "int8", None))):  # fmt: skip
        if value not in allowed:
            raise ValueError(f"{label} must be one of {allowed}, got {value!r}")
    versions = {o.domain: o.version for o in qdq_model.opset_import}
    version = versions.get("", versions.get("ai.onnx", 0))
    if version < 13:
        raise ValueError(f"the QLinear form needs ONNX opset 13 or newer (integer Clip), got opset {version}")
    converter = _Converter(qdq_model, None if weight_type is None else np.dtype(weight_type))
    known = (
        set(converter.inits) | {v.name for v in converter.graph.input} | {o for n in converter.nodes for o in n.output}
    )
    missing = [t for t in table if t not in known]
    if missing:
        raise ValueError(f"the parameter table names tensors the model does not have: {missing[:5]}")
    sources = _sources(converter, table)
    converter.sweep(converter.fold_constant)
    converter.switch_activation_type(np.dtype(activation_type))
    for rewrite in (converter.sink_dequantize, converter.hoist_quantize, converter.fold_requantize):
        converter.sweep(rewrite)
    converter.sweep(converter.convert)
    converter.sweep(converter.merge_clips)
    return converter.finish(sources)


def exposed_tensors(model: onnx.ModelProto, table: QParamTable) -> IntegerTensors:
    """The integer tensors of ``table``'s tensors in a model :func:`to_qlinear` wrote (from its metadata)."""
    props = {p.key: p.value for p in model.metadata_props}
    if METADATA_KEY not in props:
        raise ValueError(f"the model has no {METADATA_KEY!r} metadata; it was not written by to_qlinear")
    present = {i.name for i in model.graph.initializer} | {o for n in model.graph.node for o in n.output}
    result: IntegerTensors = {}
    for tensor, (name, scale, zero) in json.loads(props[METADATA_KEY]).items():
        if tensor in table and name in present:
            per_channel = isinstance(scale, list)
            result[tensor] = (
                name,
                np.asarray(scale, np.float32) if per_channel else float(np.float32(scale)),
                np.asarray(zero, np.int32) if per_channel else int(zero),
            )
    return result


def float_ops(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """Compute operators of a converted model that still run in float on dequantized inputs."""
    dequantized = {n.output[0] for n in model.graph.node if n.op_type == "DequantizeLinear"}
    return [
        node
        for node in model.graph.node
        if node.op_type not in _SHAPE_OPS | {"QuantizeLinear", "DequantizeLinear"}
        and any(name in dequantized for name in node.input)
    ]


def write(context: DeployContext) -> Path:
    """The ``qlinear_onnx`` artifact: ``<model_name>_qlinear.onnx``; warns naming the ops left in float."""
    model, _ = to_qlinear(context.qdq_model, context.table, weight_type=context.qlinear_weight_type)
    left = float_ops(model)
    if left:
        shown = ", ".join(f"{node.op_type} {node.name!r}" for node in left[:8])
        more = f" and {len(left) - 8} more" if len(left) > 8 else ""
        warnings.warn(
            f"{len(left)} op(s) have no integer kernel in onnxruntime and run in float between "
            f"DequantizeLinear and QuantizeLinear in the QLinear graph: {shown}{more}",
            stacklevel=2,
        )
    path = context.path("_qlinear.onnx")
    save_model(model, path)
    return path


# -- verification: the integer graph ---------------------------------------------------------------
def _dequantize_integers(
    raw: Mapping[str, np.ndarray], integer: Mapping[str, tuple[str, Any, Any]], result: Any
) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """The QLinear graph's integer tensors as real values (tensor -> name in the returned values)."""
    values = {name: raw[name] for name in result.output_names if name in raw}
    exposed = {}
    for tensor, (name, scale, zero_point) in integer.items():
        entry = result.table[tensor]
        q = np.asarray(raw[name]).astype(np.float64)
        s = np.asarray(scale, np.float64)
        z = np.asarray(zero_point, np.float64)
        if entry.axis is not None and q.ndim:
            shape = [1] * q.ndim
            shape[entry.axis % q.ndim] = -1
            s, z = s.reshape(shape), z.reshape(shape)
        values[f"{tensor}::dequantized"] = ((q - z) * s).astype(np.float32)
        exposed[tensor] = f"{tensor}::dequantized"
    return values, exposed


def verify(result: Any, feeds: Mapping[str, np.ndarray], run: VerifyRun) -> ArtifactReport:
    """The integer graph: its arithmetic by the integer reference, then onnxruntime's integer ops on this host."""
    model = onnx.load(result.artifacts["qlinear_onnx"])
    integer = exposed_tensors(model, result.table)  # tensor -> (integer tensor name, scale, zero point)
    names = list(dict.fromkeys([name for name, _, _ in integer.values()] + list(result.output_names)))
    # what the file means (exact int32 accumulation), recording where a CPU without VNNI would saturate
    record = (ORT_QLINEAR_AVX2,) if run.host and run.predict is not False and may_saturate(result.table) else ()
    predictions, raw = saturated_layers(qlinear_as_qdq(model), feeds, record, names)
    values, exposed = _dequantize_integers(raw, integer, result)
    report = compare(
        ArtifactReport("qlinear_onnx", "integer reference"), values, result.table, exposed, run, result.output_names
    )
    if run.host:
        extended = onnx.ModelProto.FromString(model.SerializeToString())
        present = {v.name for v in extended.graph.output}
        extended.graph.output.extend(helper.make_empty_tensor_value_info(n) for n in names if n not in present)
        session = ort_session(extended)
        wanted = [v.name for v in extended.graph.output]
        raw = dict(zip(wanted, session.run(wanted, dict(feeds)), strict=True))
        values, exposed = _dequantize_integers(raw, integer, result)
        host = HostReport("qlinear_onnx", "onnxruntime (integer ops)")
        host = compare(host, values, result.table, exposed, run, result.output_names)
        remedy = f"{REDUCE_RANGE_REMEDY}, {UINT8_WEIGHTS_REMEDY}"
        predicted = predictions.get(ORT_QLINEAR_AVX2.runtime, {})
        report.host = host_verdict(host, predicted, ORT_QLINEAR_AVX2, remedy, run.tolerance)
    return report


def serve(result: Any) -> Callable[[Mapping[str, np.ndarray]], list[np.ndarray]]:
    """The integer graph on onnxruntime's integer kernels (graph optimizations on)."""
    session = ort_session(onnx.load(result.artifacts["qlinear_onnx"]))
    return lambda feeds: list(session.run(None, dict(feeds)))
