"""onnxruntime's ``MatMulNBits``: group-wise weight-only linear layers as the generative runtimes run them.

``MatMulNBits`` (domain ``com.microsoft``) computes ``Y = A @ dequantize(B).T`` with ``B`` the packed unsigned
``bits``-bit integers of an ``[N, K]`` weight in blocks of ``block_size`` input channels (a power of two, at
least 16), one float scale per block and an optional packed zero point per block (default ``2 ** (bits - 1)``).
The simulation's grid maps onto it exactly: a signed grid's integers ``q`` become ``q + 2 ** (bits - 1)`` with
the zero point moved alike, so ``(q_u - z_u) * s == (q - z) * s``.

Every group-wise weight of a linear layer (a ``Transpose -> MatMul`` or a ``Gemm`` with ``transB=1``, as
``torch.onnx.export`` writes ``nn.Linear``) whose grid and group size the operator holds becomes one
``MatMulNBits`` (plus an ``Add`` for a ``Gemm``'s bias). The rest (Embedding and Conv weights, group sizes that
are not a power of two of at least 16, wider grids, layers read another way) keep the blocked
``DequantizeLinear`` form of the ``onnx`` artifact, and :func:`write` says which and why.

Example:
    >>> packed_nibbles(np.array([[1, 2, 3]], np.uint8)).tolist()  # low nibble first, a row padded to bytes
    [[33, 3]]
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from mqbench.deploy.comparison import ArtifactReport, HostReport, compare, host_verdict, run_as_loaded, run_ort
from mqbench.deploy.onnx_graph import all_names, consumers_of, initializer_map, ort_session, save_model, unique_name
from mqbench.deploy.qdq import BLOCKED_OPSET, at_opset, insert_qdq
from mqbench.nn.quantized.saturation import ORT_MLAS_AVX2
from mqbench.qparams import QParamTable, TensorQParams

if TYPE_CHECKING:
    from mqbench.deploy.comparison import VerifyRun
    from mqbench.deploy.context import DeployContext

__all__ = ["KEY", "SUFFIX", "packed_nibbles", "serve", "unsupported", "verify", "write"]

KEY = "matmulnbits_onnx"
SUFFIX = "_matmulnbits.onnx"
DOMAIN = "com.microsoft"
MIN_BLOCK = 16


def packed_nibbles(values: np.ndarray) -> np.ndarray:
    """Rows of 4-bit unsigned values packed two per byte, the first in the low nibble (a row's odd count padded
    with 0)."""
    rows = np.asarray(values, np.uint8).reshape(values.shape[0], -1)
    if rows.shape[1] % 2:
        rows = np.concatenate([rows, np.zeros((rows.shape[0], 1), np.uint8)], axis=1)
    return (rows[:, 0::2] | (rows[:, 1::2] << 4)).astype(np.uint8)


def container_bits(entry: TensorQParams) -> int | None:
    """The ``bits`` of the MatMulNBits that holds the entry's grid (4 or 8), or None."""
    for bits in (4, 8):
        low, high = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if entry.quant_min < 0 else (0, 2**bits - 1)
        if low <= entry.quant_min and entry.quant_max <= high:
            return bits
    return None


def unsupported(entry: TensorQParams, weight: np.ndarray | None) -> str | None:
    """Why a table entry cannot be a MatMulNBits weight, or None."""
    if entry.group_size is None:
        return "not group-wise"
    if weight is None or weight.ndim != 2:
        return "not the constant 2-D weight of a linear layer"
    size = entry.group_size
    if size < MIN_BLOCK or size & (size - 1):
        return f"group size {size} (MatMulNBits takes powers of two from {MIN_BLOCK})"
    if container_bits(entry) is None:
        return f"a {entry.bits}-bit grid [{entry.quant_min}, {entry.quant_max}] (MatMulNBits holds 4 or 8 bits)"
    return None


