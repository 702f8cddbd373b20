"""Capture with ``torch.export``: a model torch.fx cannot trace, as the module-level graph prepare works on.

``torch.export`` (non-strict, its training IR) runs the model's Python as written, so data-dependent shapes,
control flow on sizes, ``*args`` and library code that symbolic tracing cannot follow are captured; what it gives
is an ATen-level graph with the parameters lifted to inputs. :func:`export_capture` turns that into the graph
torch.fx would have given, rooted at the model:

* each call of a leaf ``torch.nn`` module (a ``Conv2d``, ``BatchNorm2d``, ``ReLU``, ``Linear``, ``LayerNorm`` ...,
  from the ``nn_module_stack`` that export records on every node) is one ``call_module`` node on the model's
  own submodule again, so module names, weight quantizers, BatchNorm folding, QAT and checkpoints are those of
  the fx path, and the module follows ``train()`` / ``eval()`` (export bakes the mode into the graph);
* the ATen ops left between them are written as the torch functions the placement rules know
  (``aten.add.Tensor`` as ``operator.add``, ``aten.conv2d`` as ``F.conv2d`` ...), ops the ONNX exporter cannot
  write with ops it can (:mod:`mqbench.utils.export_ops`), other ops stay ATen calls, computed in float like any
  op the rules do not know;
* parameters and buffers are ``get_attr`` nodes of the model's own tensors, export's shape assertions are
  dropped, and the outputs keep the structure the model returns (a tensor, tuple, list or dict).

By default the first dimension of every tensor input, and the second of an integer one (a sequence of token
ids), is ``torch.export.Dim.AUTO``: dynamic where the model allows it, so the captured graph runs on other batch
sizes and sequence lengths. The result is checked against the model on the example inputs before prepare
sees it.

Example:
    >>> import torch
    >>> from torch import nn
    >>> class Padded(nn.Module):  # control flow on a size: torch.fx cannot trace it
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.conv = nn.Conv2d(3, 4, 3)
    ...     def forward(self, x):
    ...         if x.shape[-1] % 2:
    ...             x = torch.nn.functional.pad(x, (0, 1, 0, 1))
    ...         return self.conv(x)
    >>> gm = export_capture(Padded(), (torch.randn(1, 3, 9, 9),))
    >>> [(n.op, str(n.target)) for n in gm.graph.nodes if n.op == "call_module"]
    [('call_module', 'conv')]
"""

from __future__ import annotations

import inspect
import itertools
import operator
import typing
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx, nn

from mqbench.utils.export_ops import ATEN_WRITES, FX_NAMES, after_write, assignment_of
from mqbench.utils.hf_capture import masks_without_vmap
from mqbench.utils.logger import logger
from mqbench.utils.tracer import TracingError, _usable_name, dict_input, trace

__all__ = [
    "CAPTURES",
    "CAPTURE_ATTRIBUTE",
    "DYNAMIC_AXES",
    "CaptureError",
    "after_write",
    "default_dynamic_shapes",
    "dynamic_axes",
    "export_capture",
    "split_example_inputs",
    "trace_or_export",
]

CAPTURES = ("auto", "fx", "export")

# The prepared GraphModule's attribute naming how the model was captured: "fx" or "export".
CAPTURE_ATTRIBUTE = "mqbench_capture"

aten = torch.ops.aten


class CaptureError(RuntimeError):
    """torch.export could not capture the model; the message names the op or line and what to do."""


