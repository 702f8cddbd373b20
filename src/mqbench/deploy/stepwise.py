"""MQBench's step-by-step deployment: deploy functions registered per backend, run in order.

MQBench deploys by running the functions registered for a backend with
``@register_deploy_function(BackendType.X)``, each called as ``fn(model, **kwargs)``:
``convert_merge_bn``, ``convert_onnx`` (the ONNX model with quantization nodes, at
``onnx_model_path``), then a ``deploy_qparams_*`` step that calls
``remove_fakequantize_and_collect_params(onnx_model_path, model_name, backend)`` to write the
float model and the backend's parameter file. This module gives those names their meaning on
this package's pipeline:

* ``BACKEND_DEPLOY_FUNCTION``: backend -> the functions run in order (the built-in backends list
  MQBench's three; a function registered MQBench's way is appended).
* :func:`remove_fakequantize_and_collect_params`: for an ONNX model written by this package's
  ``convert_onnx`` or ``convert_deploy`` (its Q/DQ model), writes ``{model_name}_deploy_model.onnx``
  and the backend's parameter files beside it; for a backend with no built-in format,
  ``{model_name}_clip_ranges.json`` = ``{backend: {tensor: {scale, zero_point, quant_min,
  quant_max, axis, kind, round_mode, ...}}}``, which ``verify_deploy`` reads back.

``convert_deploy`` runs the built-in steps as its own pipeline and calls the other functions
afterwards with the merged model and MQBench's keyword arguments (``onnx_model_path``,
``model_name``, ``output_path``, ``input_shape_dict``, ``dummy_input``, ``deploy_to_qlinear``);
the files they write become artifacts of the deployment.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx

from mqbench.backends.registry import backend_key, resolve_backend
from mqbench.deploy.context import DeployContext
from mqbench.deploy.onnx_graph import save_model
from mqbench.deploy.writers import WRITERS
from mqbench.deploy.writers.common import write_json
from mqbench.qparams import QParamTable

__all__ = [
    "BACKEND_DEPLOY_FUNCTION",
    "MQBENCH_BACKEND_NAMES",
    "BackendFunctions",
    "LinearQuantizer_process",
    "NNIE_process",
    "ONNXQLinearPass",
    "ONNXQNNPass",
    "OPENVINO_process",
    "STPU_process",
    "Tengine_process",
    "forget_export",
    "remember_export",
    "remove_fakequantize_and_collect_params",
    "remove_fakequantize_and_collect_params_nnie",
    "remove_fakequantize_and_collect_params_stpu",
    "remove_fakequantize_and_collect_params_tengine",
    "replace_fakequantize_and_collect_params_openvino",
    "wants_model_and_kwargs",
]

# The backend strings MQBench's deploy functions pass, and the backend each one is here.
MQBENCH_BACKEND_NAMES = {"ppl": "pplw8a16", "ppl-cuda": "pplcuda", "tvm": "onnx_qnn", "tengine": "tengine_u8"}
GENERIC_SUFFIX = "_clip_ranges.json"


class BackendFunctions(MutableMapping[Any, list[Callable[..., Any]]]):
    """Backend (a BackendType or its name, any case) -> the deploy functions run for it, in order."""

    def __init__(self) -> None:
        self._lists: dict[str, list[Callable[..., Any]]] = {}

    def __getitem__(self, backend: Any) -> list[Callable[..., Any]]:
        return self._lists[backend_key(backend)]

    def __setitem__(self, backend: Any, functions: list[Callable[..., Any]]) -> None:
        self._lists[backend_key(backend)] = list(functions)

    def __delitem__(self, backend: Any) -> None:
        del self._lists[backend_key(backend)]

    def __iter__(self) -> Iterator[str]:
        return iter(self._lists)

    def __len__(self) -> int:
        return len(self._lists)

    def append(self, backend: Any, function: Callable[..., Any]) -> None:
        functions = self._lists.setdefault(backend_key(backend), [])
        if function not in functions:
            functions.append(function)


BACKEND_DEPLOY_FUNCTION = BackendFunctions()


def wants_model_and_kwargs(function: Callable[..., Any]) -> bool:
    """Whether ``function`` is a deploy function written MQBench's way, ``fn(model, **kwargs)``."""
    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):
        return False
    return any(p.kind is p.VAR_KEYWORD for p in parameters)


@dataclass
class _Export:
    float_model: onnx.ModelProto
    qdq_model: onnx.ModelProto
    table: QParamTable
    input_names: list[str]
    output_names: list[str]


_EXPORTS: dict[str, _Export] = {}


def _path_key(path: str | Path) -> str:
    return str(Path(path).resolve())


def remember_export(
    path: str | Path,
    float_model: onnx.ModelProto,
    qdq_model: onnx.ModelProto,
    table: QParamTable,
    input_names: list[str],
    output_names: list[str],
) -> None:
    """Record what the Q/DQ model written at ``path`` was stripped from (for the steps that read it)."""
    _EXPORTS[_path_key(path)] = _Export(float_model, qdq_model, table, list(input_names), list(output_names))


