"""Each artifact format as one record: its key, its writer and, for a parameter file, its reader.

A writer is ``write(context) -> Path``: it writes one file into ``context.folder``. A reader is
``read(path, spec, float_model) -> QParamTable``: the quantization the backend applies, from the
file alone (plus the backend's defaults where the format leaves something implicit, and the
float ONNX model for which tensors are weights). A model format (``qlinear_onnx``,
``openvino_onnx``) has no reader: ``verify_deploy`` runs it on its runtime. ``FORMATS`` is the one
table; ``WRITERS`` and ``READERS`` are read-only views of it. A new format is one module with
``write`` (and ``read``) plus one line here.

Example:
    >>> from mqbench.backends import ParamsTable
    >>> from mqbench.deploy.writers import READERS, WRITERS
    >>> sorted(ParamsTable["tensorrt"].deploy) == sorted(k for k in WRITERS if k in ("clip_ranges", "calib_cache"))
    True
    >>> set(READERS) <= set(WRITERS)
    True
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
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

__all__ = ["FORMATS", "READERS", "WRITERS", "ArtifactFormat", "Reader", "Writer"]

Writer = Callable[["DeployContext"], Path]
Reader = Callable[[str | Path, BackendSpec, onnx.ModelProto], QParamTable]


@dataclass(frozen=True)
class ArtifactFormat:
    """One artifact format: the key a ``BackendSpec.deploy`` lists, how to write it, how to read it back."""

    key: str
    write: Writer
    read: Reader | None = None  # None: a model that verify_deploy runs on its runtime
    description: str = ""


_FORMATS = [
    ArtifactFormat("clip_ranges", clip_ranges.write, clip_ranges.read, "TensorRT, TensorRT NLP, Academic (NLP)"),
    ArtifactFormat("calib_cache", calib_cache.write, calib_cache.read, "TensorRT, TensorRT NLP"),
    ArtifactFormat("encodings", snpe.write, snpe.read, "SNPE"),
    ArtifactFormat("ppl_json", ppl.write, ppl.read, "PPL W8A16, PPL CUDA"),
    ArtifactFormat("nnie_json", nnie.write, nnie.read, "NNIE"),
    ArtifactFormat("vitis_json", vitis.write, vitis.read, "Vitis"),
    ArtifactFormat("tengine_scale", tengine.write, tengine.read, "Tengine uint8"),
    ArtifactFormat("stpu_json", stpu.write, stpu.read, "STPU"),
    ArtifactFormat("qlinear_onnx", qlinear.write, None, "ONNX QNN, or any backend with deploy_to_qlinear=True"),
    ArtifactFormat("openvino_onnx", openvino.write, None, "OpenVINO"),
]
FORMATS: Mapping[str, ArtifactFormat] = MappingProxyType({f.key: f for f in _FORMATS})
WRITERS: Mapping[str, Writer] = MappingProxyType({key: f.write for key, f in FORMATS.items()})
READERS: Mapping[str, Reader] = MappingProxyType({key: f.read for key, f in FORMATS.items() if f.read is not None})