def split_example_inputs(example: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``prepare_custom_config_dict['example_inputs']`` as (positional, keyword) arguments: a tensor is the one
    positional argument, a tuple or list the positional ones, a dict the keyword ones."""
    if isinstance(example, torch.Tensor):
        return (example,), {}
    if isinstance(example, (tuple, list)):
        return tuple(example), {}
    if isinstance(example, Mapping):
        if not all(isinstance(key, str) for key in example):
            raise ValueError("prepare_custom_config_dict['example_inputs']: a dict's keys must be argument names")
        return (), dict(example)
    raise ValueError(
        "prepare_custom_config_dict['example_inputs'] must be a tensor, a tuple of the model's positional "
        f"arguments or a dict of its keyword arguments, got {type(example).__name__}"
    )


def _dynamic(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.dim() > 0:
        dims = {0: torch.export.Dim.AUTO}
        if value.dim() >= 2 and not value.is_floating_point() and not value.is_complex():
            dims[1] = torch.export.Dim.AUTO  # token ids and their masks: (batch, sequence)
        return dims
    if isinstance(value, (tuple, list)):
        return type(value)(_dynamic(v) for v in value)
    if isinstance(value, Mapping):
        return {key: _dynamic(v) for key, v in value.items()}
    return None


def _batch_of_one(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bool:
    """Every tensor input has a first dimension of size 1."""
    tensors = [t for t in pytree.tree_leaves((args, dict(kwargs))) if isinstance(t, torch.Tensor) and t.dim()]
    return bool(tensors) and all(t.shape[0] == 1 for t in tensors)


def default_dynamic_shapes(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[Any, ...] | dict[str, Any]:
    """The dynamic shapes prepare captures with by default: the batch dimension of every tensor input and the
    sequence dimension of integer ones, each ``Dim.AUTO`` (dynamic where the model allows it, else static)."""
    if kwargs and not args:
        return {key: _dynamic(value) for key, value in kwargs.items()}
    return tuple(_dynamic(value) for value in args) + tuple(_dynamic(value) for value in kwargs.values())


# Nodes export writes that compute nothing the model returns (shape and metadata assertions).
_ASSERTIONS = frozenset(
    {
        aten._assert_tensor_metadata.default,
        aten._assert_scalar.default,
        aten.sym_constrain_range_for_size.default,
        aten.sym_constrain_range.default,
        aten._assert_async.msg,
    }
)


# -- leaf modules ---------------------------------------------------------------------------------------------
def _kept_whole(module: nn.Module, leaf_modules: tuple[type, ...]) -> bool:
    """A module whose calls become one ``call_module`` node: the user's leaf modules, the project's quantization
    leaves, and ``torch.nn``'s own modules without children."""
    if leaf_modules and isinstance(module, leaf_modules):
        return True
    if getattr(module, "is_quantization_leaf", False):
        return True
    return type(module).__module__.startswith("torch.nn.modules.") and not any(True for _ in module.children())


def _module_call(node: fx.Node, modules: Mapping[str, nn.Module], leaf_modules: tuple[type, ...]) -> Any:
    """The outermost call of a kept-whole module that ``node`` belongs to: (key of the call, module path)."""
    for key, entry in (node.meta.get("nn_module_stack") or {}).items():
        path = entry[0]
        module = modules.get(path)
        if path and module is not None and _kept_whole(module, leaf_modules):
            return key, path
    return None


def _nodes_of(value: Any) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg(value, found.append)
    return found


def _module_calls(
    source: fx.Graph,
    modules: Mapping[str, nn.Module],
    leaves: tuple[type, ...],
    lifted: Mapping[str, str],
    aliases: Mapping[str, tuple[str, ...]],
) -> tuple[dict[fx.Node, Any], dict[Any, tuple[fx.Node, fx.Node]]]:
    """Which call of a kept-whole module each node of export's graph belongs to, and the calls that become one
    ``call_module`` node: those with one input other than their own parameters and one output, their last node."""
    calls: dict[fx.Node, Any] = {}
    for node in source.nodes:
        if node.op == "call_function" and node.target not in _ASSERTIONS:
            call = _module_call(node, modules, leaves)
            if call is not None:
                calls[node] = call
    members: dict[Any, list[fx.Node]] = {}
    for node, call in calls.items():
        members.setdefault(call, []).append(node)
    whole: dict[Any, tuple[fx.Node, fx.Node]] = {}  # call -> (its one input, its one output node)
    for call, nodes in members.items():
        inside = set(nodes)
        own = f"{call[1]}."
        inputs: list[fx.Node] = []
        for node in nodes:
            for arg in _nodes_of((node.args, node.kwargs)):
                if arg in inside or arg in inputs:
                    continue
                names = aliases.get(str(lifted.get(arg.name, "")), ())
                if arg.op == "placeholder" and any(name.startswith(own) for name in names):
                    continue
                inputs.append(arg)
        # export's metadata assertions read values inside a call without being part of it (they are dropped)
        outputs = [
            node for node in nodes if any(user not in inside and user.target not in _ASSERTIONS for user in node.users)
        ]
        if len(inputs) == 1 and len(outputs) == 1 and outputs[0] is nodes[-1]:
            whole[call] = (inputs[0], outputs[0])
    return calls, whole


_CASTS = frozenset({aten.to.dtype, aten.to.dtype_layout, aten.to.device})


def _drop_identity_casts(graph: fx.Graph) -> None:
    """Casts to the dtype and device a value has already (``x.to(torch.float32)`` on float32, as a norm class
    writes to compute in float32 whatever it is given) are that value: ``Tensor.to`` returns its input itself. Their
    readers read the value, so that a residual connection saved before such a cast does not read it from inside the
    norm that casts (which would keep that norm from being one module call)."""
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _CASTS or not isinstance(node.args[0], fx.Node):
            continue
        before, after = node.args[0].meta.get("val"), node.meta.get("val")
        if not isinstance(before, torch.Tensor) or not isinstance(after, torch.Tensor):
            continue
        if before.dtype == after.dtype and before.device == after.device:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)


