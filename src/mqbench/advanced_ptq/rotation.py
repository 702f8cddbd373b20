"""Rotation of a pre-norm transformer's residual stream (QuaRot, Ashkboos et al., 2024), folded into its weights.

A pre-norm transformer (GPT-2, Llama) keeps a *residual stream*: embeddings and the output projections of its
attention and MLP blocks are added into it, and it is read only through normalization layers feeding linear
layers. Rotating the stream by an orthogonal ``Q`` (``x -> x Q``) changes none of the model's outputs when every
writer is multiplied by ``Q`` and every reader by ``Q^T``, but it spreads a few outlier channels over all of them,
so the values the quantizers see (the norms' outputs, the weights' input columns) have a smaller range for the same
information. With a (randomized) Hadamard ``Q`` the spread is as even as it gets.

What is done, in float64, to a model from ``prepare_by_platform``:

1. LayerNorm's scale ``g`` and shift ``b`` move into the linear layers reading it (``W <- W diag(g)``, bias
   ``+= W b``); LayerNorm's mean subtraction moves into the writers (each writes a zero-mean vector), so every
   LayerNorm becomes a plain RMS normalization (:class:`mqbench.nn.modules.RMSNorm` without weights), which
   commutes with ``Q``. An ``RMSNorm`` keeps its meaning with only its weight moved.
2. Writers: embedding tables ``E <- E Q``, linear layers ``W <- Q^T W`` (bias too); readers ``W <- W Q``.
3. ``ffn``: the input of each MLP's down projection (the layer writing the MLP's result to the stream) is
   rotated by a Hadamard matrix too, online: a constant ``x @ H`` is inserted before its input quantizer and the
   layer's weight becomes ``W H`` (one float MatMul per block in the deployed model).
4. Every quantizer of the model is recalibrated on ``cali_data`` (the backend's calibration recipe of the
   original model), since every range it saw has changed; the model is returned in quantization mode.

Post-norm models (BERT, all-MiniLM-L6-v2) read their stream elsewhere than through norms and keep the norm's
scale inside the stream: no rotation folds there, and they are refused with the value that breaks the pattern.
``residual: False`` rotates only the MLPs' down-projection inputs (step 3), an exact rewrite of those layers that
any transformer allows: a post-norm model's FFN activations (GELU outputs, with BERT's outlier channels) are the
inputs it flattens. :func:`mlp_down_projections` finds those layers.

``hadamard_rotation(model, cali_data, config)``; config keys in :data:`ROTATION_DEFAULTS`.
``model.meta["rotation"]`` records the layers changed.

Example:
    >>> import torch
    >>> from mqbench.models.decoder import TinyGPT
    >>> from mqbench.prepare_by_platform import prepare_by_platform
    >>> from mqbench.advanced_ptq import hadamard_rotation
    >>> from mqbench.utils.state import disable_all
    >>> _ = torch.manual_seed(0)
    >>> model = TinyGPT(dim=32, depth=2, heads=2, context=16).eval()
    >>> ids = torch.randint(0, 256, (4, 16))
    >>> qmodel = hadamard_rotation(prepare_by_platform(model, "tensorrt_nlp"), [ids])
    >>> disable_all(qmodel)  # quantizers off: the rotated model computes the float model's function
    >>> torch.allclose(qmodel(ids), model(ids), atol=1e-4)
    True
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn

from mqbench.advanced_ptq.calibration import calibrate, recipe_of
from mqbench.advanced_ptq.reconstruction import calibration_batches
from mqbench.advanced_ptq.weight_only import config_with
from mqbench.nn.modules.norms import Norm, norm_of
from mqbench.nn.modules.rms_norm import RMSNorm
from mqbench.utils.lazy_weights import require_weights
from mqbench.utils.logger import logger
from mqbench.utils.state import is_quantizer
from mqbench.utils.tied import shared_weights

__all__ = [
    "ROTATION_DEFAULTS",
    "hadamard_matrix",
    "hadamard_rotation",
    "mlp_down_projections",
    "orthogonal_matrix",
    "residual_streams",
]

ROTATION_DEFAULTS: Mapping[str, Any] = {
    "rotation": "hadamard",  # "hadamard" (randomized: random signs times a Hadamard matrix) or "random" orthogonal
    "seed": 0,  # the random signs / the random orthogonal matrix
    "residual": True,  # rotate the residual stream (pre-norm transformers); False: only the MLPs' online rotation
    "ffn": True,  # rotate each MLP down projection's input by a Hadamard matrix (online)
}

_ADDS = {operator.add, torch.add}
_SHAPE_METHODS = {"size", "dim"}
# an MLP's hidden values: activation functions and a gate's product (one at least), arithmetic with constants
_ACTIVATION_FUNCTIONS = {
    *(F.gelu, F.relu, F.relu6, F.leaky_relu, F.silu, F.mish, F.hardswish, F.elu, F.selu),
    *(torch.sigmoid, torch.tanh, torch.relu, operator.mul, torch.mul),
    # as the export capture leaves the activation functions the placement rules have no kind for
    *(torch.ops.aten.silu.default, torch.ops.aten.gelu.default, torch.ops.aten.gelu_.default),
    *(torch.ops.aten.silu_.default, torch.ops.aten.tanh.default, torch.ops.aten.sigmoid.default),
}
_ACTIVATION_METHODS = {"mul", "sigmoid", "tanh", "relu"}
_ACTIVATION_MODULES: tuple[type[nn.Module], ...] = (
    *(nn.GELU, nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.SiLU, nn.Mish, nn.Hardswish, nn.ELU, nn.SELU),
    *(nn.Sigmoid, nn.Tanh),
)
_ARITHMETIC = {operator.add, torch.add, operator.pow, torch.pow, operator.truediv, torch.div, operator.sub}
_PASSING_MODULES = (nn.Dropout, nn.Identity)
_POST_NORM = (
    "a post-norm model (BERT, MiniLM) keeps LayerNorm's scale inside its residual stream, which no rotation folds "
    "into the weights; the stream's rotation takes pre-norm transformers (GPT-2, Llama), and {'residual': False} "
    "rotates only the MLPs' down-projection inputs, which any transformer allows"
)


# -- matrices ---------------------------------------------------------------------------------------------------
def _is_prime(q: int) -> bool:
    return q > 1 and all(q % p for p in range(2, math.isqrt(q) + 1))


def _paley(n: int) -> Tensor:
    """Paley's first construction: a Hadamard matrix of size ``n = q + 1`` for a prime ``q = 3 mod 4``."""
    q = n - 1
    residues = {(i * i) % q for i in range(1, q)}
    chi = torch.tensor([0.0] + [1.0 if i in residues else -1.0 for i in range(1, q)], dtype=torch.float64)
    idx = torch.arange(q)
    jacobsthal = chi[(idx[None, :] - idx[:, None]) % q]  # skew-symmetric for q = 3 mod 4
    S = torch.zeros(n, n, dtype=torch.float64)
    S[0, 1:], S[1:, 0], S[1:, 1:] = 1.0, -1.0, jacobsthal
    return S + torch.eye(n, dtype=torch.float64)