def _linear_readers(
    tensor: str, users: Mapping[str, list[onnx.NodeProto]]
) -> tuple[list[tuple[onnx.NodeProto, onnx.NodeProto | None]], str | None]:
    """The (MatMul or Gemm, Transpose or None) pairs that read weight ``tensor`` as a linear layer, or why not."""
    found: list[tuple[onnx.NodeProto, onnx.NodeProto | None]] = []
    readers = users.get(tensor, [])
    if not readers:
        return [], "read by no node"
    for node in readers:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type == "Transpose" and list(attrs.get("perm", [1, 0])) == [1, 0]:
            for matmul in users.get(node.output[0], []):
                if matmul.op_type != "MatMul" or list(matmul.input).index(node.output[0]) != 1:
                    return [], f"its transpose is read by {matmul.op_type} {matmul.name!r}"
                found.append((matmul, node))
            continue
        gemm_ok = (
            node.op_type == "Gemm"
            and list(node.input).index(tensor) == 1
            and attrs.get("transB", 0) == 1
            and attrs.get("transA", 0) == 0
            and float(attrs.get("alpha", 1.0)) == 1.0
            and float(attrs.get("beta", 1.0)) == 1.0
        )
        if not gemm_ok:
            return [], f"read by {node.op_type} {node.name!r} (MatMulNBits replaces x @ W.T)"
        found.append((node, None))
    return found, None


