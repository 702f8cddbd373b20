"""TensorRT calibration cache (``{model_name}_calib_cache.txt``): activation scales in TensorRT's text format.

The file is what a TensorRT ``IInt8Calibrator`` reads back from ``readCalibrationCache``: a
header line naming the TensorRT version and calibrator (``TRT-8600-EntropyCalibration2``), then
one line per activation tensor, ``tensor: <hex>``, where ``<hex>`` is the big-endian IEEE
float32 bit pattern of the tensor's scale in 8 lowercase hex digits. TensorRT's scale is
``amax / 127`` on the symmetric grid [-127, 127]; the table's activation scale is written as it
is, so its bits are kept exactly (on the explicit grid [-128, 127], the -128 level is -127 in implicit int8).

Weights are not in the file: the format has no place for them (TensorRT computes weight scales
itself from the weights, or takes them from Q/DQ nodes or the clip ranges). Only symmetric,
signed, linear activations can be written; anything else raises ValueError.

Reading back (:func:`read`) gives one activation entry per line: the scale from the bits, zero
point 0 and the integer range of the backend's activation scheme.

Example:
    >>> import tempfile, onnx
    >>> from pathlib import Path
    >>> from mqbench.backends import ParamsTable
    >>> from mqbench.deploy.writers.calib_cache import read, scale_hex
    >>> scale_hex(0.5), scale_hex(0.02021615020930767)
    ('3f000000', '3ca59c57')
    >>> with tempfile.TemporaryDirectory() as folder:
    ...     path = Path(folder) / "m_calib_cache.txt"
    ...     _ = path.write_text("TRT-8600-EntropyCalibration2\\nx: 3f000000\\n")
    ...     table = read(path, ParamsTable["tensorrt"], onnx.ModelProto())
    >>> entry = table["x"]
    >>> float(entry.scale[0]), entry.quant_min, entry.quant_max, entry.kind
    (0.5, -128, 127, 'activation')
"""

from __future__ import annotations

import re
import struct
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnx

from mqbench.backends.spec import BackendSpec
from mqbench.deploy.writers.common import make_entry, scheme_for
from mqbench.qparams import QParamTable, TensorQParams

if TYPE_CHECKING:
    from mqbench.deploy.context import DeployContext

__all__ = ["HEADER", "SUFFIX", "read", "scale_hex", "write"]

SUFFIX = "_calib_cache.txt"
HEADER = "TRT-8600-EntropyCalibration2"

_HEX = re.compile(r"[0-9a-fA-F]{8}")


def scale_hex(scale: float) -> str:
    """The big-endian float32 bit pattern of ``scale`` as 8 lowercase hex digits (TensorRT's cache value)."""
    return struct.pack(">f", np.float32(scale)).hex()


def _check(tensor: str, entry: TensorQParams) -> None:
    if any(c in tensor for c in "\r\n"):
        raise ValueError(f"tensor name {tensor!r} has a line break, which a calibration cache line cannot hold")
    if entry.grid != "linear" or entry.per_channel or not entry.symmetric or not entry.signed:
        raise ValueError(
            f"tensor {tensor!r}: a TensorRT calibration cache holds one symmetric signed scale per activation; "
            f"this entry has grid {entry.grid!r}, zero point {entry.zero_point.tolist()} and range "
            f"[{entry.quant_min}, {entry.quant_max}]"
        )


def write(context: DeployContext) -> Path:
    """Write ``{model_name}_calib_cache.txt``: the header, then ``tensor: <hex scale>`` per activation."""
    lines = [HEADER]
    for tensor, entry in context.table.activations().items():
        _check(tensor, entry)
        lines.append(f"{tensor}: {scale_hex(float(entry.scale[0]))}")
    path = context.path(SUFFIX)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def read(path: str | Path, spec: BackendSpec, float_model: onnx.ModelProto) -> QParamTable:
    """The activation entries of a calibration cache (scale from the bits, the backend's activation range)."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"{path}: cannot read the calibration cache ({error})") from None
    if not lines or not lines[0].startswith("TRT-"):
        raise ValueError(f"{path}: a TensorRT calibration cache starts with a 'TRT-...' header line")
    scheme = scheme_for(spec, "activation", path)
    entries: dict[str, TensorQParams] = {}
    for number, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        tensor, sep, value = line.rpartition(":")
        value = value.strip()
        if not sep or not tensor or not _HEX.fullmatch(value):
            raise ValueError(f"{path}, line {number}: expected 'tensor: <8 hex digits>', got {line!r}")
        if tensor in entries:
            raise ValueError(f"{path}, line {number}: tensor {tensor!r} appears twice")
        (scale,) = struct.unpack(">f", bytes.fromhex(value))
        entries[tensor] = make_entry(
            tensor,
            path,
            scale=np.array([scale], np.float32),
            zero_point=np.array([0], np.int32),
            quant_min=scheme.quant_min,
            quant_max=scheme.quant_max,
            kind="activation",
        )
    return QParamTable(entries)
