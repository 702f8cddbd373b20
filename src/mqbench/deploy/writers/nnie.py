"""HiSilicon NNIE parameters (``{model_name}_gfpq_param_dict.json``): the ``gfpq_param`` of every quantized tensor.

NNIE quantizes on a fixed 8-bit logarithmic grid (see
:func:`mqbench.fake_quantize.nnie.nnie_quantize`) that one number describes: ``data_max``,
the largest magnitude of the tensor, which the NNIE mapper takes as the tensor's
``gfpq_param``. Layout::

    {"nnie": {"gfpq_param_dict": {tensor: data_max, weight: data_max, ...}}}

(MQBench's file name and layout).

Every table entry is written, weights included (a weight's ``data_max`` is its largest
magnitude). ``data_max`` is a float32 value, written exactly.

Reading back (:func:`read`) is exact: ``grid="log"`` entries with that ``data_max``, the
informative scale ``2 ** (z / 16)`` with ``z = round(16 log2(data_max)) - 127`` (what
:class:`~mqbench.fake_quantize.NNIEFakeQuantize` reports), zero point 0, and the integer range
of the backend's weight scheme for initializers of the float model, of its activation scheme
otherwise. Linear-grid entries have no NNIE form; writing one raises ValueError.

Example:
    >>> import numpy as np
    >>> from mqbench.deploy.writers.nnie import log_scale
    >>> z = round(16 * np.log2(8.0)) - 127
    >>> z, bool(log_scale(8.0)[0] == np.float32(2 ** (z / 16)))
    (-79, True)
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnx
import torch

from mqbench.backends.spec import BackendSpec
from mqbench.deploy.writers.common import (
    ModelTensors,
    f32,
    get_scalar,
    get_section,
    load_json,
    make_entry,
    scheme_for,
    write_json,
)
from mqbench.grids import exponent_offset
from mqbench.qparams import QParamTable, TensorQParams

if TYPE_CHECKING:
    from mqbench.deploy.context import DeployContext

__all__ = ["SUFFIX", "log_scale", "read", "write"]

SUFFIX = "_gfpq_param_dict.json"


def log_scale(data_max: float) -> np.ndarray:
    """The informative scale ``2 ** (z / 16)`` of the log grid of ``data_max``, as NNIEFakeQuantize computes it."""
    z = exponent_offset(torch.tensor([data_max], dtype=torch.float32))
    return torch.pow(2.0, z / 16.0).float().numpy()


def write(context: DeployContext) -> Path:
    """Write ``{model_name}_gfpq_param_dict.json``: ``data_max`` of every table entry."""
    params: dict[str, float] = {}
    for tensor, entry in context.table.items():
        if entry.grid != "log" or entry.data_max is None:
            raise ValueError(
                f"tensor {tensor!r}: NNIE's gfpq_param describes the log grid, not the {entry.grid!r} grid"
            )
        params[tensor] = f32(entry.data_max)
    return write_json(context.path(SUFFIX), {"nnie": {"gfpq_param_dict": params}})


def read(path: str | Path, spec: BackendSpec, float_model: onnx.ModelProto) -> QParamTable:
    """The log-grid entries of an NNIE parameter file (exact)."""
    params = get_section(get_section(load_json(path), "nnie", path), "gfpq_param_dict", path)
    model = ModelTensors(float_model)
    entries: dict[str, TensorQParams] = {}
    for tensor, value in params.items():
        data_max = f32(get_scalar({"gfpq_param": value}, "gfpq_param", tensor, path))
        if data_max < 0:
            raise ValueError(f"{path}: the gfpq_param of tensor {tensor!r} must not be negative, got {value!r}")
        kind = model.kind(tensor)
        scheme = scheme_for(spec, kind, path)
        entries[tensor] = make_entry(
            tensor,
            path,
            scale=log_scale(data_max),
            zero_point=np.array([0], np.int32),
            quant_min=scheme.quant_min,
            quant_max=scheme.quant_max,
            kind=kind,
            grid="log",
            data_max=data_max,
        )
    return QParamTable(entries)
