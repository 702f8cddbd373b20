"""Artifact key -> writer, and parameter-file key -> reader, for the formats in this package.

A writer is ``write(context) -> Path``: it writes one file into ``context.folder``. A reader is
``read(path, spec, float_model) -> QParamTable``: the quantization the backend applies, from the
file alone (plus the backend's defaults where the format leaves something implicit, and the
float ONNX model for which tensors are weights). Both mappings are read-only.

Example:
    >>> from mqbench.backends import ParamsTable
    >>> from mqbench.deploy.writers import READERS, WRITERS
    >>> sorted(ParamsTable["tensorrt"].deploy) == sorted(k for k in WRITERS if k in ("clip_ranges", "calib_cache"))
    True
    >>> set(READERS) <= set(WRITERS)
    True
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING

import onnx

from mqbench.backends.spec import BackendSpec
from mqbench.deploy import qlinear
from mqbench.deploy.writers import calib_cache, clip_ranges, nnie, openvino, ppl, snpe, stpu, tengine, vitis
from mqbench.qparams import QParamTable

if TYPE_CHECKING:
    from mqbench.deploy.context import DeployContext

__all__ = ["READERS", "WRITERS", "Reader", "Writer"]

Writer = Callable[["DeployContext"], Path]
Reader = Callable[[str | Path, BackendSpec, onnx.ModelProto], QParamTable]

_writers: dict[str, Writer] = {
    "clip_ranges": clip_ranges.write,  # TensorRT, TensorRT NLP, Academic, Academic NLP
    "calib_cache": calib_cache.write,  # TensorRT, TensorRT NLP
    "encodings": snpe.write,  # SNPE
    "ppl_json": ppl.write,  # PPL W8A16, PPL CUDA
    "nnie_json": nnie.write,  # NNIE
    "vitis_json": vitis.write,  # Vitis
    "tengine_scale": tengine.write,  # Tengine uint8
    "stpu_json": stpu.write,  # STPU
    "qlinear_onnx": qlinear.write,  # ONNX QNN, or any backend with deploy_to_qlinear=True
    "openvino_onnx": openvino.write,  # OpenVINO
}
_readers: dict[str, Reader] = {
    "clip_ranges": clip_ranges.read,
    "calib_cache": calib_cache.read,
    "encodings": snpe.read,
    "ppl_json": ppl.read,
    "nnie_json": nnie.read,
    "vitis_json": vitis.read,
    "tengine_scale": tengine.read,
    "stpu_json": stpu.read,
}

WRITERS = MappingProxyType(_writers)
READERS = MappingProxyType(_readers)