def forget_export(path: str | Path) -> None:
    _EXPORTS.pop(_path_key(path), None)


def _write_generic(context: DeployContext) -> Path:
    section = {}
    for tensor, entry in context.table.items():
        values = entry.to_dict()
        values.pop("consumers", None)
        values["round_mode"] = "half_to_even"
        section[tensor] = values
    return write_json(context.path(GENERIC_SUFFIX), {context.spec.name: section})


def remove_fakequantize_and_collect_params(
    onnx_path: str | Path, model_name: str, backend: Any = "tensorrt"
) -> list[str]:
    """Write ``{model_name}_deploy_model.onnx`` and ``backend``'s parameter files beside ``onnx_path``.

    ``onnx_path`` is the ONNX model with quantization nodes that this package's ``convert_onnx(...,
    onnx_model_path=...)`` or ``convert_deploy`` wrote (MQBench's deploy step order). ``backend``
    is a backend name, a BackendType or one of MQBench's strings (``"ppl"``, ``"ppl-cuda"``,
    ...). Returns the paths written.
    """
    export = _EXPORTS.get(_path_key(onnx_path))
    if export is None:
        raise ValueError(
            f"{str(onnx_path)!r} is not an ONNX model this process exported with quantization nodes: write it with "
            "mqbench.convert_deploy.convert_onnx(model, input_shape_dict, dummy_input, onnx_model_path=...) first, "
            "or deploy in one call with convert_deploy(model, backend, ...)"
        )
    name = backend.value if hasattr(backend, "value") else backend
    spec = resolve_backend(MQBENCH_BACKEND_NAMES.get(name, name) if isinstance(name, str) else name)
    folder = Path(onnx_path).parent
    context = DeployContext(
        spec,
        model_name,
        folder,
        export.float_model,
        export.qdq_model,
        export.table,
        export.input_names,
        export.output_names,
    )
    written = [save_model(export.float_model, context.path("_deploy_model.onnx"))]
    keys = [key for key in spec.deploy if key in WRITERS]
    if keys:
        written += [str(WRITERS[key](context)) for key in keys]
    else:
        written.append(str(_write_generic(context)))
    return written


class _Process:
    """MQBench's per-format ``*_process`` classes: ``remove_fakequantize_and_collect_params`` for one backend."""

    backend = "tensorrt"

    def remove_fakequantize_and_collect_params(
        self, onnx_path: str | Path, model_name: str, backend: Any = None
    ) -> list[str]:
        return remove_fakequantize_and_collect_params(onnx_path, model_name, backend or self.backend)


class LinearQuantizer_process(_Process):  # noqa: N801  (MQBench's name)
    """Linear quantization formats (``backend``: tensorrt, snpe, ppl, vitis, ppl-cuda or a registered one)."""


class NNIE_process(_Process):  # noqa: N801
    backend = "nnie"


class Tengine_process(_Process):  # noqa: N801
    backend = "tengine_u8"


class STPU_process(_Process):  # noqa: N801
    backend = "stpu"


class OPENVINO_process(_Process):  # noqa: N801
    """OpenVINO: MQBench replaces the quantization nodes with OpenVINO's FakeQuantize (``_openvino.onnx`` here)."""

    backend = "openvino"

    def replace_fakequantize_and_collect_params(self, onnx_path: str | Path, model_name: str) -> list[str]:
        return remove_fakequantize_and_collect_params(onnx_path, model_name, self.backend)


def remove_fakequantize_and_collect_params_nnie(onnx_path: str | Path, model_name: str) -> list[str]:
    return remove_fakequantize_and_collect_params(onnx_path, model_name, "nnie")


def remove_fakequantize_and_collect_params_tengine(onnx_path: str | Path, model_name: str) -> list[str]:
    return remove_fakequantize_and_collect_params(onnx_path, model_name, "tengine_u8")


def remove_fakequantize_and_collect_params_stpu(onnx_path: str | Path, model_name: str) -> list[str]:
    return remove_fakequantize_and_collect_params(onnx_path, model_name, "stpu")


def replace_fakequantize_and_collect_params_openvino(onnx_path: str | Path, model_name: str) -> list[str]:
    return remove_fakequantize_and_collect_params(onnx_path, model_name, "openvino")


class ONNXQLinearPass:
    """MQBench's pass writing onnxruntime's QLinear model from the ONNX model at ``onnx_model_path``."""

    def __init__(self, onnx_model_path: str | Path) -> None:
        self.onnx_model_path = onnx_model_path

    def run(self, model_name: str | None = None) -> str:
        """Write ``{model_name}_qlinear.onnx`` (default name: the ONNX file's stem) beside it; its path."""
        name = model_name or Path(self.onnx_model_path).stem
        written = remove_fakequantize_and_collect_params(self.onnx_model_path, name, "onnx_qnn")
        return next(path for path in written if path.endswith("_qlinear.onnx"))


ONNXQNNPass = ONNXQLinearPass  # MQBench's ONNX_QNN (TVM) pass writes the same QLinear operators
