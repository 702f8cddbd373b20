"""Where an op the ONNX exporter refuses comes from: the model's own code, or a library's the model calls.

``convert_deploy`` names the op's owner when the exporter cannot write it, so that its advice fits: an op in the
model's code is the model's to change; an op in a library's code (a Hugging Face model's mask code in
``transformers``) is not, and the user changes how the model is called instead.

The op is looked up in the graphs of the model first: a node captured by ``torch.export`` keeps the stack of the line
that called it (``node.meta["stack_trace"]``). An op inside a module kept whole (no node of its own) is found by
running the model once, watching the torch functions it calls.

Example:
    >>> refused_op("Exporting the operator 'aten::kthvalue' to ONNX opset version 17 is not supported.")
    'kthvalue'
    >>> library_of("/usr/lib/python3/site-packages/transformers/masking_utils.py")
    'transformers'
    >>> print(library_of("/home/me/my_model.py"))
    None
"""

from __future__ import annotations

import re
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn
from torch.overrides import TorchFunctionMode

__all__ = ["Frame", "OpOrigin", "library_of", "op_origin", "refused_op"]

# How the TorchScript exporter names an op it cannot write: the ATen name, or the operator a symbolic refuses.
_REFUSED = (re.compile(r"operator '(?:aten|prim|onnx)::(\w+)'"), re.compile(r"ONNX export of operator (\w+)"))
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)\n?([^\n]*)')
_PACKAGES = ("site-packages", "dist-packages")
_THIS_FILE = str(Path(__file__).resolve())


def _package_root(name: str) -> Path | None:
    module = __import__(name)
    location = getattr(module, "__file__", None)
    return Path(location).resolve().parent if location else None


# torch and mqbench run from a source checkout as often as from site-packages: their own folders
_ROOTS = {name: _package_root(name) for name in ("torch", "mqbench")}


def refused_op(message: str) -> str | None:
    """The name of the op an exporter error says it cannot write (``kthvalue`` of ``'aten::kthvalue'``)."""
    for pattern in _REFUSED:
        found = pattern.search(message)
        if found:
            return found.group(1)
    return None


def library_of(path: str) -> str | None:
    """The library a source file belongs to (the package installed in ``site-packages`` it is in, torch, mqbench);
    None for any other file: the model's own code, or a graph module's generated forward (``<eval_with_key>``)."""
    if path.startswith("<"):
        return None
    file = Path(path)
    parts = file.parts
    for marker in _PACKAGES:
        if marker in parts[:-1]:
            top = parts[parts.index(marker) + 1]
            return top.removesuffix(".py")
    for name, root in _ROOTS.items():
        if root is not None and file.resolve().is_relative_to(root):
            return name
    return None


@dataclass(frozen=True)
class Frame:
    """One line of a call stack: its file, line number and function."""

    path: str
    line: int
    function: str
    code: str = ""

    def __str__(self) -> str:
        code = f", `{self.code}`" if self.code else ""
        return f"{self.path}:{self.line} in {self.function}{code}"


