"""The sequence family of the fuzz grammar: (N, L, D) graphs of Linear, LayerNorm, GELU, softmax, matmul and
hand-written multi-head self-attention, some with int64 token ids (integer arithmetic, then nn.Embedding).

Each op reads the current value, writes forward lines through the :class:`~fuzz.builder.Builder` and
returns the new current value. Tags name what a graph uses (``all_tags("sequence")`` lists them all).
"""

from __future__ import annotations

from collections.abc import Callable

from fuzz.builder import BATCH, Builder

__all__ = ["TAGS", "build_sequence"]

WIDTHS = (8, 16)


def linear(b: Builder, cur: str, width: int | None = None) -> str:
    d = b.shape(cur)[-1]
    width = width or b.rng.choice(WIDTHS)
    bias = "" if b.chance(0.8) else ", bias=False"
    name = b.module("fc", f"nn.Linear({d}, {width}{bias})")
    return b.emit(f"self.{name}({cur})", "linear" if not bias else "linear_nobias")


def layernorm(b: Builder, cur: str) -> str:
    d = b.shape(cur)[-1]
    if b.chance(0.2):
        return b.emit(f"F.layer_norm({cur}, ({d},))", "layernorm_functional")
    name = b.module("ln", f"nn.LayerNorm({d})")
    b.init(f"nn.init.uniform_(self.{name}.weight, 0.5, 1.5)")
    b.init(f"nn.init.uniform_(self.{name}.bias, -0.2, 0.2)")
    return b.emit(f"self.{name}({cur})", "layernorm")


def activation(b: Builder, cur: str) -> str:
    kind = b.rng.choice(["gelu", "gelu_tanh", "f_gelu", "relu", "silu", "tanh"])
    if kind == "f_gelu":
        return b.emit(f"F.gelu({cur})", kind)
    constructor = {
        "gelu": "nn.GELU()",
        "gelu_tanh": "nn.GELU(approximate='tanh')",
        "relu": "nn.ReLU()",
        "silu": "nn.SiLU()",
        "tanh": "nn.Tanh()",
    }[kind]
    name = b.module("act", constructor)
    return b.emit(f"self.{name}({cur})", kind)


def softmax(b: Builder, cur: str) -> str:
    form, tag = b.rng.choice(
        [("{}.softmax(dim=-1)", "softmax"), ("F.softmax({}, dim=-1)", "softmax"), ("torch.softmax({}, -1)", "softmax")]
    )
    return b.emit(form.format(cur), tag)


def matmul(b: Builder, cur: str) -> str:
    """Single-head attention without projections: ``softmax(x @ x.T) @ x``, with matmul or the @ operator."""
    scores = b.emit(f"torch.matmul({cur}, {cur}.transpose(1, 2))", "matmul")
    if b.chance(0.5):
        scores = b.emit(f"{scores} * {b.shape(cur)[-1] ** -0.5:.4f}", "mul_scalar")
    weights = softmax(b, scores)
    return b.emit(f"{weights} @ {cur}", "matmul")