def hadamard_matrix(n: int) -> Tensor:
    """A Hadamard matrix of size ``n`` (entries +-1, ``H H^T = n I``), float64: Sylvester's for powers of two, a
    Kronecker product with Paley's for ``n = 2^k (q + 1)``, ``q`` a prime ``= 3 mod 4`` (12, 20, 24, 44, ...: 384
    = 12 x 32, 768 = 12 x 64). Other sizes raise ``ValueError``."""
    if n < 1:
        raise ValueError(f"a Hadamard matrix needs a positive size, got {n}")
    power = n & -n
    base = n // power
    core: Tensor | None = torch.ones(1, 1, dtype=torch.float64) if base == 1 else None
    if core is None:
        for p in (1, 2, 4, 8, 16):  # base * p = q + 1
            if power % p == 0 and (base * p - 1) % 4 == 3 and _is_prime(base * p - 1):
                core, power = _paley(base * p), power // p
                break
        if core is None:
            raise ValueError(
                f"no Hadamard matrix of size {n} is built here (sizes 2^k and 2^k (q + 1) for a prime q = 3 mod 4); "
                "use rotation 'random' (a random orthogonal matrix) for this width"
            )
    sylvester = torch.ones(1, 1, dtype=torch.float64)
    while sylvester.shape[0] < power:
        sylvester = torch.cat([torch.cat([sylvester, sylvester], 1), torch.cat([sylvester, -sylvester], 1)], 0)
    return torch.kron(sylvester, core)  # type: ignore[arg-type]


