"""Tracing real models into torch.fx graphs, with errors that say what to do.

Example:
    >>> import torch
    >>> from mqbench.utils.tracer import trace
    >>> gm = trace(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()))
    >>> [n.op for n in gm.graph.nodes]
    ['placeholder', 'call_module', 'call_module', 'output']
"""

from __future__ import annotations

import copy
import inspect
import keyword
import operator
import os
import traceback
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn

__all__ = ["QuantizationTracer", "TracingError", "check_model", "dict_input", "trace", "unwrap_model"]


class TracingError(RuntimeError):
    """torch.fx could not trace the model; the message names the module and the line."""


def unwrap_model(model: nn.Module) -> nn.Module:
    """The model inside DataParallel / DistributedDataParallel wrappers."""
    while isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
        model = model.module
    return model


def check_model(model: Any, caller: str = "prepare_by_platform") -> None:
    """Raise TypeError unless ``model`` is an eager ``nn.Module`` torch.fx can trace.

    TorchScript modules (``torch.jit.script`` / ``torch.jit.trace``), ``torch.compile`` wrappers
    and ``torch.export`` programs are compiled forms of a model: the error says to pass the
    original module instead.
    """
    if isinstance(model, torch.export.ExportedProgram):
        raise TypeError(
            f"{caller} takes the original nn.Module, got a torch.export.ExportedProgram (its graph is ATen-level "
            "and has no modules to quantize): pass the module you gave torch.export.export, and export the "
            "prepared model afterwards if you need an ExportedProgram"
        )
    if isinstance(model, torch.jit.ScriptModule):
        raise TypeError(
            f"{caller} takes the original nn.Module, got a TorchScript module ({type(model).__name__}, made by "
            "torch.jit.script or torch.jit.trace), which torch.fx cannot trace: pass the model before scripting; "
            "if a part of it cannot be traced by torch.fx, list that part's class in "
            "prepare_custom_config_dict['leaf_module'] so it is kept whole"
        )
    original = getattr(model, "_orig_mod", None)
    if isinstance(model, nn.Module) and isinstance(original, nn.Module) and type(model).__name__ == "OptimizedModule":
        raise TypeError(
            f"{caller} takes the original nn.Module, got a torch.compile wrapper (OptimizedModule of "
            f"{type(original).__name__}): pass the module before torch.compile (here model._orig_mod) and "
            "compile the prepared model instead"
        )
    if not isinstance(model, nn.Module):
        raise TypeError(f"{caller} takes an nn.Module, got {type(model).__module__}.{type(model).__qualname__}")


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
        if isinstance(m, torch.jit.ScriptModule):  # compiled already: called whole, never entered
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
    check_model(model, "mqbench's torch.fx tracer")
    model = unwrap_model(model)
    tracer = custom_tracer if custom_tracer is not None else QuantizationTracer(leaf_modules)
    try:
        with _python_state_kept(model):
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
    _default_concrete_inputs(model, graph, concrete_args or {})
    _flatten_dict_inputs(graph, set(concrete_args or {}))
    return fx.GraphModule(tracer.root, graph, name)


_MODULE_INTERNALS = frozenset({"_parameters", "_buffers", "_modules", "training"})


def _holds_proxy(value: Any, depth: int = 4) -> bool:
    """Whether ``value`` is an fx Proxy or a container (dict, list, tuple, set) holding one, a few levels down."""
    if isinstance(value, fx.Proxy):
        return True
    if depth == 0:
        return False
    if isinstance(value, dict):
        return any(_holds_proxy(k, depth - 1) or _holds_proxy(v, depth - 1) for k, v in value.items())
    if isinstance(value, (list, tuple, set, frozenset)):
        return any(_holds_proxy(item, depth - 1) for item in value)
    return False


@contextmanager
def _python_state_kept(model: nn.Module) -> Iterator[None]:
    """Every module's Python attributes after tracing as they were before wherever tracing left a traced value
    (an fx Proxy) in them: a cache a forward fills in eval mode (timm's LeViT keeps its attention biases in a dict)
    would otherwise hand the next trace a value of this graph, or hand the model's own forward a Proxy.

    Attributes that tracing changed without a Proxy stay as they are; a container changed in place comes back
    with its earlier contents, in the same object."""
    before = []
    for module in model.modules():
        state = {key: value for key, value in vars(module).items() if key not in _MODULE_INTERNALS}
        contents = {k: copy.copy(v) for k, v in state.items() if isinstance(v, (dict, list, set))}
        before.append((module, state, contents))
    try:
        yield
    finally:
        for module, state, contents in before:
            for key in [k for k, v in vars(module).items() if k not in _MODULE_INTERNALS and _holds_proxy(v)]:
                value = vars(module)[key]
                if key not in state:
                    delattr(module, key)
                elif key in contents and value is state[key]:  # the same container, filled in place
                    value.clear()
                    if isinstance(value, list):
                        value.extend(contents[key])
                    else:
                        value.update(contents[key])
                else:
                    object.__setattr__(module, key, state[key])


