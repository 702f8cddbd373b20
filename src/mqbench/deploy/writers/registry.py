"""Each artifact format as one record: its key, its writer and, for a parameter file, its reader.

A writer is ``write(context) -> Path``: it writes one file into ``context.folder``. A reader is
``read(path, spec, float_model) -> QParamTable``: the quantization the backend applies, from the
file alone (plus the backend's defaults where the format leaves something implicit, and the
float ONNX model for which tensors are weights). A model format (``onnx``, ``qlinear_onnx``,
``openvino_onnx``) has a runner instead: ``run(result, feeds, run) -> ArtifactReport`` runs it on
its runtime and compares it with the simulation (:mod:`mqbench.deploy.comparison`), and a
``serve(result)`` that runs it as its runtime serves it (the deployed model's accuracy). ``FORMATS``
is the one table, which ``verify_deploy``, the deploy pipeline and ``register_deploy_function``
read; ``WRITERS`` and ``READERS`` are read-only views of it. A new format is one module with
``write`` (and ``read`` or ``verify``) plus one line here.

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

import numpy as np
import onnx

from mqbench.backends.spec import BackendSpec
from mqbench.deploy import qdq, qlinear
from mqbench.deploy.writers import (
    calib_cache,
    clip_ranges,
    compressed_tensors,
    genai,
    gguf,
    matmulnbits,
    nnie,
    openvino,
    ppl,
    snpe,
    stpu,
    tengine,
    vitis,
)
from mqbench.qparams import QParamTable

if TYPE_CHECKING:
    from mqbench.deploy.comparison import ArtifactReport, VerifyRun
    from mqbench.deploy.context import DeployContext, DeployResult

__all__ = ["FORMATS", "READERS", "WRITERS", "ArtifactFormat", "Reader", "Runner", "Server", "Writer"]

Writer = Callable[["DeployContext"], Path | None]
Reader = Callable[[str | Path, BackendSpec, onnx.ModelProto], QParamTable]
# run(result, feeds, run) -> ArtifactReport: the model artifact on its runtime, against the simulation
Runner = Callable[["DeployResult", Mapping[str, np.ndarray], "VerifyRun"], "ArtifactReport"]
# serve(result) -> run(feeds) -> outputs: the model as its runtime serves it (accuracy of the deployment)
Server = Callable[["DeployResult"], Callable[[Mapping[str, np.ndarray]], list[np.ndarray]]]


@dataclass(frozen=True)
class ArtifactFormat:
    """One artifact format: its key, how to write it, and how verification checks it.

    A parameter file has a ``read``er (verification rebuilds a Q/DQ model from the file alone);
    a model has a ``run``ner (verification runs it on its runtime). ``write`` is None for the
    models every deployment makes itself (the Q/DQ ``onnx``).
    """

    key: str
    write: Writer | None
    read: Reader | None = None
    run: Runner | None = None
    serve: Server | None = None
    serve_rank: int = 0  # among a deployment's served models, the highest rank is the backend's own
    description: str = ""


_FORMATS = [
    ArtifactFormat(
        "clip_ranges", clip_ranges.write, clip_ranges.read, description="TensorRT, TensorRT NLP, Academic (NLP)"
    ),
    ArtifactFormat("calib_cache", calib_cache.write, calib_cache.read, description="TensorRT, TensorRT NLP"),
    ArtifactFormat("encodings", snpe.write, snpe.read, description="SNPE"),
    ArtifactFormat("ppl_json", ppl.write, ppl.read, description="PPL W8A16, PPL CUDA"),
    ArtifactFormat("nnie_json", nnie.write, nnie.read, description="NNIE"),
    ArtifactFormat("vitis_json", vitis.write, vitis.read, description="Vitis"),
    ArtifactFormat("tengine_scale", tengine.write, tengine.read, description="Tengine uint8"),
    ArtifactFormat("stpu_json", stpu.write, stpu.read, description="STPU"),
    ArtifactFormat(
        "qlinear_onnx",
        qlinear.write,
        run=qlinear.verify,
        serve=qlinear.serve,
        serve_rank=1,
        description="ONNX QNN, or any backend with deploy_to_qlinear=True",
    ),
    ArtifactFormat(
        "openvino_onnx", openvino.write, run=openvino.verify, serve=openvino.serve, serve_rank=2, description="OpenVINO"
    ),
    ArtifactFormat(
        matmulnbits.KEY,
        matmulnbits.write,
        run=matmulnbits.verify,
        serve=matmulnbits.serve,
        serve_rank=1,
        description="the weight-only backends: onnxruntime's MatMulNBits for group-wise linear layers",
    ),
    ArtifactFormat(
        "onnx",
        None,
        run=qdq.verify,
        serve=qdq.serve,
        description="every backend: the standard Q/DQ model (the pipeline's)",
    ),
    ArtifactFormat(
        compressed_tensors.KEY,
        compressed_tensors.write,
        run=compressed_tensors.verify,
        serve=compressed_tensors.serve,
        description="weight-only backends, Hugging Face models: a compressed-tensors folder (vLLM, transformers)",
    ),
    ArtifactFormat(
        gguf.KEY,
        gguf.write,
        run=gguf.verify,
        serve=gguf.serve,
        description="weight-only backends, Llama-architecture models in groups of 32: GGUF (llama.cpp)",
    ),
    ArtifactFormat(
        genai.KEY,
        genai.write,
        run=genai.verify,
        serve=genai.serve,
        description="weight-only backends, Llama models: an ONNX decoder with a KV cache (onnxruntime-genai)",
    ),
]
FORMATS: Mapping[str, ArtifactFormat] = MappingProxyType({f.key: f for f in _FORMATS})
WRITERS: Mapping[str, Writer] = MappingProxyType({key: f.write for key, f in FORMATS.items() if f.write is not None})
READERS: Mapping[str, Reader] = MappingProxyType({key: f.read for key, f in FORMATS.items() if f.read is not None})