def orthogonal_matrix(n: int, rotation: str = "hadamard", seed: int = 0) -> Tensor:
    """An ``n x n`` orthogonal matrix, float64: ``"hadamard"``, a Hadamard matrix scaled by ``1/sqrt(n)`` with its
    rows' signs drawn from ``seed`` (QuaRot's randomized Hadamard); ``"random"``, Q of a Gaussian matrix's QR."""
    generator = torch.Generator().manual_seed(int(seed))
    if rotation == "random":
        q, r = torch.linalg.qr(torch.randn(n, n, generator=generator, dtype=torch.float64))
        return q * torch.sign(torch.diagonal(r))[None, :]
    if rotation != "hadamard":
        raise ValueError(f"rotation must be 'hadamard' or 'random', got {rotation!r}")
    signs = torch.randint(0, 2, (n,), generator=generator).double() * 2 - 1
    return signs[:, None] * hadamard_matrix(n) / math.sqrt(n)


# -- the residual stream -------------------------------------------------------------------------------------------
@dataclass
class Stream:
    """One residual stream of width ``dim``: the values on it, the layers writing it, its norms and their readers."""

    dim: int
    values: list[fx.Node] = field(default_factory=list)
    writers: dict[str, Any] = field(default_factory=dict)  # Linear / Embedding modules, by name
    norms: dict[str, Norm] = field(default_factory=dict)  # what each norm computes, by the norm module's name
    readers: dict[str, list[str]] = field(default_factory=dict)  # norm name -> Linear names reading it


class _RefusedError(ValueError):
    pass


def _module(node: Any, modules: Mapping[str, nn.Module]) -> nn.Module | None:
    if isinstance(node, fx.Node) and node.op == "call_module":
        return modules.get(str(node.target))
    return None


def _is_shape_read(node: fx.Node) -> bool:
    return (node.op == "call_function" and node.target is getattr and node.args[1:2] in (("shape",), ("dtype",))) or (
        node.op == "call_method" and node.target in _SHAPE_METHODS
    )


_RESHAPES = {"view", "reshape", "unflatten", "transpose"}


def _per_head(norm: fx.Node, modules: Mapping[str, nn.Module]) -> bool:
    """A norm of attention heads' features (Qwen3's and OLMo2's query / key norms): its input is a projection's
    output split into heads, not a residual stream; the rotation leaves it alone (the projection's output is not
    rotated)."""
    value = norm.args[0] if norm.args else None
    while isinstance(value, fx.Node) and (module := _module(value, modules)) is not None and is_quantizer(module):
        value = value.args[0]
    if not isinstance(value, fx.Node) or value.op not in ("call_function", "call_method"):
        return False
    name = value.target if value.op == "call_method" else getattr(value.target, "__name__", "")
    return str(name) in _RESHAPES or getattr(value.target, "_opname", None) in _RESHAPES


