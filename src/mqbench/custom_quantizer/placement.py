"""Where activation quantizers go: one engine driven by a backend's :class:`Placement` rules."""

from __future__ import annotations

import operator
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.utils._pytree as pytree
from torch import fx, nn

from mqbench.backends.spec import Placement
from mqbench.custom_quantizer.ops import WEIGHTED_KINDS, edge_layers, is_identity, node_kind
from mqbench.fake_quantize.quantize_base import QuantizeBase
from mqbench.utils.tracer import dict_input

__all__ = ["ActivationSite", "plan_activation_quantizers", "quantized_residual_adds"]

_NON_TENSOR_METHODS = frozenset({"size", "dim", "numel", "__len__", "tolist", "item"})
# ops that move a tensor's values without computing new ones (a quantizer before them quantizes the result)
_DATA_MOVEMENT = frozenset(
    {"transpose", "permute", "reshape", "view", "contiguous", "flatten", "squeeze", "unsqueeze", "expand", "t"}
)
_ACTIVATION_ANCESTORS = frozenset({"linear", "conv", "deconv", "matmul", "layernorm"})


@dataclass
class ActivationSite:
    """One activation quantizer: the value it quantizes and who reads the quantized value."""

    value: fx.Node
    consumers: set[fx.Node] | None = field(default_factory=set)  # None: all users
    unsigned: bool = False
    eight_bit: bool = False
    group: int = -1  # sites of one group share a quantizer module
    # the right operand of a product of two activations (attention's K^T, V): it takes the weights'
    # place in int8 kernels, so reduce_range narrows it as it narrows weights
    product_operand: bool = False
    # either operand of a product of two activations (attention's queries and keys)
    product_input: bool = False


def _never(node: fx.Node) -> bool:
    return False


@dataclass(frozen=True)
class Rules:
    """Placement rules plus the user's additions and exclusions, resolved for one model.

    ``quantize_output`` adds nodes whose output is quantized for every reader, and
    ``share_inputs`` nodes whose tensor inputs share one quantizer, by node rather than by op
    kind (what a declarative backend decides per matched pattern).
    """

    placement: Placement
    quantize_input: Callable[[fx.Node], bool]
    excluded: Callable[[fx.Node], bool]
    quantize_output: Callable[[fx.Node], bool] = _never
    share_inputs: Callable[[fx.Node], bool] = _never


def _is_tensor(node: fx.Node, memo: dict[fx.Node, bool]) -> bool:
    """Best-effort: does the node produce a tensor (not a size, shape entry or Python number)?"""
    if node in memo:
        return memo[node]
    result = True
    if "val" in node.meta and node.meta["val"] is not None:  # recorded by torch.export capture
        result = isinstance(node.meta["val"], torch.Tensor)
    elif (node.op == "call_method" and node.target in _NON_TENSOR_METHODS) or (
        node.op == "call_function" and node.target in (getattr, pytree.tree_unflatten)
    ):
        result = False
    elif node.op in ("call_function", "call_method") and node.target in (operator.getitem, "__getitem__"):
        source = node.args[0]
        result = isinstance(source, fx.Node) and _is_tensor(source, memo)
    elif node.op in ("call_function", "call_method"):
        inputs = node.all_input_nodes
        result = not inputs or any(_is_tensor(a, memo) for a in inputs)
    memo[node] = result
    return result


def _integer(node: fx.Node) -> bool:
    """Whether the capture recorded ``node`` as an integer or boolean tensor (torch.export records dtypes; a
    torch.fx node's dtype is unknown): position arithmetic, token ids, masks. No quantizer reads such a value."""
    value = node.meta.get("val")
    return isinstance(value, torch.Tensor) and not (value.is_floating_point() or value.is_complex())


def _tensor_args(node: fx.Node, memo: dict[fx.Node, bool], unique: bool = True) -> list[fx.Node]:
    """The tensor-valued nodes among ``node``'s arguments (each once unless ``unique`` is False)."""
    nodes: list[fx.Node] = []

    def collect(argument: fx.Node) -> fx.Node:
        nodes.append(argument)
        return argument

    fx.node.map_arg((node.args, node.kwargs), collect)
    return [n for n in (dict.fromkeys(nodes) if unique else nodes) if n.op != "get_attr" and _is_tensor(n, memo)]