def attention(b: Builder, cur: str) -> str:
    """Hand-written multi-head self-attention with a residual add and a LayerNorm (pre- or post-norm)."""
    _, length, d = b.shape(cur)
    heads = b.rng.choice([h for h in (1, 2, 4) if d % h == 0])
    head_dim = d // heads
    pre_norm = b.chance(0.5)
    source = layernorm(b, cur) if pre_norm else cur
    projected = {}
    for part in ("q", "k", "v"):
        name = b.module(part, f"nn.Linear({d}, {d})")
        split = b.rng.choice(["view", "reshape"])
        flat = b.emit(f"self.{name}({source})", "linear")
        projected[part] = b.emit(
            f"{flat}.{split}({flat}.shape[0], {length}, {heads}, {head_dim}).transpose(1, 2)", split
        )
    scores = b.emit(f"torch.matmul({projected['q']}, {projected['k']}.transpose(-2, -1))", "matmul")
    scaled = b.emit(f"{scores} / {head_dim**0.5:.4f}", "div_scalar")
    if "mask" in b.notes and b.shape(b.notes["mask"])[-1] == length:  # an additive mask, as transformers write it
        scaled = b.emit(f"{scaled} + {b.notes['mask']}", "attention_mask")
    weights = softmax(b, scaled)
    mixed = b.emit(f"torch.matmul({weights}, {projected['v']})", "matmul")
    merged = b.emit(f"{mixed}.transpose(1, 2).reshape({mixed}.shape[0], {length}, {d})", "reshape")
    out_name = b.module("o", f"nn.Linear({d}, {d})")
    out = b.emit(f"self.{out_name}({merged})", "linear")
    summed = b.emit(f"{cur} + {out}", "residual_add")
    b.tags.add("attention")
    return summed if pre_norm else layernorm(b, summed)


def mlp(b: Builder, cur: str) -> str:
    d = b.shape(cur)[-1]
    hidden = linear(b, cur, 2 * d)
    hidden = activation(b, hidden)
    back = linear(b, hidden, d)
    return b.emit(f"{cur} + {back}", "residual_add")


def gate(b: Builder, cur: str) -> str:
    """``x * sigmoid(linear(x))``: a product of two activations."""
    d = b.shape(cur)[-1]
    name = b.module("gate", f"nn.Linear({d}, {d})")
    return b.emit(f"{cur} * torch.sigmoid(self.{name}({cur}))", "mul_gate")


def scale(b: Builder, cur: str) -> str:
    return b.emit(f"{cur} * {b.rng.choice(['0.5', '-2.0', '1.5'])}", "mul_scalar")


def add_other(b: Builder, cur: str) -> str:
    others = [n for n in b.float_values(3) if n != cur and b.shape(n) == b.shape(cur)]
    other = b.rng.choice(others) if others else b.emit(f"torch.tanh({cur})", "tanh")
    return b.emit(f"{cur} + {other}", "add")


def seq_slice(b: Builder, cur: str) -> str | None:
    length = b.shape(cur)[1]
    if length < 4:
        return None
    return b.emit(f"{cur}[:, 1:, :]", "slice_tokens")


WEIGHTED: list[Callable[[Builder, str], str | None]] = [
    linear,
    layernorm,
    activation,
    softmax,
    matmul,
    attention,
    attention,
    mlp,
    gate,
    scale,
    add_other,
    seq_slice,
]
UNWEIGHTED: list[Callable[[Builder, str], str | None]] = [activation, softmax, matmul, scale, add_other, seq_slice]


def token_ids(b: Builder, cur: str, length: int) -> str:
    """Integer arithmetic on an int64 input, then an embedding added to the sequence."""
    ids = b.add_input((BATCH, length), dtype="int64", high=length)
    form, top = b.rng.choice([("{} + 1", length + 1), ("{} * 2 + 1", 2 * length), ("({} + 3) % {}", length)])
    index = b.emit(form.format(ids, length) if "%" in form else form.format(ids), "int_arithmetic")
    d = b.shape(cur)[-1]
    name = b.module("emb", f"nn.Embedding({top}, {d})")
    embedded = b.emit(f"self.{name}({index})", "embedding")
    b.live.remove(index)
    return b.emit(f"{cur} + {embedded}", "add")


def positions(b: Builder, cur: str) -> str:
    """Position ids made in forward (``torch.arange`` of the sequence length), embedded and added."""
    _, length, d = b.shape(cur)
    ids = b.emit(f"torch.arange({cur}.shape[1], device={cur}.device)", "arange_positions", live=False)
    name = b.module("pos", f"nn.Embedding({length}, {d})")
    return b.emit(f"{cur} + self.{name}({ids})", "embedding")