@dataclass(frozen=True)
class OpOrigin:
    """Where the op is called: the call stack (outermost first) and the graph node calling it, where known."""

    op: str
    frames: tuple[Frame, ...] = ()
    node: str | None = None

    @property
    def site(self) -> Frame | None:
        """The line that calls the op: the innermost frame not in torch's own code (torch's functions and modules
        are how code calls an op), else the innermost frame."""
        for frame in reversed(self.frames):
            if library_of(frame.path) != "torch":
                return frame
        return self.frames[-1] if self.frames else None

    @property
    def library(self) -> str | None:
        """The library whose code calls the op; None: the model's own code (or its graph)."""
        site = self.site
        return library_of(site.path) if site is not None else None

    @property
    def caller(self) -> Frame | None:
        """The innermost line of the model's own source (not a library's, not a graph's generated forward)."""
        for frame in reversed(self.frames):
            if library_of(frame.path) is None and not frame.path.startswith("<"):
                return frame
        return None

    def explain(self) -> str:
        """Who calls the op and what the user can do about it, for the exporter's error."""
        register = (
            "or give the ONNX exporter a way to write it "
            f"(torch.onnx.register_custom_op_symbolic('aten::{self.op}', ...))"
        )
        library, site, caller = self.library, self.site, self.caller
        if library is not None and site is not None:
            reached = f", reached from the model at {caller}" if caller is not None else ""
            hint = ""
            if library == "transformers":  # its mask code takes another path given a mask
                hint = " (for a Hugging Face model's mask code: an attention_mask in example_inputs and dummy_input)"
            return (
                f"The op is called by {_owned(library)} code, not the model's: {site}{reached}. Call the model so that "
                f"{library} takes another path{hint}, use a version of {library} that does not call it, {register}"
            )
        where = f" at {caller}" if caller is not None else ""
        node = f" (graph node {self.node!r})" if self.node else ""
        innermost = self.frames[-1] if self.frames else None
        inside = library_of(innermost.path) if innermost is not None else None
        through = f", through {_owned(inside)} code at {innermost}" if innermost and inside else ""
        return (
            f"The op is in the model's own code{where}{node}{through}. Change that op of the model (or the input "
            f"shape it is deployed for), {register}"
        )


def _owned(name: str) -> str:
    return f"{name}'" if name.endswith("s") else f"{name}'s"


def _parse(stack_trace: str) -> tuple[Frame, ...]:
    found = _FRAME.findall(stack_trace)
    return tuple(Frame(path, int(line), function, code.strip()) for path, line, function, code in found)


def _calls(node: fx.Node, op: str) -> bool:
    """Whether ``node`` calls ``op`` (an ATen overload, a torch function or a tensor method of that name)."""
    if node.op == "call_method":
        return node.target == op
    if node.op != "call_function":
        return False
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name.split("::")[-1] == op
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name.split("::")[-1] == op
    return getattr(target, "__name__", None) == op


def _from_graphs(model: nn.Module, op: str) -> OpOrigin | None:
    found = None
    for module in model.modules():
        if not isinstance(module, fx.GraphModule):
            continue
        for node in module.graph.nodes:
            if not _calls(node, op):
                continue
            frames = _parse(node.meta.get("stack_trace") or "")
            if frames:
                return OpOrigin(op, frames, node.name)
            found = found or OpOrigin(op, (), node.name)
    return found


class _Watch(TorchFunctionMode):
    """Records the call stack of the first call of a torch function or ATen op named ``op``."""

    def __init__(self, op: str) -> None:
        super().__init__()
        self.op = op
        self.stack: list[traceback.FrameSummary] | None = None

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: Sequence[Any] = (), kwargs: Any = None
    ) -> Any:
        if self.stack is None:
            schema = getattr(func, "_schema", None)
            name = schema.name.split("::")[-1] if schema is not None else getattr(func, "__name__", None)
            if name == self.op:
                self.stack = traceback.extract_stack()[:-1]
        return func(*args, **(kwargs or {}))


def _from_run(model: nn.Module, args: Sequence[Any], op: str) -> OpOrigin | None:
    watch = _Watch(op)
    try:
        with torch.no_grad(), watch:
            model(*args)
    except Exception:  # the call stack is a courtesy of the error message: a model that fails here has none
        return None
    if watch.stack is None:
        return None
    frames = [Frame(f.filename, f.lineno or 0, f.name, (f.line or "").strip()) for f in watch.stack]
    ours = [i for i, frame in enumerate(frames) if frame.path == _THIS_FILE]
    return OpOrigin(op, tuple(frames[ours[-1] + 1 :] if ours else frames))


def op_origin(model: nn.Module, args: Sequence[Any], op: str) -> OpOrigin | None:
    """Where ``model`` called with ``args`` calls ``op``: from the stack torch.export kept on the graph node that
    calls it, else from the stack of its first call when the model runs once; None where neither finds it."""
    found = _from_graphs(model, op)
    if found is not None and found.frames:
        return found
    run = _from_run(model, args, op)
    if run is None:
        return found
    return replace(run, node=found.node) if found is not None else run