def _own_name(placeholder: fx.Node, name: str, aliases: Mapping[str, tuple[str, ...]]) -> str:
    """The name a lifted tensor is read by: of a tied one (export lifts it under one of its names), the name under
    the module whose code reads it (an embedding function reads the table as ``embed_tokens.weight``, not as the
    output layer's weight), so that giving one holder its own tensor later leaves the others reading theirs."""
    names = aliases.get(name, ())
    if len(names) < 2:
        return name
    paths = {entry[0] for user in placeholder.users for entry in (user.meta.get("nn_module_stack") or {}).values()}
    return next((other for other in names if other.rpartition(".")[0] in paths), name)


# -- capture --------------------------------------------------------------------------------------------------
def _export(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], dynamic_shapes: Any
) -> torch.export.ExportedProgram:
    if dynamic_shapes is None:
        dynamic_shapes = default_dynamic_shapes(args, kwargs)
    try:
        with masks_without_vmap():
            return torch.export.export(model, args, kwargs, dynamic_shapes=dynamic_shapes, strict=False)
    except Exception as error:
        message = str(error).strip().splitlines()
        head = " ".join(message[:3])[:600]
        raise CaptureError(
            f"torch.export could not capture {type(model).__name__}.forward: {type(error).__name__}: {head}\n"
            "Fixes: list the class of the module that fails in prepare_custom_config_dict['leaf_module'] so it is "
            "kept whole, pass example inputs the model accepts as written, or pass dynamic_shapes "
            "(prepare_custom_config_dict['dynamic_shapes'], as torch.export.export takes them)."
        ) from error


def export_capture(
    model: nn.Module,
    example_inputs: Any,
    dynamic_shapes: Any = None,
    leaf_modules: Sequence[type] = (),
) -> fx.GraphModule:
    """Capture ``model`` with ``torch.export`` (non-strict, training IR) called on ``example_inputs`` (see
    :func:`split_example_inputs`), as a module-level ``GraphModule`` rooted at ``model`` (see the module's
    docstring). ``dynamic_shapes`` as ``torch.export.export`` takes them (default:
    :func:`default_dynamic_shapes`). Raises :class:`CaptureError` naming what failed and what to do.

    A language model whose config asks for a key-value cache (``config.use_cache``, transformers' default) is
    captured without it, as a prefill (the logits of every position), unless the example inputs name ``use_cache``
    or ``past_key_values``; the model's config is left as it was."""
    args, kwargs = split_example_inputs(example_inputs)
    with _prefill_only(model, kwargs):
        return _export_capture(model, args, kwargs, dynamic_shapes, leaf_modules)


