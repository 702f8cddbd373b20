"""What a deployment step reads (:class:`DeployContext`) and what a deployment wrote (:class:`DeployResult`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx
from torch import nn

from mqbench.backends.registry import resolve_backend
from mqbench.backends.spec import BackendSpec
from mqbench.qparams import QParamTable

__all__ = ["DeployContext", "DeployResult", "DeployStep"]


@dataclass
class DeployResult:
    """What :func:`convert_deploy` wrote: ``artifacts`` (key -> path) and ``params`` (tensor -> qparams dict)."""

    backend: str
    model_name: str
    artifacts: dict[str, str]
    table: QParamTable
    input_names: list[str]
    output_names: list[str]
    dequantized: dict[str, str] = field(default_factory=dict)  # tensor -> its dequantized name in `onnx`
    spec: BackendSpec | None = field(default=None, repr=False, compare=False)  # the backend deployed for
    # how the model is called on the inputs (a pytree spec of its positional arguments; None: one tensor each)
    input_structure: Any = field(default=None, repr=False, compare=False)

    @property
    def backend_spec(self) -> BackendSpec:
        """The spec deployed for: the one ``convert_deploy`` was given (a spec need not be registered), else the
        registered backend of that name."""
        if self.spec is not None:
            return self.spec
        return resolve_backend(self.backend)

    @property
    def params(self) -> dict[str, dict[str, Any]]:
        """The per-tensor quantization parameters as plain dicts (``table.to_dict()``)."""
        return self.table.to_dict()

    def __repr__(self) -> str:
        return f"DeployResult({self.backend!r}, artifacts={sorted(self.artifacts)}, {self.table!r})"


@dataclass
class DeployContext:
    """Everything a deploy step may read; a step writes one file (or one folder) into ``folder`` and returns its
    path, or None where the model has no such form (a checkpoint format of Hugging Face models, for another)."""

    spec: BackendSpec
    model_name: str
    folder: Path
    float_model: onnx.ModelProto
    qdq_model: onnx.ModelProto
    table: QParamTable
    input_names: list[str]
    output_names: list[str]
    qlinear_weight_type: str | None = None  # the QLinear graph's weights: "int8", "uint8" or None (the table's)
    # the deployed torch model (quantizers frozen, weights quantized): for formats written from its parameters
    module: nn.Module | None = None

    def path(self, suffix: str) -> Path:
        """``folder / f"{model_name}{suffix}"``."""
        return self.folder / f"{self.model_name}{suffix}"


DeployStep = Callable[[DeployContext], "str | Path | None"]