def attention_mask(b: Builder, length: int) -> None:
    """A 0/1 int64 mask input, turned into an additive mask (0 or -10000) that attention adds to its scores."""
    mask = b.add_input((BATCH, length), dtype="int64", high=2, live=False)
    b.notes["mask"] = b.emit(f"(1.0 - {mask}[:, None, None, :].float()) * -10000.0", "int_arithmetic", live=False)


def output_feeds_quantized(b: Builder, cur: str) -> str:
    v = b.emit(f"F.gelu({linear(b, cur)})", "f_gelu")
    b.outputs.append(v)
    b.tags.add("output_feeds_quantized")
    return linear(b, v)


def inplace_on_read(b: Builder, cur: str) -> str:
    a = linear(b, cur)
    read = linear(b, a, b.shape(a)[-1])
    b.stmt(f"{a}.relu_()", "inplace_on_read")
    return b.emit(f"{a} + {read}", "add")


def dead_code(b: Builder, cur: str) -> str:
    dead = linear(b, cur)
    b.live.remove(dead)
    b.emit(f"F.gelu({dead})", live=False)
    b.tags.add("dead_code")
    return cur


def head(b: Builder, cur: str) -> str:
    pooled = b.emit(f"{cur}.mean(dim=1)", "mean") if b.chance(0.5) else b.emit(f"{cur}[:, 0]", "first_token")
    return linear(b, pooled, b.rng.randint(2, 6))


def build_sequence(b: Builder) -> None:
    length, d = b.rng.randint(4, 12), b.rng.choice(WIDTHS)
    cur = b.add_input((BATCH, length, d))
    first_input = cur
    nothing_to_quantize = b.chance(0.06)
    if not nothing_to_quantize and b.chance(0.4):
        cur = token_ids(b, cur, length)
    if not nothing_to_quantize and b.chance(0.2):
        cur = positions(b, cur)
    if not nothing_to_quantize and b.chance(0.25):
        attention_mask(b, length)
    if b.chance(0.1):
        b.add_input((BATCH, length, d), live=False)
        b.tags.add("unused_input")
    patterns = [] if nothing_to_quantize else [output_feeds_quantized, inplace_on_read, dead_code]
    chosen = [p for p in patterns if b.chance(0.2)]
    ops = UNWEIGHTED if nothing_to_quantize else WEIGHTED
    steps = b.rng.randint(2, 5)
    for step in range(steps):
        if chosen and b.chance(1 / max(1, steps - step)):
            cur = chosen.pop()(b, cur)
            continue
        for _ in range(10):
            out = b.rng.choice(ops)(b, cur)
            if out is not None:
                cur = out
                break
    for pattern in chosen:
        cur = pattern(b, cur)
    if nothing_to_quantize:
        b.tags.add("nothing_to_quantize")
    elif b.chance(0.3):
        cur = head(b, cur)
    extras = [n for n in b.float_values(3) if n not in (cur, first_input, *b.outputs)]
    if extras and b.chance(0.25):
        b.outputs.append(b.rng.choice(extras))
    b.outputs.insert(0, cur)
    if b.chance(0.1):
        ids = [spec.name for spec in b.inputs if spec.dtype == "int64"]
        b.outputs.append(ids[0] if ids and b.chance(0.5) else first_input)
        b.tags.add("input_as_output")


TAGS = frozenset(
    {"linear", "linear_nobias", "layernorm", "layernorm_functional", "gelu", "gelu_tanh", "f_gelu", "relu", "silu"}
    | {"tanh", "softmax", "matmul", "mul_scalar", "view", "reshape", "div_scalar", "residual_add", "attention"}
    | {"mul_gate", "add", "slice_tokens", "int_arithmetic", "embedding", "output_feeds_quantized"}
    | {"inplace_on_read", "dead_code", "mean", "first_token", "unused_input", "nothing_to_quantize"}
    | {"input_as_output", "multi_input", "multi_output", "arange_positions", "attention_mask"}
)