@contextmanager
def _prefill_only(model: nn.Module, kwargs: Mapping[str, Any]) -> Iterator[None]:
    config = getattr(model, "config", None)
    asked = "use_cache" in kwargs or "past_key_values" in kwargs
    if asked or getattr(config, "use_cache", None) is not True:
        yield
        return
    logger.info("%s: captured without its key-value cache (config.use_cache off while capturing)", type(model).__name__)
    config.use_cache = False  # type: ignore[union-attr]
    try:
        yield
    finally:
        config.use_cache = True  # type: ignore[union-attr]


def _export_capture(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    dynamic_shapes: Any,
    leaf_modules: Sequence[type],
) -> fx.GraphModule:
    leaves = tuple(leaf_modules)
    program = None
    if dynamic_shapes is None and _batch_of_one(args, kwargs):
        # export fixes a dimension of size 1 (one prompt, one image): captured on the example twice over, the batch
        # stays dynamic, so the prepared model calibrates on batches; a model that takes only one falls back below
        doubled_args, doubled_kwargs = pytree.tree_map_only(
            torch.Tensor, lambda t: torch.cat([t, t]) if t.dim() else t, (args, kwargs)
        )
        try:
            program = _export(model, doubled_args, doubled_kwargs, None)
            args, kwargs = doubled_args, doubled_kwargs
        except CaptureError:
            program = None
    if program is None:
        program = _export(model, args, kwargs, dynamic_shapes)
    _inline_wrappers(program.graph_module)
    _drop_identity_casts(program.graph)
    signature = program.graph_signature
    unsupported = [spec.kind.name for spec in signature.output_specs if spec.kind.name != "USER_OUTPUT"]
    if unsupported:
        raise CaptureError(
            f"torch.export captured {type(model).__name__}.forward with outputs of kinds {sorted(set(unsupported))} "
            "(a buffer or input changed in place outside a module mutation mqbench can keep): capture it with "
            "torch.fx (prepare_custom_config_dict['capture'] = 'fx') or make the mutation a module's own"
        )
    lifted = {**signature.inputs_to_parameters, **signature.inputs_to_buffers}
    lifted.update(signature.inputs_to_lifted_tensor_constants)
    modules = dict(model.named_modules())
    graph = fx.Graph()
    env: dict[fx.Node, Any] = {}
    root = model  # the captured graph runs on the model's own modules and tensors
    constants = dropouts = 0
    source = program.graph

    # a tied parameter (an embedding table that is also the output layer's weight) is lifted under one of its names:
    # it is each of its modules' own
    shared: dict[int, list[str]] = {}
    for name, tensor in (*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)):
        shared.setdefault(id(tensor), []).append(name)
    aliases = {name: tuple(names) for names in shared.values() for name in names}
    calls, whole = _module_calls(source, modules, leaves, lifted, aliases)
    user_inputs = _user_inputs(model, args, kwargs, [n for n in source.nodes if n.op == "placeholder"], lifted, graph)

    for node in source.nodes:
        if node.op == "placeholder":
            if node in user_inputs:
                env[node] = user_inputs[node]
                continue
            if node.name in lifted:
                target = _own_name(node, lifted[node.name], aliases)
                if node.name in signature.inputs_to_lifted_tensor_constants:
                    target = f"_export_constant_{constants}"
                    constants += 1
                    root.register_buffer(target, program.constants[lifted[node.name]].clone(), persistent=False)
                env[node] = graph.get_attr(target)
            else:
                env[node] = graph.placeholder(node.name)
                env[node].meta["val"] = node.meta.get("val")  # its dtype: placement skips integer inputs
            continue
        if node.op == "output":
            flat = [env.get(value) if isinstance(value, fx.Node) else value for value in node.args[0]]
            graph.output(_structured(flat, program.call_spec.out_spec, graph, root))
            continue
        if node.op == "get_attr" and not node.users:  # the body of an inlined wrapper
            continue
        if node.op == "get_attr":  # what export's graph holds for higher-order ops (mask functions and specs)
            value = getattr(program.graph_module, str(node.target))
            target = f"_export_{node.target}"
            if isinstance(value, nn.Module):
                root.add_module(target, value)
            else:
                setattr(root, target, value)
            env[node] = graph.get_attr(target)
            continue
        if node.op != "call_function":
            raise CaptureError(f"torch.export wrote a {node.op} node {node.name!r}, which mqbench cannot prepare")
        if node.target in _ASSERTIONS:
            continue
        call = calls.get(node)
        if call is not None and call in whole:
            first, last = whole[call]
            if node is last:
                env[node] = graph.call_module(call[1], (env[first],))
                env[node].meta["val"] = node.meta.get("val")
            continue  # the other nodes of the call are inside the module
        if node.target is aten.dropout.default:
            # export bakes the mode into a functional dropout (``training=self.training``): a Dropout module
            # follows train() / eval() as the model's own code did
            module_name = f"_export_dropout_{dropouts}"
            dropouts += 1
            root.add_module(module_name, nn.Dropout(float(node.args[1])).train(model.training))
            env[node] = graph.call_module(module_name, (env[node.args[0]],))
            env[node].meta["val"] = node.meta.get("val")
            continue
        assignment = assignment_of(node)
        if assignment is not None:  # ``base[index] = value``: the form the ONNX exporter writes as a scatter
            base, index, value = typing.cast(tuple[Any, ...], fx.node.map_arg(assignment, lambda n: env[n]))
            env[node] = env[node.args[0]]  # the view, which now reads the written values
            # Later readers of the base read it through a view taken after the write: a quantizer placed on
            # that view reads the written values (one placed on the base itself would read them before it).
            setter = graph.call_function(operator.setitem, (base, index, value))
            written = graph.call_function(after_write, (base, setter), name=f"{base.name}_written")
            written.meta["val"] = base.meta.get("val")
            env[assignment[0]] = written
            continue
        call_args = tuple(fx.node.map_arg(node.args, lambda n: env[n]))
        call_kwargs = dict(fx.node.map_arg(node.kwargs, lambda n: env[n]))
        write = ATEN_WRITES.get(node.target)
        function: Any = node.target
        if write is not None:
            function, call_args, call_kwargs = write(call_args, call_kwargs)
        elif isinstance(node.target, torch._ops.OpOverload) and any(
            isinstance(arg.meta.get("val"), torch.SymInt) for arg in node.all_input_nodes
        ):
            # ATen's own call refuses the traced sizes the ONNX exporter passes; torch's Python API takes them
            packet = node.target._opname
            function = getattr(torch, packet, None) or getattr(torch.Tensor, packet, node.target)
        fx_name = FX_NAMES.get(node.target, getattr(node.target, "_opname", None)) if write is None else None
        env[node] = graph.create_node("call_function", function, tuple(call_args), dict(call_kwargs), name=fx_name)
        env[node].meta["val"] = node.meta.get("val")  # what it computes (a tensor or a size), as export saw it
        if node.meta.get("stack_trace"):  # the model's (or a library's) line that called it, for error messages
            env[node].meta["stack_trace"] = node.meta["stack_trace"]
    for unused in [n for n in graph.nodes if n.op == "get_attr" and not n.users]:  # parameters inside modules
        graph.erase_node(unused)
    _constants_on_host(model, graph)
    graph.lint()
    captured = fx.GraphModule(root, graph, type(model).__name__)
    _check(model, captured, args, kwargs)
    axes = dynamic_axes(graph)
    if any(axes.values()):
        captured.meta[DYNAMIC_AXES] = axes
    return captured