def _default_concrete_inputs(model: nn.Module, graph: fx.Graph, concrete_args: Mapping[str, Any]) -> None:
    """Give each argument fixed by ``concrete_args`` its value as the traced forward's default: fx keeps a
    parameter for it (``text_1``, checked to be the value), which would otherwise be a required input of the
    prepared model and its deployment (``forward(x, text)`` traced with ``{"text": None}`` is called ``qmodel(x)``)."""
    parameters = [
        p
        for p in inspect.signature(model.forward).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    placeholders = [node for node in graph.nodes if node.op == "placeholder"]
    if len(placeholders) != len(parameters):  # *args / **kwargs: no one-to-one match to rely on
        return
    # from the last argument back: a default may not come before a required argument
    for parameter, node in reversed(list(zip(parameters, placeholders, strict=True))):
        value = concrete_args.get(parameter.name, inspect.Parameter.empty)
        if not (value is None or isinstance(value, bool | int | float | str)) or node.args:
            break
        node.args = (value,)


def dict_input(keys: tuple[str, ...], *values: Any) -> Any:
    """The input dict of a model whose forward takes one: given whole (the model's own call, ``model(inputs)``)
    or as one argument per key (``model(x)``, ``model(x=...)``: what export and calibration pass)."""
    first = values[0] if values else None
    if isinstance(first, Mapping) and all(value is None for value in values[1:]):
        return first
    return {key: value for key, value in zip(keys, values, strict=True) if value is not None}


def _dict_keys(placeholder: fx.Node) -> list[str] | None:
    """The keys a forward reads from a dict argument before writing them (constant string keys), or None when
    the argument is used otherwise (indexed by a non-string, passed on whole, iterated)."""
    read: list[str] = []
    written: set[str] = set()
    for user in [node for node in placeholder.graph.nodes if node in placeholder.users]:  # in graph order
        if user.op == "output":
            continue
        reads = (user.op == "call_function" and user.target is operator.getitem) or (
            user.op == "call_method" and user.target == "get"
        )
        if reads and user.args[0] is placeholder and len(user.args) > 1:
            key = user.args[1]
        elif user.op == "call_method" and user.target == "update" and user.args[0] is placeholder:
            update = user.args[1] if len(user.args) == 2 and not user.kwargs else None
            if not isinstance(update, Mapping) or not all(isinstance(k, str) for k in update):
                return None
            written.update(update)
            continue
        else:
            return None
        if not isinstance(key, str):
            return None
        if key not in written and key not in read:
            read.append(key)
    return read or None


def _usable_name(key: str, taken: set[str]) -> bool:
    return key.isidentifier() and not keyword.iskeyword(key) and key not in taken and key != "self"


def _flatten_dict_inputs(graph: fx.Graph, fixed: set[str]) -> None:
    """A forward argument used as a dict of tensors (``inputs["x"]``, ``inputs.update(...)``, returned) becomes
    one argument per key it reads, so the model can be exported and called with tensors; the model still
    takes its dict whole as the first of them (:func:`dict_input` rebuilds it)."""
    placeholders = [node for node in graph.nodes if node.op == "placeholder"]
    taken = {str(node.target) for node in placeholders}
    for placeholder in placeholders:
        target = str(placeholder.target)
        if target.startswith("*") or target in fixed or placeholder.args:
            continue
        keys = _dict_keys(placeholder)
        if keys is None or not all(_usable_name(k, taken - {target}) for k in keys):
            continue
        with graph.inserting_before(placeholder):
            arguments = [graph.placeholder(keys[0])]
            arguments += [graph.placeholder(key, default_value=None) for key in keys[1:]]
        last = placeholders[-1]
        with graph.inserting_after(last):
            rebuilt = graph.call_function(dict_input, (tuple(keys), *arguments))
        placeholder.replace_all_uses_with(rebuilt)
        graph.erase_node(placeholder)
        taken |= set(keys)
    graph.lint()