def _selects_rows(node: fx.Node) -> bool:
    """``x[index]`` that keeps the last dimension whole (the positions a causal LM computes logits for): it commutes
    with the rotation, which acts on the last dimension only."""
    if node.op != "call_function" or node.target is not operator.getitem or len(node.args) != 2:
        return False
    value, index = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None, node.args[1]
    parts = index if isinstance(index, tuple) else (index,)
    if not isinstance(value, Tensor) or not all(isinstance(p, (slice, int)) for p in parts):
        return False
    last = parts[-1]
    whole_last = (
        isinstance(last, slice)
        and last.start in (None, 0)
        and last.step in (None, 1)
        and (last.stop is None or bool(last.stop >= value.shape[-1]))
    )
    return len(parts) < value.dim() or whole_last


def _is_add(node: fx.Node) -> bool:
    is_add = (node.op == "call_function" and node.target in _ADDS) or (
        node.op == "call_method" and node.target == "add"
    )
    return is_add and len(node.args) == 2 and all(isinstance(a, fx.Node) for a in node.args) and not node.kwargs


def _norm_width(module: nn.Module) -> int | None:
    norm = norm_of(module)
    return norm.width if norm is not None else None


def _describe(node: fx.Node) -> str:
    return f"'{node.name}' ({node.op} {getattr(node.target, '__name__', node.target)})"


def _trace_stream(norm: fx.Node, modules: Mapping[str, nn.Module], stream: Stream) -> None:
    """Add to ``stream`` every value feeding ``norm``'s input through residual adds and quantizers."""
    pending = [norm.args[0]]
    seen = {id(v) for v in stream.values}
    while pending:
        node = pending.pop()
        if not isinstance(node, fx.Node) or id(node) in seen:
            continue
        module = _module(node, modules)
        if _is_add(node) or (module is not None and is_quantizer(module)):
            seen.add(id(node))
            stream.values.append(node)
            pending.extend(node.args[:2] if _is_add(node) else node.args[:1])
        elif isinstance(module, nn.Embedding) or (isinstance(module, nn.Linear) and module.out_features == stream.dim):
            if isinstance(module, nn.Embedding) and module.embedding_dim != stream.dim:
                width = module.embedding_dim
                raise _RefusedError(f"embedding {_describe(node)} writes width {width}, not {stream.dim}")
            seen.add(id(node))
            stream.values.append(node)
            stream.writers[str(node.target)] = module
        elif module is not None and _norm_width(module) is not None:
            raise _RefusedError(
                f"the output of norm {_describe(node)} is added into the stream '{norm.target}' reads: {_POST_NORM}"
            )
        else:
            raise _RefusedError(
                f"the value {_describe(node)} is added into the residual stream read by norm '{norm.target}'; the "
                "rotation is folded only into Linear and Embedding layers writing the stream"
            )


def _check_users(stream: Stream, modules: Mapping[str, nn.Module]) -> None:
    """Every value on ``stream`` is read only by other stream values, its norms or shape queries."""
    on_stream = {id(v) for v in stream.values}
    for value in stream.values:
        for user in value.users:
            if id(user) in on_stream or _is_shape_read(user):
                continue
            module = _module(user, modules)
            if module is not None and str(user.target) in stream.norms:
                continue
            raise _RefusedError(
                f"the residual stream value {_describe(value)} is read by {_describe(user)}, not only by "
                f"normalization layers and residual adds (a pre-norm transformer reads its stream only through norms): "
                f"{_POST_NORM}"
            )


def _readers(norm: fx.Node, modules: Mapping[str, nn.Module], dim: int) -> list[str]:
    """The Linear layers reading ``norm``'s output (through quantizers)."""
    found: list[str] = []
    pending = list(norm.users)
    while pending:
        user = pending.pop()
        module = _module(user, modules)
        if _is_shape_read(user):
            continue
        if (module is not None and is_quantizer(module)) or _selects_rows(user):
            pending.extend(user.users)
        elif isinstance(module, nn.Linear) and module.in_features == dim and user.args[0] is not None:
            found.append(str(user.target))
        elif _is_add(user):
            raise _RefusedError(f"the output of norm '{norm.target}' is added to {_describe(user)}: {_POST_NORM}")
        else:
            raise _RefusedError(
                f"norm '{norm.target}' is read by {_describe(user)}; the norm's scale and the rotation are folded "
                "only into Linear layers reading it (run hadamard_rotation on the model as prepared, before "
                "smooth_quant or awq put scales between them)"
            )
    return found