def _network_outputs(output: fx.Node, memo: dict[fx.Node, bool]) -> list[fx.Node]:
    """The tensors a model returns, also from inside the structure it rebuilds them into (a Hugging Face
    ``ModelOutput`` captured with torch.export is ``tree_unflatten(leaves, spec)``: the leaves are the outputs)."""
    values: list[fx.Node] = []
    for value in _tensor_args(output, memo) + [n for n in output.all_input_nodes if _rebuilds_structure(n)]:
        leaves = _tensor_args(value, memo) if _rebuilds_structure(value) else [value]
        values += [leaf for leaf in leaves if leaf not in values]
    return values


def _rebuilds_structure(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is pytree.tree_unflatten


def _has_activation_ancestor(node: fx.Node, kinds: Mapping[fx.Node, str | None], memo: dict[fx.Node, bool]) -> bool:
    if node in memo:
        return memo[node]
    memo[node] = False  # cycles cannot occur in a DAG; this also bounds recursion on shared inputs
    result = kinds.get(node) in _ACTIVATION_ANCESTORS or any(
        _has_activation_ancestor(a, kinds, memo) for a in node.all_input_nodes
    )
    memo[node] = result
    return result


def quantized_residual_adds(graph: fx.Graph, modules: Mapping[str, nn.Module]) -> list[str]:
    """The adds of a normalised stream (residual adds, see :func:`_on_normalised_stream`) whose inputs or output
    an activation quantizer of the prepared ``graph`` reads."""
    kinds = {node: node_kind(node, modules) for node in graph.nodes}

    def quantizes(node: fx.Node) -> bool:
        return node.op == "call_module" and isinstance(modules.get(str(node.target)), QuantizeBase)

    found = []
    for node in graph.nodes:
        if kinds[node] != "add" or not _on_normalised_stream(node, kinds):
            continue
        if any(quantizes(user) for user in node.users) or any(quantizes(value) for value in node.all_input_nodes):
            found.append(node.name)
    return found


def _on_normalised_stream(add: fx.Node, kinds: Mapping[fx.Node, str | None]) -> bool:
    """Whether a layernorm reads ``add``'s output or one of its inputs (through adds, data movement or dropout):
    the residual add of a post-norm block (its output normalised) or of a pre-norm block (its stream input is),
    and the sum of embeddings a norm reads."""

    def normalised(value: fx.Node) -> bool:
        return any(
            kinds.get(user) == "layernorm" or (kinds.get(user) in _PASS_TO_NORM and normalised(user))
            for user in value.users
        )

    return normalised(add) or any(normalised(value) for value in add.all_input_nodes)


_PASS_TO_NORM = frozenset({"add", "dropout", "reshape", "flatten"})


def _from_layers(node: fx.Node, kinds: Mapping[fx.Node, str | None], memo: dict[fx.Node, bool]) -> bool:
    """Whether ``node`` is computed from a layer's output (the activations). Not so: values computed only from the
    model's inputs and constants, such as an attention mask ``(1 - mask) * finfo.min`` (its input an integer or a
    float mask; torch.fx does not know which) or position arithmetic."""
    if node in memo:
        return memo[node]
    memo[node] = False  # bounds recursion on shared inputs
    if kinds.get(node) in _ACTIVATION_ANCESTORS or kinds.get(node) == "embedding":
        result = True
    elif node.op in ("placeholder", "get_attr"):
        result = False
    else:
        result = any(_from_layers(a, kinds, memo) for a in node.all_input_nodes)
    memo[node] = result
    return result


# ops whose result depends on their tensor input's shape alone (export records sizes as these calls), and
# ``arange``, positions over a length (a constant where the capture fixed the length)
_POSITION_SOURCES = frozenset(
    {"size", "sym_size", "dim", "numel", "sym_numel", "new_ones", "new_zeros", "new_full", "new_empty"}
    | {"zeros_like", "ones_like", "empty_like", "full_like", "arange"}
)


def _from_positions(node: fx.Node, modules: Mapping[str, nn.Module], memo: dict[fx.Node, tuple[bool, bool]]) -> bool:
    """Whether ``node`` is position arithmetic: computed from positions (``arange`` over a length, tensor sizes) and
    buffers, and from no network input's values, no parameter and no layer's output. A rotary embedding's angles
    ``positions * inv_freq`` are such a value, fixed for a given shape: a runtime computes them in float (a grid
    of 256 steps over positions 0..255 turns every angle), so no quantizer reads them."""
    return _value_sources(node, modules, memo) == (False, True)


def _value_sources(
    node: fx.Node, modules: Mapping[str, nn.Module], memo: dict[fx.Node, tuple[bool, bool]]
) -> tuple[bool, bool]:
    """(computed from values: a network input's, a parameter's or a layer's output; computed from positions)."""
    if node in memo:
        return memo[node]
    memo[node] = (True, False)  # bounds recursion on shared inputs
    if node.op == "placeholder":
        result = (True, False)
    elif node.op == "get_attr":
        owner, _, name = str(node.target).rpartition(".")
        module = modules.get(owner)
        result = (module is None or isinstance(getattr(module, name, None), nn.Parameter), False)
    elif _reads_metadata(node) or (node.op == "call_function" and _name_of(node) in _POSITION_SOURCES):
        result = (False, True)
    elif node.op == "call_module" and any(True for _ in modules[str(node.target)].parameters(recurse=False)):
        result = (True, False)
    else:
        found = [_value_sources(a, modules, memo) for a in node.all_input_nodes]
        result = (any(values for values, _ in found), any(sized for _, sized in found))
    memo[node] = result
    return result


_SENTINEL = 1e30  # a fill value at least this large stands for "masked out" (finfo.min, -inf)
_Memos = tuple[dict[fx.Node, bool], dict[fx.Node, bool]]  # (from layers, holds a sentinel) per node
_FILLING = frozenset({"where", "masked_fill", "masked_fill_"})
_ADDING = frozenset({"add", "sub", "add_", "sub_", "__add__", "__sub__", "__iadd__", "__isub__"})


def _name_of(node: fx.Node) -> str:
    if node.op == "call_method":
        return str(node.target)
    name = getattr(node.target, "__name__", "") or ""
    return name.split(".")[0]


def _is_sentinel(value: typing.Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) >= _SENTINEL


def _holds_sentinel(node: fx.Node, kinds: Mapping[fx.Node, str | None], memos: _Memos) -> bool:
    """Whether ``node`` is mask arithmetic built with a sentinel: computed from no layer's output (see
    :func:`_from_layers`) and with a literal beyond 1e30 (``finfo.min``, ``-inf``) among the arguments of it or
    of what it is computed from."""
    data, memo = memos
    if node in memo:
        return memo[node]
    memo[node] = False
    result = (
        node.op in ("call_function", "call_method")
        and not _from_layers(node, kinds, data)
        and (
            any(_is_sentinel(v) for v in pytree.tree_leaves((node.args, node.kwargs)))
            or any(_holds_sentinel(a, kinds, memos) for a in node.all_input_nodes)
        )
    )
    memo[node] = result
    return result


def _masked(node: fx.Node, kinds: Mapping[fx.Node, str | None], memos: _Memos) -> bool:
    """Whether ``node`` combines values with an attention mask that holds a sentinel: a ``where`` /
    ``masked_fill`` whose fill value is a literal beyond 1e30 or mask arithmetic built with one, or an ``add`` /
    ``sub`` of such mask arithmetic. Its masked entries hold ``finfo.min``: no integer grid holds both them and
    the values, so it is not quantized (an added position encoding or a -10000 mask is a range like any other)."""
    if node.op not in ("call_function", "call_method"):
        return False
    name = _name_of(node)
    if name in _FILLING:
        condition = 0 if name == "where" else 1
        fills = [a for i, a in enumerate(node.args) if i != condition and (name == "where" or i > 0)]
        fills += [v for k, v in node.kwargs.items() if k in ("value", "other", "input")]
    elif name in _ADDING:
        fills = [a for a in node.args if isinstance(a, fx.Node)]
    else:
        return False
    return any(_is_sentinel(f) or (isinstance(f, fx.Node) and _holds_sentinel(f, kinds, memos)) for f in fills)


# Elementwise ops an activation function is written from (with scalar constants), and the non-linear ones.
_NONLINEAR = frozenset({"tanh", "sigmoid", "erf", "exp", "hardsigmoid", "relu", "relu6", "hardtanh", "clamp"})
_ELEMENTWISE = _NONLINEAR | {"add", "sub", "mul", "truediv", "div", "rsub", "neg", "pow", "square"}
_ELEMENTWISE |= {f"__{name}__" for name in ("add", "sub", "mul", "truediv", "radd", "rsub", "rmul", "pow", "neg")}


def _composite_activations(graph: fx.Graph, tensor_memo: dict[fx.Node, bool]) -> set[fx.Node]:
    """The ops of activation functions written as elementwise arithmetic of one tensor ``x``: tanh GELU
    ``0.5 * x * (1 + tanh(0.798 * (x + 0.045 * x ** 3)))``, erf GELU, ``x * sigmoid(x)``,
    ``x * hardsigmoid(x)``. Such a function is one activation op to a backend (its runtime computes it fused,
    in float), so no quantizer goes between its ops: a top is a binary op of two values computed from ``x`` alone,
    one of them through a non-linear op and the other not; the function's ops are those between ``x`` and the top
    (``x * x``, with nothing non-linear, and ``sigmoid(x) * tanh(x)`` are integer products like any other)."""
    root: dict[fx.Node, fx.Node] = {}  # the tensor a node is an elementwise function of (itself if none)
    bent: dict[fx.Node, bool] = {}  # computed from its root through a non-linear op
    tops = []
    for node in graph.nodes:
        root[node], bent[node] = node, False
        if node.op not in ("call_function", "call_method") or _name_of(node) not in _ELEMENTWISE:
            continue
        tensors = [a for a in node.all_input_nodes if _is_tensor(a, tensor_memo)]
        sources = {root.get(a, a) for a in tensors}
        if len(sources) != 1:
            continue
        (source,) = sources
        root[node] = source
        bent[node] = _name_of(node) in _NONLINEAR or any(bent.get(a, False) for a in tensors)
        if len(tensors) == 2 and sorted(bent.get(a, False) for a in tensors) == [False, True]:
            tops.append(node)  # x (or x scaled) times a non-linear function of x
    inside: set[fx.Node] = set()
    for top in tops:
        stack = [top]
        while stack:
            node = stack.pop()
            if node in inside or node is root[top] or root.get(node) is not root[top]:
                continue
            inside.add(node)
            stack.extend(node.all_input_nodes)
    return inside


def _single_user(node: fx.Node) -> fx.Node | None:
    """The one node that reads ``node``'s values, if one does; reads of its shape, size or dtype do not count (export
    records them as symbols where fx records ``x.shape`` and ``x.size()``)."""
    users = [user for user in node.users if not _reads_metadata(user)]
    return users[0] if len(users) == 1 else None


def _reads_metadata(node: fx.Node) -> bool:
    """Whether ``node`` reads only a tensor's metadata (``x.shape``, ``x.size(0)``, ``x.dim()``, ``x.dtype``)."""
    if node.op == "call_method":
        return node.target in ("size", "dim", "numel", "__len__")
    return (
        node.op == "call_function"
        and node.target is getattr
        and node.args[1:2]
        in (
            ("shape",),
            ("dtype",),
            ("device",),
            ("ndim",),
        )
    )


def _ends_in_relu(node: fx.Node, modules: Mapping[str, nn.Module], kinds: Mapping[fx.Node, str | None]) -> bool:
    if kinds.get(node) == "relu":
        return True
    if node.op == "call_module":
        return bool(getattr(modules[str(node.target)], "ends_with_relu", False))
    return False


_CONTAINER_NAMES = frozenset({"dict", "Dict", "Mapping", "list", "List", "tuple", "Tuple", "Sequence"})
_SCALAR_NAMES = frozenset({"bool", "int", "float", "complex", "str"})


def _is_getitem(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is operator.getitem


def _annotation(node: fx.Node) -> str | None:
    """'container', 'scalar' or None (a tensor or unknown) from a placeholder's type annotation."""
    annotation = typing.get_origin(node.type) or node.type
    if isinstance(annotation, str):  # postponed annotations (from __future__ import annotations)
        name = annotation.split("[", 1)[0].rsplit(".", 1)[-1].strip()
        return "container" if name in _CONTAINER_NAMES else "scalar" if name in _SCALAR_NAMES else None
    if isinstance(annotation, type) and issubclass(annotation, (bool, int, float, complex, str)):
        return "scalar"
    if isinstance(annotation, type) and issubclass(annotation, (Mapping, Sequence)):
        return "container"
    return None


def _is_guard(node: fx.Node) -> bool:
    """A check torch.fx adds for a ``concrete_args`` value (``_assert(x == value)`` / ``_assert_is_none(x)``)."""
    if node.op != "call_function":
        return False
    if node.target is torch._assert or getattr(node.target, "__name__", None) == "_assert_is_none":
        return True
    return node.target is operator.eq and bool(node.users) and all(_is_guard(user) for user in node.users)


def _input_tensors(node: fx.Node) -> list[fx.Node]:
    """The tensors a network input carries: itself, or the items read from a dict / list / tuple input."""
    if not node.users or all(_is_guard(user) for user in node.users):
        return []  # unused, or a value fixed by concrete_args
    kind = _annotation(node) if node.op == "placeholder" else None
    if kind == "scalar":
        return []
    if kind == "container" or (node.type is None and all(_is_getitem(user) for user in node.users)):
        return [value for user in node.users if _is_getitem(user) for value in _input_tensors(user)]
    return [node]


def plan_activation_quantizers(
    graph: fx.Graph,
    modules: Mapping[str, nn.Module],
    rules: Rules,
) -> list[ActivationSite]:
    """The activation quantizers a backend's rules call for, in graph order."""
    placement = rules.placement
    kinds = {node: node_kind(node, modules) for node in graph.nodes}
    tensor_memo: dict[fx.Node, bool] = {}
    ancestor_memo: dict[fx.Node, bool] = {}
    sites: dict[fx.Node, ActivationSite] = {}

    data_memo: dict[fx.Node, bool] = {}
    sentinel_memo: dict[fx.Node, bool] = {}
    sources_memo: dict[fx.Node, tuple[bool, bool]] = {}

    def mark(value: fx.Node, consumer: fx.Node | None) -> ActivationSite | None:
        if value.op == "get_attr" or not _is_tensor(value, tensor_memo) or _integer(value):
            return None
        if _from_positions(value, modules, sources_memo):
            return None  # position arithmetic (rotary angles, their cos and sin): float, as runtimes compute it
        memos = (data_memo, sentinel_memo)
        if _holds_sentinel(value, kinds, memos) or _masked(value, kinds, memos):
            return None  # an attention mask holding finfo.min, or values it filled or was added to
        site = sites.setdefault(value, ActivationSite(value))
        if consumer is None:
            site.consumers = None
        elif site.consumers is not None:
            site.consumers.add(consumer)
        return site

    edges = edge_layers(graph, modules) if placement.first_last_8bit else set()
    shared_groups: list[list[fx.Node]] = []
    composite = _composite_activations(graph, tensor_memo)

    for node in graph.nodes:
        kind = kinds[node]
        if node.op in ("placeholder", "output", "get_attr") or rules.excluded(node):
            continue
        if rules.quantize_input(node) and node not in composite and not _from_positions(node, modules, sources_memo):
            inputs = _tensor_args(node, tensor_memo)
            if node.op == "call_module" or kind in WEIGHTED_KINDS:
                inputs = inputs[:1]  # the activation; weights belong to the module
            elif kind in ("add", "mul", "matmul") and (
                len(_tensor_args(node, tensor_memo, unique=False)) < 2 or any(_integer(a) for a in inputs)
            ):
                inputs = []  # an op with a constant or an integer tensor is not an integer binary op (x * x is)
            if kind == "add" and placement.fused_mul_add:
                inputs = [a for a in inputs if not (kinds[a] == "mul" and _single_user(a) is node)]
            if (
                kind == "add"
                and placement.add_needs_activations
                and not all(_has_activation_ancestor(a, kinds, ancestor_memo) for a in inputs)
            ):
                inputs = []
            if kind == "add" and placement.float_residual_adds and _on_normalised_stream(node, kinds):
                inputs = []
            if kind == "matmul" and placement.float_attention_values and _weighs_by_softmax(node, kinds, modules):
                inputs = []
            places = [(value, node) for value in inputs]  # (the value quantized, who reads the quantized value)
            if kind == "matmul" and placement.matmul_inputs_at_layers:
                places = [_at_layer_output(value, node, kinds, modules) for value in inputs]
            for value, reader in places:
                site = mark(value, reader)
                if site is not None and node in edges:
                    site.eight_bit = True
        if kind in placement.shared_inputs_of or rules.share_inputs(node):
            # the quantizers of these inputs (input- or output-placed) share one module
            shared = _tensor_args(node, tensor_memo)
            if len(shared) > 1:
                shared_groups.append(shared)
        if kind in placement.outputs_of or rules.quantize_output(node):
            target = node
            while (user := _single_user(target)) is not None and kinds[user] in placement.passthrough:
                target = user
            mark(target, None)

    if placement.network_inputs:
        # Only inputs that carry activations into quantized ops: token ids feeding an embedding
        # and attention masks are integers or flags, never quantized.
        quantized_kinds = placement.inputs_of | placement.outputs_of | WEIGHTED_KINDS
        for node in graph.nodes:
            # a forward taking a dict is traced with one placeholder per key, gathered by dict_input
            if node.op == "placeholder" or (node.op == "call_function" and node.target is dict_input):
                for value in _input_tensors(node):
                    if any(kinds.get(user) in quantized_kinds for user in value.users):
                        mark(value, None)
    if placement.network_outputs:
        output = next(n for n in graph.nodes if n.op == "output")
        for value in _network_outputs(output, tensor_memo):
            mark(value, output)

    sources = _merge_aliases(sites, modules)
    shared_groups += [values for values in sources.values() if len(values) > 1]
    _mark_product_operands(graph, kinds, sites, tensor_memo, modules)
    ordered = [sites[n] for n in graph.nodes if n in sites]
    for site in ordered:
        source = _alias_source(site.value, modules)
        site.unsigned = any(kinds.get(source) == k for k in placement.unsigned_after) or (
            "relu" in placement.unsigned_after and _ends_in_relu(source, modules, kinds)
        )
    _assign_groups(ordered, shared_groups, sites)
    return ordered


def _weighs_by_softmax(matmul: fx.Node, kinds: Mapping[fx.Node, str | None], modules: Mapping[str, nn.Module]) -> bool:
    """Whether ``matmul`` reads a softmax's output (past data movement and dropout): attention weights x values."""
    for value in matmul.all_input_nodes:
        source: fx.Node | None = value
        while source is not None and kinds.get(source) != "softmax":
            source = _moved_from(source, modules)
        if source is not None:
            return True
    return False


def _moved_from(node: fx.Node, modules: Mapping[str, nn.Module]) -> fx.Node | None:
    """The tensor a data-movement or identity-like op reads, else None."""
    if is_identity(node, modules):
        return typing.cast(fx.Node, node.args[0])
    if node.op not in ("call_method", "call_function"):
        return None
    # a torch.export graph's aten overloads (``aten.transpose.int``) by their op's name
    target = node.target
    name = target if node.op == "call_method" else getattr(target, "_opname", getattr(target, "__name__", None))
    source = node.args[0] if node.args else None
    return source if name in _DATA_MOVEMENT and isinstance(source, fx.Node) else None


def _at_layer_output(
    value: fx.Node, reader: fx.Node, kinds: Mapping[fx.Node, str | None], modules: Mapping[str, nn.Module]
) -> tuple[fx.Node, fx.Node]:
    """Where ``reader``'s input ``value`` is quantized under ``Placement.matmul_inputs_at_layers``, as (the value
    quantized, who reads it): a linear or convolution layer's output and the data movement reading it, where that
    output reaches ``value`` through data movement alone, each step read only by the next; else ``value`` and
    ``reader``."""
    step, after = value, reader
    while _single_user(step) is after:
        source = _moved_from(step, modules)
        if source is None:
            break
        step, after = source, step
    if step is value or kinds.get(step) not in ("linear", "conv") or _single_user(step) is not after:
        return value, reader
    return step, after


def _mark_product_operands(
    graph: fx.Graph,
    kinds: Mapping[fx.Node, str | None],
    sites: Mapping[fx.Node, ActivationSite],
    memo: dict[fx.Node, bool],
    modules: Mapping[str, nn.Module],
) -> None:
    """Mark the quantizers of each product of two activations' operands (found past data movement), and its right
    operand's as such."""
    for node in graph.nodes:
        if kinds.get(node) != "matmul":
            continue
        operands = _tensor_args(node, memo, unique=False)
        if len(operands) != 2:
            continue
        for index, operand in enumerate(operands):
            value: fx.Node | None = operand
            while value is not None and value not in sites:
                value = _moved_from(value, modules)
            if value is not None:
                sites[value].product_input = True
                sites[value].product_operand |= index == 1


def _alias_source(node: fx.Node, modules: Mapping[str, nn.Module]) -> fx.Node:
    """The value ``node`` is at deploy time: itself, or the input of the identity-like ops producing it."""
    while is_identity(node, modules):
        node = typing.cast(fx.Node, node.args[0])
    return node


def _merge_aliases(
    sites: dict[fx.Node, ActivationSite], modules: Mapping[str, nn.Module]
) -> dict[fx.Node, list[fx.Node]]:
    """One quantizer per deployed tensor: sites on values that are one tensor once exported.

    A value produced by identity-like ops (``nn.Identity``, Dropout, ``clone`` ...) is its
    input at deploy time. Its site is dropped where an upstream value of the same chain is
    already quantized for every reader (it would quantize the quantized tensor again); the
    remaining sites of one tensor are returned grouped by that tensor, to share one module.
    """
    for value in list(sites):
        node = value
        while is_identity(node, modules):
            node = typing.cast(fx.Node, node.args[0])
            upstream = sites.get(node)
            if upstream is not None and upstream.consumers is None:
                upstream.eight_bit = upstream.eight_bit or sites.pop(value).eight_bit
                break
    groups: dict[fx.Node, list[fx.Node]] = {}
    for value in sites:
        groups.setdefault(_alias_source(value, modules), []).append(value)
    return groups


def _assign_groups(
    ordered: list[ActivationSite], shared: Iterable[list[fx.Node]], sites: Mapping[fx.Node, ActivationSite]
) -> None:
    parent = list(range(len(ordered)))
    index = {id(site): i for i, site in enumerate(ordered)}

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for values in shared:
        members = [index[id(sites[v])] for v in values if v in sites]
        for other in members[1:]:
            parent[find(other)] = find(members[0])
    for i, site in enumerate(ordered):
        site.group = find(i)
    # Sites of one group share one module, built for the first: make their grids agree.
    unsigned: dict[int, bool] = {}
    eight_bit: dict[int, bool] = {}
    for site in ordered:
        unsigned[site.group] = unsigned.get(site.group, True) and site.unsigned
        eight_bit[site.group] = eight_bit.get(site.group, False) or site.eight_bit
    product: dict[int, bool] = {}
    for site in ordered:
        product[site.group] = product.get(site.group, False) or site.product_operand
    for site in ordered:
        site.unsigned, site.eight_bit = unsigned[site.group], eight_bit[site.group]
        site.product_operand = product[site.group]
