"""The inputs a deployment is exported for and verified on: how the model is called, and the ONNX inputs.

``dummy_input`` (and ``verify_deploy``'s ``inputs``) says how the model's forward is called; the
ONNX model takes the tensors of that call, flattened in order, one input each:

* a tensor: the one positional argument;
* a tuple or list: the positional arguments, each a tensor or a dict / tuple / list of tensors
  (nested as the forward takes them); a last element that is a dict holds the keyword inputs, as
  ``torch.onnx.export`` reads it (``({"image": t}, {})``: one positional dict, no keyword inputs);
  a last dict whose keys name none of the forward's parameters is the next positional argument where
  the forward requires exactly one more (``({"image": t},)`` for ``forward(self, batch)``);
* a dict: keyword inputs where its keys are the forward's parameter names; where none is, the value
  of the forward's one required positional parameter (a detector's ``forward(self, batch)``) unless
  the prepared graph reads that parameter as a tensor; otherwise input name -> tensor, one
  positional input each (``{"pixels": x}`` for ``forward(self, x)``).

A dict argument's tensors are named after its keys (``image``, not ``batch_image``); a tuple's after
the argument with the position appended (``boxes_0``); a tensor argument after its parameter where
the call ends in a dict of keyword inputs, else ``input_<i>`` (or the names of ``input_shape_dict``).
Names that would repeat take the whole path (``input_0_image``).

The prepared model of a forward that takes a dict reads the dict's keys as parameters of their own
(fx and export capture gather them with :func:`~mqbench.utils.tracer.dict_input`): it takes the
dict whole or one tensor per key, and a dict whose keys it does not read is refused here.
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor, fx, nn
from torch.utils import _pytree as pytree

from mqbench.utils.tracer import dict_input

__all__ = ["ModelInputs", "describe", "model_inputs", "rebuild", "resolve_inputs"]

_FORMS = (
    "a tensor, a tuple/list of the forward's positional arguments (tensors, or dicts/tuples/lists of tensors) "
    "optionally ending in a dict of keyword inputs (torch.onnx.export's form: ({'image': t}, {}) for one dict "
    "argument), or a dict (keyword inputs by parameter name, the value of a forward's one dict argument, or "
    "name -> tensor)"
)


@dataclass
class ModelInputs:
    """One call of the model: its positional arguments, their tensors in order and the ONNX name of each."""

    args: tuple[Any, ...]
    tensors: list[Tensor]
    names: list[str]
    structure: pytree.TreeSpec

    @property
    def structured(self) -> bool:
        """Whether an argument is a dict, tuple or list (not every argument a tensor)."""
        return not all(isinstance(a, Tensor) for a in self.args)


def rebuild(structure: pytree.TreeSpec | None, tensors: Sequence[Tensor]) -> tuple[Any, ...]:
    """Positional arguments of ``structure`` (a ``ModelInputs.structure``; None: one tensor each) from ``tensors``."""
    if structure is None:
        return tuple(tensors)
    return tuple(pytree.tree_unflatten(list(tensors), structure))


def describe(args: Sequence[Any]) -> str:
    """The arguments with each tensor shown as its shape: ``[[1, 3, 8, 8]]`` for tensors, else the structure."""
    if all(isinstance(a, Tensor) for a in args):
        return f"inputs of shapes {[list(a.shape) for a in args]}"
    shapes = pytree.tree_map_only(Tensor, lambda t: list(t.shape), tuple(args))
    return f"inputs {shapes!r}"


@dataclass
class _Forward:
    """What binding needs from ``model.forward``: its positional parameters and how they are read."""

    parameters: list[str] | None  # None: no signature
    required: int
    gathered: list[str] | None  # the keys of a dict argument split into parameters of their own
    graph: fx.Graph | None

    @classmethod
    def of(cls, model: nn.Module | None) -> _Forward:
        graph = model.graph if isinstance(model, fx.GraphModule) else None
        if model is None:
            return cls(None, 0, None, None)
        try:
            signature = inspect.signature(model.forward)
        except (TypeError, ValueError):
            return cls(None, 0, None, graph)
        kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        positional = [p for p in signature.parameters.values() if p.kind in kinds]
        required = sum(p.default is inspect.Parameter.empty for p in positional)
        gathered = None
        if graph is not None:
            for node in graph.nodes:
                if node.op == "call_function" and node.target is dict_input:
                    gathered = [str(key) for key in node.args[0]]
                    break
        return cls([p.name for p in positional], required, gathered, graph)

    def read_as_tensor(self, parameter: str) -> bool:
        """Whether the graph reads ``parameter`` as a tensor (not by key, as a dict): False without a graph."""
        if self.graph is None:
            return False
        for node in self.graph.nodes:
            if node.op == "placeholder" and node.target == parameter:
                return not any(_reads_as_dict(user, node) for user in node.users)
        return False


def _reads_as_dict(user: fx.Node, placeholder: fx.Node) -> bool:
    if user.op == "call_function" and user.target is dict_input:
        return True
    if user.op == "call_function" and user.target is operator.getitem and user.args[0] is placeholder:
        return isinstance(user.args[1], str)
    return user.op == "call_method" and user.target in ("get", "keys", "items", "values", "update")


def model_inputs(
    model: nn.Module | None, given: Any, shape_names: Sequence[str] | None = None, what: str = "dummy_input"
) -> ModelInputs:
    """``given`` (see the module docstring) as a call of ``model``'s forward and its ONNX inputs.

    ``shape_names`` (``input_shape_dict``'s names) name the tensors where they are as many, or the
    positional arguments where the call has keyword inputs too. ``what`` names ``given`` in errors.
    """
    forward = _Forward.of(model)
    if isinstance(given, Tensor):
        args, labels, count = (given,), ["input_0"], 1
    elif isinstance(given, Mapping):
        (args, labels), count = _bind_dict(forward, (), given, what, whole=True), 0
    elif isinstance(given, (tuple, list)):
        items = tuple(given)
        if items and isinstance(items[-1], Mapping):
            (args, labels), count = _bind_dict(forward, items[:-1], items[-1], what, whole=False), len(items) - 1
        else:
            args, labels, count = items, [f"input_{i}" for i in range(len(items))], len(items)
    else:
        raise ValueError(f"{what} must be {_FORMS}; got {type(given).__name__}")
    _check_dict_keys(forward, args, what)
    leaves, structure = pytree.tree_flatten_with_path(args)
    for path, leaf in leaves:
        if leaf is None and len(path) == 1 and isinstance(path[0], pytree.SequenceKey) and forward.parameters:
            index = path[0].idx
            name = forward.parameters[index] if index < len(forward.parameters) else f"argument {index}"
            raise ValueError(
                f"{what}: argument {index} ({name!r}) is None, and every input of the deployment is a tensor. An "
                f"argument the model is deployed without is fixed when it is prepared: prepare_custom_config_dict="
                f"{{'concrete_args': {{{name!r}: None}}}} (the prepared model then defaults it to None), and "
                f"{what} leaves it out"
            )
        if not isinstance(leaf, Tensor):
            raise ValueError(
                f"{what}: {_shown_path(path, labels)} is a {type(leaf).__name__}, not a tensor; every input of the "
                f"deployment is a tensor. Give it as a tensor, or make it a constant of the model. {what} must be "
                f"{_FORMS}"
            )
    if not leaves:
        raise ValueError(f"{what} holds no tensor; it must be {_FORMS}")
    tensors = [leaf for _, leaf in leaves]
    paths = [path for path, _ in leaves]
    names = _names(paths, labels)
    if shape_names is not None and not isinstance(given, Mapping):  # a dict names its inputs itself
        shape_names = list(shape_names)
        if len(shape_names) == len(tensors):
            names = shape_names
        elif count and len(shape_names) == count:  # the positional arguments; the keyword inputs by parameter
            names = _names(paths, [*shape_names, *labels[count:]])
        else:
            raise ValueError(
                f"input_shape_dict names {len(shape_names)} inputs but {what} has {len(tensors)} tensors; leave "
                f"input_shape_dict out ({what} gives the shapes) or name them all"
            )
    return ModelInputs(tuple(args), tensors, names, structure)


def _bind_dict(
    forward: _Forward, positional: tuple[Any, ...], given: Mapping[Any, Any], what: str, whole: bool
) -> tuple[tuple[Any, ...], list[str]]:
    """Positional arguments and their labels for ``(*positional, given)`` (``whole``: ``given`` is all of it)."""
    bad = [key for key in given if not isinstance(key, str)]
    if bad:
        raise ValueError(
            f"{what}: a dict's keys must be strings (the forward's parameter names, or the keys the model reads "
            f"from its dict argument); got {bad[:5]}"
        )
    # positional arguments before keyword inputs are named after their parameters (as torch.onnx.export names them)
    names = forward.parameters or []
    labels = [names[i] if i < len(names) else f"input_{i}" for i in range(len(positional))]
    if not given:
        if whole:
            raise ValueError(f"{what} is an empty dict; it must be {_FORMS}")
        return positional, labels  # torch.onnx.export's empty keyword inputs
    if forward.parameters is None:
        if whole:
            return tuple(given.values()), list(given)
        raise ValueError(f"{what} ends in a dict of keyword inputs but the model's forward has no signature")
    parameters = forward.parameters
    later = parameters[len(positional) :]
    unknown = [key for key in given if key not in later]
    if not unknown:
        return _keywords(parameters, positional, given, what, labels)
    if len(unknown) < len(given):
        raise ValueError(
            f"{what}'s keyword inputs {unknown} are not parameters of the model's forward after the "
            f"{len(positional)} positional input(s); it takes {parameters}" + _gathered_hint(forward)
        )
    # no key names a parameter
    if forward.gathered is not None:
        raise ValueError(
            f"{what}'s keys {unknown} match none of the inputs of the model: its forward reads the keys "
            f"{forward.gathered} from its dict argument. Give the dict with those keys"
        )
    nxt = parameters[len(positional)] if len(positional) < len(parameters) else None
    if nxt is not None and forward.required == len(positional) + 1 and not forward.read_as_tensor(nxt):
        return (*positional, dict(given)), [*labels, nxt]  # the value of the forward's dict argument
    if whole:
        return tuple(given.values()), list(given)  # input name -> tensor
    raise ValueError(
        f"{what}'s keyword inputs {unknown} are not parameters of the model's forward after the "
        f"{len(positional)} positional input(s); it takes {parameters}"
    )


def _gathered_hint(forward: _Forward) -> str:
    if forward.gathered is None:
        return ""
    return f" (the keys it reads from its dict argument: give the dict with keys among {forward.gathered})"


def _keywords(
    parameters: list[str], positional: tuple[Any, ...], keywords: Mapping[str, Any], what: str, labels: list[str]
) -> tuple[tuple[Any, ...], list[str]]:
    """``(*positional, {name: value})`` bound to the forward's parameters by name, as ``torch.onnx.export`` binds a
    trailing dict; a parameter before the last given one must be given too."""
    given = [*parameters[: len(positional)], *(p for p in parameters if p in keywords)]
    last = max(i for i, p in enumerate(parameters) if p in given)
    skipped = [p for p in parameters[: last + 1] if p not in given]
    if skipped:
        raise ValueError(
            f"{what} gives {given} but not {skipped}, which come before them in the model's forward "
            f"{parameters}; add them to the dict"
        )
    bound = parameters[len(positional) : last + 1]
    return (*positional, *(keywords[p] for p in bound)), [*labels, *bound]


def _check_dict_keys(forward: _Forward, args: tuple[Any, ...], what: str) -> None:
    """A dict passed whole to a forward whose dict keys are parameters of their own holds only keys it reads."""
    if forward.gathered is None or forward.parameters is None:
        return
    first = forward.parameters.index(forward.gathered[0]) if forward.gathered[0] in forward.parameters else None
    if first is None or first >= len(args) or not isinstance(args[first], Mapping):
        return
    unknown = [key for key in args[first] if key not in forward.gathered]
    if unknown:
        raise ValueError(
            f"{what}: the dict argument has keys {unknown} that the model does not read; its forward reads "
            f"{forward.gathered} from it. Give the dict with those keys"
        )


def _part(key: Any) -> str:
    if isinstance(key, pytree.MappingKey):
        return str(key.key)
    if isinstance(key, pytree.SequenceKey):
        return str(key.idx)
    if isinstance(key, pytree.GetAttrKey):
        return str(key.name)
    return str(key)


def _shown_path(path: tuple[Any, ...], labels: Sequence[str]) -> str:
    index = path[0].idx
    top = labels[index] if index < len(labels) else f"argument {index}"
    return top + "".join(f"[{_part(k)!r}]" if isinstance(k, pytree.MappingKey) else f"[{_part(k)}]" for k in path[1:])


def _names(paths: Sequence[tuple[Any, ...]], labels: Sequence[str]) -> list[str]:
    """One ONNX input name per tensor: from the innermost dict key on, else the argument's label (see the module)."""
    short, full = [], []
    for path in paths:
        parts = [_part(key) for key in path[1:]]
        whole = "_".join([labels[path[0].idx], *parts])
        keyed = [i for i, key in enumerate(path[1:]) if isinstance(key, pytree.MappingKey)]
        full.append(whole)
        short.append("_".join(parts[keyed[-1] :]) if keyed else whole)
    repeated = {name for name in short if short.count(name) > 1}
    names = [f if s in repeated else s for s, f in zip(short, full, strict=True)]
    if len(set(names)) != len(names):
        raise ValueError(f"the inputs would take repeated names {names}; name each with input_names=[...]")
    return names


def resolve_inputs(model: nn.Module, result: Any, inputs: Any) -> tuple[tuple[Any, ...], list[Tensor]]:
    """``verify_deploy``'s ``inputs`` for the deployment ``result``: the model's positional arguments (in the
    structure it was deployed with) and the tensors, one per ONNX input in order.

    ``inputs`` is a mapping of (at least) the ONNX input names, or the model's call as ``dummy_input`` takes it.
    """
    names = list(result.input_names)
    structure = getattr(result, "input_structure", None)
    if isinstance(inputs, Mapping) and set(names) <= set(inputs):  # by input name (other entries unused)
        tensors = [inputs[name] for name in names]
        bad = [name for name, t in zip(names, tensors, strict=True) if not isinstance(t, Tensor)]
        if not bad:
            return rebuild(structure, tensors), tensors
    try:
        call = model_inputs(model, inputs, what="inputs")
    except ValueError as error:
        raise ValueError(f"{error}. The deployment has inputs {names}") from None
    if set(call.names) == set(names) and len(call.names) == len(names):
        by_name = dict(zip(call.names, call.tensors, strict=True))
        tensors = [by_name[name] for name in names]
    elif len(call.tensors) == len(names):
        tensors = call.tensors  # by position (the deployment's names were chosen at deploy time)
    else:
        raise ValueError(
            f"the deployment has inputs {names}; got {len(call.tensors)} input tensor(s) ({call.names}). Give "
            "inputs as the model is called (as dummy_input was), or a dict of those names -> tensors"
        )
    return rebuild(structure if structure is not None else call.structure, tensors), tensors