# ``GraphModule.meta`` key of the dynamic dimensions of a captured graph's inputs (see :func:`dynamic_axes`).
DYNAMIC_AXES = "mqbench_dynamic_axes"


def dynamic_axes(graph: fx.Graph) -> dict[str, dict[int, str]]:
    """The dimensions of the graph's tensor inputs (each, in order) that torch.export kept dynamic, as
    ``torch.onnx.export`` takes them: ``{input: {dim: axis name}}``; one symbol has one name in every input
    ("batch" for a first dimension, "sequence" for a second, else ``<input>_<dim>``; another symbol at a
    dimension whose name is taken is ``<input>_batch`` ...)."""
    names: dict[str, str] = {}
    axes: dict[str, dict[int, str]] = {}
    for node in graph.nodes:
        value = node.meta.get("val") if node.op == "placeholder" else None
        if not isinstance(value, torch.Tensor):
            continue
        axes[node.name] = {}
        for dim, size in enumerate(value.shape):
            if not isinstance(size, torch.SymInt):
                continue
            symbol = str(size)
            if symbol not in names:
                base = {0: "batch", 1: "sequence"}.get(dim, f"{node.name}_{dim}")
                taken = set(names.values())
                names[symbol] = base if base not in taken else f"{node.name}_{base}"
            axes[node.name][dim] = names[symbol]
    return axes