def _operands(entry: TensorQParams, weight: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """``B`` ``[N, blocks, blob]``, ``scales`` ``[N * blocks]`` and the packed zero points (None: all the default)."""
    assert entry.group_size is not None
    n, k = weight.shape
    size = entry.group_size
    blocks = -(-k // size)
    scale = entry.expanded(entry.scale.astype(np.float64), weight.shape)
    zero = entry.expanded(entry.zero_point.astype(np.float64), weight.shape)
    levels = np.clip(np.rint(weight.astype(np.float64) / scale) + zero, entry.quant_min, entry.quant_max)
    offset = 2 ** (bits - 1) if entry.quant_min < 0 else 0  # a signed grid on the unsigned container
    block_zero = entry.blocked(entry.zero_point.astype(np.int64), weight.shape) + offset  # [N, blocks]
    unsigned = np.full((n, blocks * size), 0, np.int64)
    unsigned[:, :k] = levels.astype(np.int64) + offset
    unsigned[:, k:] = block_zero[:, -1:]  # padding: the last block's zero point (dequantizes to 0)
    if bits == 4:
        packed = packed_nibbles(unsigned.reshape(n * blocks, size).astype(np.uint8)).reshape(n, blocks, size // 2)
    else:
        packed = unsigned.astype(np.uint8).reshape(n, blocks, size)
    scales = entry.blocked(entry.scale.astype(np.float32), weight.shape).reshape(-1)
    if np.all(block_zero == 2 ** (bits - 1)):
        return packed, scales, None
    zeros = packed_nibbles(block_zero.astype(np.uint8)).reshape(-1) if bits == 4 else block_zero.astype(np.uint8)
    return packed, scales, zeros.reshape(-1)


def _rewrite(model: onnx.ModelProto, table: QParamTable) -> tuple[set[str], dict[str, str]]:
    """Replace the linear layers of the group-wise weights MatMulNBits holds; (tensors done, tensor -> why not)."""
    graph = model.graph
    inits = initializer_map(graph)
    users = consumers_of(graph)
    taken = all_names(graph)
    done: set[str] = set()
    left: dict[str, str] = {}
    removed: set[int] = set()
    added: list[tuple[int, list[onnx.NodeProto]]] = []
    position = {id(node): i for i, node in enumerate(graph.node)}
    for tensor, entry in table.items():
        if entry.group_size is None:
            continue
        weight = numpy_helper.to_array(inits[tensor]) if tensor in inits else None
        why = unsupported(entry, weight)
        readers, not_linear = _linear_readers(tensor, users) if why is None else ([], None)
        why = why or not_linear
        if why is not None or weight is None:
            left[tensor] = why or "not a constant weight"
            continue
        bits = container_bits(entry)
        assert bits is not None and entry.group_size is not None
        packed, scales, zeros = _operands(entry, weight, bits)
        b_name, s_name = unique_name(f"{tensor}_packed", taken), unique_name(f"{tensor}_scales", taken)
        graph.initializer.extend([numpy_helper.from_array(packed, b_name), numpy_helper.from_array(scales, s_name)])
        inputs = [b_name, s_name]
        if zeros is not None:
            z_name = unique_name(f"{tensor}_zero_points", taken)
            graph.initializer.append(numpy_helper.from_array(zeros, z_name))
            inputs.append(z_name)
        n, k = weight.shape
        attrs = {"K": k, "N": n, "bits": bits, "block_size": entry.group_size, "accuracy_level": 0}
        for reader, transpose in readers:
            output = reader.output[0]
            nodes = []
            if reader.op_type == "Gemm" and len(reader.input) > 2 and reader.input[2]:
                product = unique_name(f"{output}_matmul", taken)
                nodes.append(
                    helper.make_node(
                        "MatMulNBits", [reader.input[0], *inputs], [product], reader.name, domain=DOMAIN, **attrs
                    )
                )
                nodes.append(helper.make_node("Add", [product, reader.input[2]], [output], f"{reader.name}_bias"))
            else:
                nodes.append(
                    helper.make_node(
                        "MatMulNBits", [reader.input[0], *inputs], [output], reader.name, domain=DOMAIN, **attrs
                    )
                )
            removed.add(id(reader))
            added.append((position[id(reader)], nodes))
            if transpose is not None:
                removed.add(id(transpose))
        done.add(tensor)
    if done:
        placed = {index: nodes for index, nodes in added}
        order: list[onnx.NodeProto] = []
        for i, node in enumerate(graph.node):
            if i in placed:
                order.extend(placed[i])
            elif id(node) not in removed:
                order.append(node)
        read = {name for node in order for name in node.input}
        kept = [init for init in graph.initializer if init.name not in done or init.name in read]
        del graph.node[:]
        graph.node.extend(order)
        del graph.initializer[:]
        graph.initializer.extend(kept)
        if not any(o.domain == DOMAIN for o in model.opset_import):
            model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    return done, left


def write(context: DeployContext) -> Path:
    """``{model_name}_matmulnbits.onnx``: the linear layers MatMulNBits holds as MatMulNBits, the other quantized
    tensors in the forms of the ``onnx`` artifact (a warning names the group-wise weights left so, and why)."""
    grouped = any(entry.group_size is not None for entry in context.table.values())
    model = at_opset(context.float_model, BLOCKED_OPSET) if grouped else copy.deepcopy(context.float_model)
    done, left = _rewrite(model, context.table)
    rest = QParamTable({t: e for t, e in context.table.items() if t not in done})
    model, _ = insert_qdq(model, rest)
    if left:
        shown = "; ".join(f"{tensor}: {why}" for tensor, why in list(left.items())[:6])
        more = f" and {len(left) - 6} more" if len(left) > 6 else ""
        warnings.warn(
            f"{KEY}: {len(left)} group-wise weight(s) stay blocked DequantizeLinear, not MatMulNBits ({shown}{more})",
            stacklevel=3,
        )
    path = context.path(SUFFIX)
    save_model(model, path)
    return path


def _exposed(model: onnx.ModelProto, result: Any) -> dict[str, str]:
    """The table's tensors whose dequantized values this file computes by the ``onnx`` artifact's names."""
    names = {o for node in model.graph.node for o in node.output}
    return {tensor: name for tensor, name in result.dequantized.items() if name in names}


def verify(result: Any, feeds: Mapping[str, np.ndarray], run: VerifyRun) -> ArtifactReport:
    """The MatMulNBits model on onnxruntime, as written and (``run.host``) as served: its outputs against the
    simulation's, and each tensor it still dequantizes by name (the weights MatMulNBits holds are inside it)."""
    path = result.artifacts[KEY]
    model = onnx.load(path)
    exposed = _exposed(model, result)
    args = (result.table, exposed, run, result.output_names)
    written = run_ort(model, feeds, list(exposed.values()) + list(result.output_names), optimize=False)
    written.update(run_as_loaded(path, feeds, optimize=False))
    report = compare(ArtifactReport(KEY, "onnxruntime MatMulNBits (as written)"), written, *args)
    if run.host:
        served = run_ort(model, feeds, list(exposed.values()), optimize=True)
        served.update(run_as_loaded(path, feeds, optimize=True))
        host = compare(HostReport(KEY, "onnxruntime MatMulNBits (optimized)"), served, *args)
        report.host = host_verdict(host, {}, ORT_MLAS_AVX2, "", run.tolerance)
    return report


def serve(result: Any) -> Callable[[Mapping[str, np.ndarray]], list[np.ndarray]]:
    """The MatMulNBits model as onnxruntime serves it (graph optimizations on)."""
    session = ort_session(result.artifacts[KEY], optimize=True)
    return lambda feeds: list(session.run(None, dict(feeds)))