def residual_streams(model: fx.GraphModule) -> list[Stream]:
    """The residual streams of ``model``: one per width of its LayerNorm / RMSNorm layers. Raises ``ValueError``
    naming the value where the model departs from a pre-norm transformer's pattern."""
    modules = dict(model.named_modules())
    streams: dict[int, Stream] = {}
    for node in model.graph.nodes:
        module = _module(node, modules)
        norm = norm_of(module) if module is not None else None
        if norm is None or _per_head(node, modules):
            continue
        stream = streams.setdefault(norm.width, Stream(norm.width))
        if str(node.target) in stream.norms:
            raise _RefusedError(f"norm '{node.target}' is called more than once; give each call its own module")
        stream.norms[str(node.target)] = norm
        _trace_stream(node, modules, stream)
        stream.readers[str(node.target)] = _readers(node, modules, norm.width)
    if not streams:
        raise _RefusedError(
            "found no normalization module (LayerNorm, RMSNorm or a model family's own class computing one over the "
            "last dimension) in the graph: nothing to rotate. "
            "Rotation reads norms as modules (as both torch.fx and the export capture keep them); a norm computed "
            "by functions in forward (F.layer_norm, or by hand) is not seen. {'residual': False} rotates only the "
            "MLPs' down-projection inputs"
        )
    for stream in streams.values():
        if len({norm.centered for norm in stream.norms.values()}) > 1:
            raise _RefusedError(f"the stream of width {stream.dim} mixes LayerNorm and RMSNorm; rotate one kind only")
        _check_users(stream, modules)
    return list(streams.values())


# -- folding ---------------------------------------------------------------------------------------------------
def _set(module: nn.Module, name: str, value: Tensor) -> None:
    setattr(module, name, nn.Parameter(value.to(getattr(module, name).dtype)))


def _rotate_stream(model: fx.GraphModule, stream: Stream, rotation: Tensor) -> None:
    modules: dict[str, Any] = dict(model.named_modules())
    layer_norm = any(norm.centered for norm in stream.norms.values())
    d = stream.dim
    center = torch.eye(d, dtype=torch.float64) - (1.0 / d if layer_norm else 0.0)
    new: dict[tuple[str, str], Tensor] = {}
    for name, module in stream.writers.items():
        weight = module.weight.detach().double()
        if isinstance(module, nn.Embedding):
            new[name, "weight"] = weight @ center @ rotation
        else:
            new[name, "weight"] = rotation.T @ center @ weight
            if module.bias is not None:
                new[name, "bias"] = rotation.T @ center @ module.bias.detach().double()
    for norm_name, norm in stream.norms.items():
        gain = norm.gain if norm.gain is not None else torch.ones(d, dtype=torch.float64)
        shift = norm.shift if norm.shift is not None else torch.zeros(d, dtype=torch.float64)
        for name in stream.readers[norm_name]:
            reader = modules[name]
            weight = reader.weight.detach().double()
            if (name, "weight") in new:
                raise _RefusedError(f"layer '{name}' both reads and writes the residual stream")
            new[name, "weight"] = weight * gain[None, :] @ rotation
            bias = reader.bias.detach().double() if reader.bias is not None else torch.zeros(reader.out_features)
            if reader.bias is not None or bool(shift.any()):
                new[name, "bias"] = bias.double() + weight @ shift
    for (name, attribute), value in new.items():
        module = modules[name]
        if attribute == "bias" and module.bias is None:
            module.bias = nn.Parameter(value.to(module.weight.dtype))
        else:
            _set(module, attribute, value)
    for norm_name, norm in stream.norms.items():
        parent, _, child = norm_name.rpartition(".")
        replacement = RMSNorm(d, eps=norm.eps, elementwise_affine=False)
        setattr(model.get_submodule(parent) if parent else model, child, replacement)