# Higher-order ops that only run a captured submodule under a grad or autocast mode: inlined (prepare
# simulates in float32, and the modes change no value of a forward).
_WRAPPERS = ("wrap_with_set_grad_enabled", "wrap_with_autocast")


def _inline_wrappers(module: fx.GraphModule) -> None:
    """Replace each call of a mode wrapper in ``module``'s graph by the nodes of the submodule it runs."""
    graph = module.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or getattr(node.target, "__name__", None) not in _WRAPPERS:
            continue
        position = next(i for i, arg in enumerate(node.args) if isinstance(arg, fx.Node) and arg.op == "get_attr")
        body = getattr(module, str(node.args[position].target))
        _inline_wrappers(body)
        env: dict[fx.Node, Any] = {}
        operands = iter(node.args[position + 1 :])
        with graph.inserting_before(node):
            for inner in body.graph.nodes:
                if inner.op == "placeholder":
                    env[inner] = next(operands)
                elif inner.op == "get_attr":
                    name = f"_inlined_{inner.target}"
                    if not hasattr(module, name):
                        setattr(module, name, getattr(body, str(inner.target)))
                    env[inner] = graph.get_attr(name)
                elif inner.op == "output":
                    results = inner.args[0]
                else:
                    env[inner] = graph.node_copy(inner, env.__getitem__)
        values = fx.node.map_arg(results, env.__getitem__)
        for user in list(node.users):
            if user.op == "call_function" and user.target is operator.getitem:
                user.replace_all_uses_with(values[user.args[1]])
                graph.erase_node(user)
            else:
                user.replace_input_with(node, values)
        graph.erase_node(node)
    graph.lint()
    module.recompile()


