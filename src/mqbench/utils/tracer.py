"""Tracing real models into torch.fx graphs, with errors that say what to do.

Example:
    >>> import torch
    >>> from mqbench.utils.tracer import trace
    >>> gm = trace(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()))
    >>> [n.op for n in gm.graph.nodes]
    ['placeholder', 'call_module', 'call_module', 'output']
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn

__all__ = ["QuantizationTracer", "TracingError", "trace", "unwrap_model"]


class TracingError(RuntimeError):
    """torch.fx could not trace the model; the message names the module and the line."""


def unwrap_model(model: nn.Module) -> nn.Module:
    """The model inside DataParallel / DistributedDataParallel wrappers."""
    while isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
        model = model.module
    return model


class QuantizationTracer(fx.Tracer):
    """A tracer that keeps quantizers, fused modules and the user's ``leaf_modules`` as leaves."""

    def __init__(self, leaf_modules: Sequence[type] = (), **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.leaf_modules = tuple(leaf_modules)

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if self.leaf_modules and isinstance(m, self.leaf_modules):
            return True
        if getattr(m, "is_quantization_leaf", False):  # quantizers, fused and QAT modules
            return True
        return super().is_leaf_module(m, module_qualified_name)


# The installed torch and mqbench packages (not any path that merely contains "torch" or "mqbench").
_LIBRARY_ROOTS = tuple(str(p.resolve()) for p in (Path(torch.__file__).parent, Path(__file__).parents[1]))


def _in_library(filename: str) -> bool:
    path = os.path.realpath(filename)
    return any(path == root or path.startswith(root + os.sep) for root in _LIBRARY_ROOTS)


def _user_frame(error: BaseException) -> str:
    """The innermost traceback frame outside torch and mqbench: the user's line."""
    frames = traceback.extract_tb(error.__traceback__)
    for frame in reversed(frames):
        if not _in_library(frame.filename):
            return f'{frame.filename}:{frame.lineno}: "{(frame.line or "").strip()}"'
    return "(no user frame in the traceback)"


def trace(
    model: nn.Module,
    concrete_args: dict[str, Any] | None = None,
    leaf_modules: Sequence[type] = (),
    custom_tracer: fx.Tracer | None = None,
) -> fx.GraphModule:
    """Trace ``model`` (unwrapped from DataParallel) into a GraphModule.

    ``custom_tracer`` (e.g. transformers' ``HFTracer()``) replaces the default tracer; its own
    leaf-module rules then apply. A failure raises :class:`TracingError` naming the module being
    traced, the user's source line, and the remedies (``leaf_module`` or ``concrete_args``).
    """
    model = unwrap_model(model)
    tracer = custom_tracer if custom_tracer is not None else QuantizationTracer(leaf_modules)
    try:
        graph = tracer.trace(model, concrete_args=concrete_args)
    except Exception as error:
        # fx.Tracer records the modules it is inside (qualified name, type), innermost last.
        scopes = [entry[0] for entry in getattr(tracer, "module_stack", {}).values() if entry and entry[0]]
        where = f"module {scopes[-1]!r}" if scopes else f"the top-level {type(model).__name__}.forward"
        raise TracingError(
            f"torch.fx could not trace {where} at {_user_frame(error)}: {type(error).__name__}: {error}\n"
            "Fixes: list that module's class in prepare_custom_config_dict['leaf_module'] so it is kept whole, "
            "or fix the data-dependent Python value with prepare_custom_config_dict['concrete_args'] "
            "(e.g. {'return_loss': False})."
        ) from error
    name = type(model).__name__
    return fx.GraphModule(tracer.root, graph, name)