def mlp_down_projections(model: fx.GraphModule) -> dict[str, fx.Node]:
    """The MLP down projections of ``model``, by name (with the node calling each): Linear layers called once whose
    input is computed elementwise (through quantizers, an activation function, a gate's product) from Linear layers
    only, with at least one activation function or product on the way, and which write the width those layers read
    (``fc2(gelu(fc1(x)))``, ``down(silu(gate(x)) * up(x))``; not a classifier on a pooler). A layer whose input
    quantizer other layers read too is left out (rotating its input would turn theirs)."""
    modules = dict(model.named_modules())
    calls: dict[str, list[fx.Node]] = {}
    for node in model.graph.nodes:
        if isinstance(_module(node, modules), nn.Linear) and node.args and isinstance(node.args[0], fx.Node):
            calls.setdefault(str(node.target), []).append(node)
    found = {}
    for name, nodes in calls.items():
        source = nodes[0].args[0]
        quantizer = _module(source, modules)
        # the rotation goes before the input's quantizer: one that other layers read too would turn their input
        read_by_others = isinstance(source, fx.Node) and len(source.users) > 1
        shared = read_by_others and quantizer is not None and is_quantizer(quantizer)
        pending, seen, leaves, activations, ok = [source], set(), 0, 0, len(nodes) == 1 and not shared
        while pending and ok:
            value = pending.pop()
            if not isinstance(value, fx.Node) or value in seen:
                continue
            seen.add(value)
            module = _module(value, modules)
            if isinstance(module, nn.Linear):
                leaves += 1
                ok = module.in_features == modules[name].out_features
                continue
            function = value.target if value.op in ("call_function", "call_method") else None
            activation = isinstance(module, _ACTIVATION_MODULES) or function in (
                _ACTIVATION_FUNCTIONS if value.op == "call_function" else _ACTIVATION_METHODS
            )
            passing = (module is not None and (is_quantizer(module) or isinstance(module, _PASSING_MODULES))) or (
                function in _ARITHMETIC or function in ("add", "pow", "div", "sub")
            )
            ok = activation or passing
            activations += activation
            pending.extend(a for a in value.args if isinstance(a, fx.Node))
        if ok and leaves and activations:
            found[name] = nodes[0]
    return found


def _rotate_input_online(model: fx.GraphModule, name: str, node: fx.Node, hadamard: Tensor) -> None:
    """Insert ``x @ H`` on ``node``'s input (before its input quantizer) and fold ``H`` into its weight."""
    modules: dict[str, Any] = dict(model.named_modules())
    layer = modules[name]
    edge: Any = node
    source: Any = node.args[0]
    quantizer = _module(source, modules)
    if quantizer is not None and is_quantizer(quantizer):
        edge, source = source, source.args[0]
    buffer = name.replace(".", "_") + "_input_rotation"
    model.register_buffer(buffer, hadamard.float())
    with model.graph.inserting_before(edge):
        constant = model.graph.get_attr(buffer)
        rotated = model.graph.call_function(torch.matmul, (source, constant))
    edge.args = (rotated, *edge.args[1:])
    _set(layer, "weight", layer.weight.detach().double() @ hadamard)