def _user_inputs(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    placeholders: list[fx.Node],
    lifted: Mapping[str, str],
    graph: fx.Graph,
) -> dict[fx.Node, fx.Node]:
    """The captured graph's value of each of export's input placeholders (one per tensor of the inputs), with
    placeholders the model is called with as it was: a tensor argument is one placeholder; a dict of tensors that
    is the last argument, one placeholder per key gathered by :func:`~mqbench.utils.tracer.dict_input` (the form
    torch.fx captures: called with the dict, or with one tensor per key as deploy and calibration pass them); any
    other structure (a tuple, a nested dict), one placeholder for the argument, indexed."""
    inputs = [node for node in placeholders if node.name not in lifted]
    leaves = pytree.tree_flatten_with_path((args, kwargs))[0]
    if len(leaves) != len(inputs) or not all(isinstance(leaf, torch.Tensor) for _, leaf in leaves):
        return {}  # constants among the inputs: export's flat placeholders
    parameters = list(inspect.signature(model.forward).parameters)
    groups: dict[Any, list[tuple[fx.Node, tuple[Any, ...]]]] = {}
    for node, (path, _) in zip(inputs, leaves, strict=True):
        groups.setdefault(path[:2], []).append((node, tuple(path[2:])))
    holders: dict[Any, tuple[str, list[fx.Node]]] = {}
    last = list(groups)[-1]
    for top, members in groups.items():  # every placeholder first, in the order of the arguments
        if len(members) == 1 and not members[0][1]:  # a tensor argument
            holders[top] = ("tensor", [graph.placeholder(members[0][0].name)])
        elif top == last and _keyed_by_names(members):
            keys = [str(typing.cast(pytree.MappingKey, rest[0]).key) for _, rest in members]
            holders[top] = ("dict", [graph.placeholder(keys[0])])
            holders[top][1].extend(graph.placeholder(key, default_value=None) for key in keys[1:])
        else:
            index = top[1].idx if isinstance(top[1], pytree.SequenceKey) else None
            name = str(top[1].key) if index is None else (parameters[index] if index < len(parameters) else "arg")
            holders[top] = ("indexed", [graph.placeholder(name)])
    values: dict[fx.Node, fx.Node] = {}
    for top, members in groups.items():
        kind, found = holders[top]
        if kind == "tensor":
            values[members[0][0]] = found[0]
        elif kind == "dict":
            names = tuple(str(typing.cast(pytree.MappingKey, rest[0]).key) for _, rest in members)
            gathered = graph.call_function(dict_input, (names, *found))
            for (node, _), key in zip(members, names, strict=True):
                values[node] = graph.call_function(operator.getitem, (gathered, key))
        else:
            for node, rest in members:
                value = found[0]
                for step in rest:
                    index = step.idx if isinstance(step, pytree.SequenceKey) else step.key
                    value = graph.call_function(operator.getitem, (value, index))
                values[node] = value
    for node, value in values.items():
        value.meta["val"] = node.meta.get("val")  # its dtype: placement skips integer inputs
    return values


def _keyed_by_names(members: Sequence[tuple[fx.Node, tuple[Any, ...]]]) -> bool:
    """Whether an argument is a dict of tensors whose keys can be parameter names (as fx splits one: a key such
    as ``"rgb-image"`` cannot, and the dict stays one argument, indexed)."""
    keys = [rest[0].key for _, rest in members if len(rest) == 1 and isinstance(rest[0], pytree.MappingKey)]
    usable = all(isinstance(key, str) and _usable_name(key, set()) for key in keys)
    return len(keys) == len(members) and usable and len(set(keys)) == len(keys)


def _structured(flat: list[Any], spec: Any, graph: fx.Graph, root: nn.Module) -> Any:
    """The output node's argument: the flat outputs in the structure the model returns (a structure other than
    a tuple, list or dict of outputs, such as a Hugging Face ``ModelOutput``, rebuilt from export's spec)."""
    structure = pytree.tree_unflatten(list(range(len(flat))), spec)
    if _plain(structure):  # tuples, lists and dicts of outputs, nested as the model nests them

        def rebuilt(part: Any) -> Any:
            if isinstance(part, int):
                return flat[part]
            if type(part) is dict:
                return {key: rebuilt(value) for key, value in part.items()}
            return type(part)(rebuilt(value) for value in part)

        return rebuilt(structure)
    root._export_output_spec = spec  # type: ignore[assignment]
    return graph.call_function(pytree.tree_unflatten, (list(flat), graph.get_attr("_export_output_spec")))


