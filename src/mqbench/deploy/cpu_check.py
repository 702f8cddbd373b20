"""Whether this host's int8 CPU kernels could run a deployment differently from the simulation.

On an x86 CPU without VNNI (``host_facts()["int8_pairs_saturate"]``) onnxruntime and OpenVINO sum
each two adjacent u8 x s8 products in a saturating 16-bit register (see
:mod:`mqbench.nn.quantized.saturation`). Activations reach 255, so a pair of weights can saturate
only when ``255 * (|w0| + |w1|) > 32767``, i.e. ``|w0| + |w1| > 128``: :func:`saturating_weights`
finds such pairs from the weights alone (in onnxruntime's pairing, the finer one), and
:func:`cpu_warning` says so for the artifacts a CPU runtime serves, naming the remedy.
``verify_deploy`` then measures what actually differs on real inputs.

Example:
    >>> import numpy as np
    >>> from mqbench.qparams import QParamTable, TensorQParams
    >>> w = np.array([[[[120.0]], [[100.0]]]], np.float32)      # one 1x1 conv, two input channels
    >>> table = QParamTable({"w": TensorQParams(np.array([1.0]), np.array([0]), -128, 127, kind="weight")})
    >>> saturating_weights(table, {"w": w})
    ['w']
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from mqbench.qparams import QParamTable

__all__ = ["CPU_ARTIFACTS", "cpu_warning", "saturating_weights"]

CPU_ARTIFACTS = ("qlinear_onnx", "openvino_onnx")  # always served by a CPU runtime
_PAIR_LIMIT = 128  # 255 * 128 = 32640 <= 32767 < 255 * 129


def saturating_weights(table: QParamTable, weights: Mapping[str, np.ndarray]) -> list[str]:
    """Weight tensors with a pair of adjacent integers whose magnitudes sum beyond 128."""
    found = []
    for tensor, entry in table.items():
        value = weights.get(tensor)
        if entry.kind != "weight" or entry.grid != "linear" or value is None or value.ndim < 2:
            continue
        if entry.quant_min >= 0 or max(-entry.quant_min, entry.quant_max) <= _PAIR_LIMIT // 2:
            continue  # unsigned weights run on u8 x u8 kernels; a 7-bit grid cannot saturate
        scale = np.asarray(entry.scale, np.float64).reshape(-1)
        if entry.axis is not None and scale.size > 1:
            shape = [1] * value.ndim
            shape[entry.axis % value.ndim] = -1
            scale = scale.reshape(shape)
        q = np.abs(np.rint(value.astype(np.float64) / scale))  # symmetric: zero point 0
        # conv (out, in, *kernel): onnxruntime pairs along (*kernel, in), channel innermost; a matrix is
        # Gemm's (out, in) or MatMul's (in, out): either axis may be the reduction
        candidates = [np.moveaxis(q, 1, -1).reshape(q.shape[0], -1)] if value.ndim > 2 else [q, q.T]
        if any(_pairs_exceed(rows) for rows in candidates):
            found.append(tensor)
    return found


def _pairs_exceed(rows: np.ndarray) -> bool:
    if rows.shape[1] % 2:
        rows = np.concatenate([rows, np.zeros((rows.shape[0], 1))], axis=1)
    return bool(np.any(rows[:, 0::2] + rows[:, 1::2] > _PAIR_LIMIT))


def cpu_warning(
    artifacts: Sequence[str],
    served_on_cpu: bool,
    table: QParamTable,
    weights: Mapping[str, np.ndarray],
    facts: Mapping[str, Any],
) -> str | None:
    """A warning for the CPU-served ``artifacts`` this host's kernels may run differently; None if there is none."""
    if not facts.get("int8_pairs_saturate"):
        return None
    served = [key for key in artifacts if key in CPU_ARTIFACTS or (key == "onnx" and served_on_cpu)]
    if not served:
        return None
    layers = saturating_weights(table, weights)
    if not layers:
        return None
    shown = ", ".join(layers[:4]) + (f" and {len(layers) - 4} more" if len(layers) > 4 else "")
    qlinear = ' (for the QLinear graph also qlinear_weight_type="uint8")' if "qlinear_onnx" in served else ""
    return (
        f"this CPU has no VNNI: its int8 kernels sum each two u8 x s8 products in a saturating 16-bit register, "
        f"and {len(layers)} weight tensor(s) have pairs that can exceed it ({shown}); onnxruntime / OpenVINO on "
        f"this host may run {', '.join(served)} differently from the simulation. Prepare with "
        f'prepare_custom_config_dict={{"reduce_range": True}} (7-bit weights){qlinear}; verify_deploy measures it'
    )