@torch.no_grad()
def hadamard_rotation(model: fx.GraphModule, cali_data: Any, config: Mapping[str, Any] | None = None) -> fx.GraphModule:
    """Rotate ``model``'s residual stream (and its MLPs' down-projection inputs) and recalibrate it; returns
    ``model`` (changed in place), in quantization mode.

    ``model``: from ``prepare_by_platform``, a pre-norm transformer (see the module's description); with
    ``{"residual": False}`` any model with MLPs (post-norm encoders too), whose down projections' inputs only are
    rotated. ``cali_data``: a list of input batches (tensors, tuples of positional inputs, or dicts), as for
    ``ptq_reconstruction``; every quantizer is recalibrated on them. ``config`` keys: :data:`ROTATION_DEFAULTS`
    (unknown keys are errors). Run it before ``gptq`` / ``awq`` (which then quantize the rotated weights).
    """
    cfg = config_with(ROTATION_DEFAULTS, config, "hadamard_rotation")
    if not isinstance(model, fx.GraphModule):
        raise ValueError(f"hadamard_rotation takes the model prepare_by_platform returned, got {type(model).__name__}")
    require_weights(model, "hadamard_rotation (it rotates every layer)")
    if cfg["rotation"] not in ("hadamard", "random"):
        raise ValueError(f"hadamard_rotation config rotation must be 'hadamard' or 'random', got {cfg['rotation']!r}")
    for key in ("residual", "ffn"):
        if not isinstance(cfg[key], bool):
            raise ValueError(f"hadamard_rotation config {key} must be true or false, got {cfg[key]!r}")
    batches = calibration_batches(cali_data)
    recipe = recipe_of(model)  # before the norms change kind
    try:
        streams = residual_streams(model) if cfg["residual"] else []
        down = mlp_down_projections(model) if cfg["ffn"] else {}
        if cfg["residual"]:  # the down projections writing a rotated stream (a post-norm model's are refused above)
            down = {name: node for name, node in down.items() if any(name in s.writers for s in streams)}
        elif not down:
            raise _RefusedError(
                "with residual False only the MLP down projections' inputs are rotated, and none was found (a Linear "
                "reading an activation function of Linear layers, e.g. fc2(gelu(fc1(x))))"
                if cfg["ffn"]
                else "residual and ffn are both False: nothing to rotate"
            )
        plans = [(stream, orthogonal_matrix(stream.dim, cfg["rotation"], cfg["seed"])) for stream in streams]
        layers: dict[str, Any] = dict(model.named_modules())
        online = {name: orthogonal_matrix(layers[name].in_features, "hadamard", cfg["seed"] + 1) for name in down}
    except _RefusedError as error:
        raise ValueError(f"hadamard_rotation cannot rotate this model: {error}") from None
    except ValueError as error:
        raise ValueError(f"hadamard_rotation: {error}") from None
    # a tied weight (the output layer's weight is the embedding table) gets one rotated copy per holder: the
    # embedding is a writer (E Q), the output layer a reader (W diag(g) Q)
    shared = shared_weights(model)
    changed = {name for stream, _ in plans for names in (stream.writers, *stream.readers.values()) for name in names}
    untied = sorted(name for name in changed | set(online) if name in shared)
    if untied:
        logger.info("hadamard_rotation: untied the weights of %s (each holder gets its own rotated copy)", untied)
    report: dict[str, Any] = {"rotation": cfg["rotation"], "streams": [], "online": sorted(online), "untied": untied}
    for stream, Q in plans:
        _rotate_stream(model, stream, Q)
        report["streams"].append(
            {
                "dim": stream.dim,
                "writers": sorted(stream.writers),
                "norms": sorted(stream.norms),
                "readers": sorted(n for names in stream.readers.values() for n in names),
            }
        )
        logger.info(
            "hadamard_rotation: width %d, %d writers, %d norms", stream.dim, len(stream.writers), len(stream.norms)
        )
    for name, H in online.items():
        _rotate_input_online(model, name, down[name], H)
    logger.info("hadamard_rotation: %d MLP down projection input(s) rotated online", len(online))
    model.graph.lint()
    model.recompile()
    model.meta["rotation"] = report
    calibrate(model, batches, smooth=False, recipe=recipe)
    return model