def _plain(structure: Any) -> bool:
    """Whether ``structure`` is an output index, or a tuple, list or dict (of these types exactly) of plain ones."""
    if isinstance(structure, int):
        return True
    if type(structure) is dict:
        return all(_plain(value) for value in structure.values())
    return type(structure) in (tuple, list) and all(_plain(value) for value in structure)


def _constants_on_host(model: nn.Module, graph: fx.Graph) -> None:
    """A model captured without its weights (on ``meta``) had its tensors made in the forward (``torch.arange(...,
    device=...)``, ``.to(device)``) written on ``meta`` too: they are made on the host, where the weights will be."""
    if not any(tensor.is_meta for tensor in itertools.chain(model.parameters(), model.buffers())):
        return
    host = lambda a: torch.device("cpu") if isinstance(a, torch.device) and a.type == "meta" else a  # noqa: E731
    for node in graph.nodes:
        if node.op == "call_function":
            node.args, node.kwargs = fx.node.map_aggregate((node.args, node.kwargs), host)


def _check(model: nn.Module, captured: fx.GraphModule, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
    """The captured graph computes what the model computes on the example inputs (same random draws, module
    state restored afterwards: the buffers a forward may update; the parameters, which it does not write, are not
    copied, so that no second copy of the weights is made). A model whose weights are not loaded yet (on the
    ``meta`` device: :func:`~mqbench.advanced_ptq.attach_weights` gives them later) computes nothing to compare
    with: the check is left out, saying so."""
    on_meta = [
        name for name, tensor in itertools.chain(model.named_parameters(), model.named_buffers()) if tensor.is_meta
    ]
    if on_meta:
        logger.warning(
            "capture: %d weight(s) of %s are on the meta device (%s, ...): the captured graph is not compared with "
            "the model on the example inputs",
            len(on_meta),
            type(model).__name__,
            on_meta[0],
        )
        return
    state = {name: value.detach().clone() for name, value in model.named_buffers()}
    try:
        with torch.no_grad(), torch.random.fork_rng():
            torch.manual_seed(0)
            expected = pytree.tree_leaves(model(*args, **kwargs))
            torch.manual_seed(0)
            got = pytree.tree_leaves(captured(*args, **kwargs))
    finally:
        with torch.no_grad():
            for name, value in model.named_buffers():
                if name in state:
                    value.copy_(state[name])
    tensors = [(a, b) for a, b in zip(expected, got, strict=False) if isinstance(a, torch.Tensor)]
    if len(expected) != len(got) or not all(
        isinstance(b, torch.Tensor) and a.shape == b.shape and torch.allclose(a, b, rtol=1e-4, atol=1e-5)
        for a, b in tensors
    ):
        raise CaptureError(
            f"the graph torch.export captured of {type(model).__name__} does not compute what the model computes "
            "on the example inputs: capture it with torch.fx (prepare_custom_config_dict['capture'] = 'fx'), or "
            "list the module that differs in prepare_custom_config_dict['leaf_module']"
        )


def trace_or_export(
    model: nn.Module,
    example_inputs: Any,
    concrete_args: dict[str, Any] | None = None,
    leaf_modules: Sequence[type] = (),
    dynamic_shapes: Any = None,
) -> tuple[fx.GraphModule, str]:
    """``capture="auto"``: torch.fx, and where it cannot trace the model, torch.export on ``example_inputs``;
    the graph and which captured it ("fx" or "export"). Neither working is one :class:`CaptureError` with both
    reasons."""
    try:
        return trace(model, concrete_args, leaf_modules), "fx"
    except TracingError as fx_error:
        try:
            return export_capture(model, example_inputs, dynamic_shapes, leaf_modules), "export"
        except CaptureError as export_error:
            raise CaptureError(f"neither capture works.\n{fx_error}\n{export_error}") from export_error
