"""Tengine quantization table (``{model_name}_for_tengine.scale``): ``tensor scale zero_point`` per line.

The text table that Tengine's quantization tool reads for uint8 models: one line per tensor,
its name, scale (a float32 value in the shortest decimal form that reads back to the same
bits) and zero point, separated by single spaces (MQBench's file name and layout)::

    x 0.018290115520358086 115
    conv1.weight 0.0026034784968942404 128

Weights and activations alike are listed, in the table's (graph) order. A per-channel weight
is written as one line per output channel, in channel order, each repeating the tensor name;
the reader gathers consecutive lines of the same name along axis 0 (axis 1 for a ConvTranspose
weight). Names cannot contain whitespace (writing one raises ValueError).

The format has no integer range: the reader takes it from the backend's scheme (weight scheme
for initializers of the float model, activation scheme otherwise), and the writer raises
ValueError for an entry whose range differs from that scheme, so reading back is exact. The
only loss is representational: a per-channel weight with a single channel comes back per tensor.

Example:
    >>> import numpy as np
    >>> from mqbench.qparams import TensorQParams
    >>> from mqbench.deploy.writers.tengine import scale_lines
    >>> scale_lines("w", TensorQParams(np.array([0.5, 0.25]), np.array([128, 127]), 0, 255, axis=0))
    ['w 0.5 128', 'w 0.25 127']
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnx

from mqbench.backends.spec import BackendSpec
from mqbench.deploy.writers.common import ModelTensors, f32, make_entry, scheme_for
from mqbench.qparams import QParamTable, TensorQParams

if TYPE_CHECKING:
    from mqbench.deploy.context import DeployContext

__all__ = ["SUFFIX", "read", "scale_lines", "write"]

SUFFIX = "_for_tengine.scale"


def scale_lines(tensor: str, entry: TensorQParams) -> list[str]:
    """The lines of one entry: ``tensor scale zero_point``, one per channel."""
    if not tensor or any(c.isspace() for c in tensor):
        raise ValueError(f"tensor name {tensor!r} is empty or has whitespace, which a Tengine scale line cannot hold")
    if entry.grid != "linear":
        raise ValueError(f"tensor {tensor!r}: Tengine scales describe linear grids, not the {entry.grid!r} grid")
    return [
        f"{tensor} {f32(scale)!r} {int(zero_point)}"
        for scale, zero_point in zip(entry.scale.tolist(), entry.zero_point.tolist(), strict=True)
    ]


def write(context: DeployContext) -> Path:
    """Write ``{model_name}_for_tengine.scale`` (every table entry; the ranges must be the backend's)."""
    lines: list[str] = []
    for tensor, entry in context.table.items():
        scheme = scheme_for(context.spec, entry.kind, context.path(SUFFIX))
        if (entry.quant_min, entry.quant_max) != scheme.quant_range:
            raise ValueError(
                f"tensor {tensor!r}: range [{entry.quant_min}, {entry.quant_max}] is not the backend's "
                f"{entry.kind} range {list(scheme.quant_range)}, and a Tengine scale file cannot say so"
            )
        lines.extend(scale_lines(tensor, entry))
    path = context.path(SUFFIX)
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def read(path: str | Path, spec: BackendSpec, float_model: onnx.ModelProto) -> QParamTable:
    """The quantization a Tengine scale file describes, with the backend's integer ranges (exact)."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"{path}: cannot read the scale file ({error})") from None
    groups: dict[str, tuple[list[float], list[int]]] = {}
    previous = None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        fields = line.split()
        try:
            if len(fields) != 3:
                raise ValueError
            tensor, scale, zero_point = fields[0], float(fields[1]), int(fields[2])
        except ValueError:
            raise ValueError(f"{path}, line {number}: expected 'tensor scale zero_point', got {line!r}") from None
        if not math.isfinite(scale):
            raise ValueError(f"{path}, line {number}: the scale of tensor {tensor!r} is not finite")
        if tensor in groups and tensor != previous:
            raise ValueError(f"{path}, line {number}: the lines of tensor {tensor!r} are not consecutive")
        scales, zero_points = groups.setdefault(tensor, ([], []))
        scales.append(scale)
        zero_points.append(zero_point)
        previous = tensor
    model = ModelTensors(float_model)
    entries: dict[str, TensorQParams] = {}
    for tensor, (scales, zero_points) in groups.items():
        kind = model.kind(tensor)
        scheme = scheme_for(spec, kind, path)
        entries[tensor] = make_entry(
            tensor,
            path,
            scale=np.array(scales, np.float32),
            zero_point=np.array(zero_points, np.int64),
            quant_min=scheme.quant_min,
            quant_max=scheme.quant_max,
            axis=model.channel_axis(tensor, len(scales), path) if len(scales) > 1 else None,
            kind=kind,
        )
    return QParamTable(entries)
