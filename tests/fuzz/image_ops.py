"""The image family of the fuzz grammar: (N, C, H, W) graphs with C <= 8 and H, W in 8..16 at the input.

Each op reads the current value (and sometimes another live one), writes forward lines through the
:class:`~fuzz.builder.Builder` and returns the new current value, or None where it does not apply
to the current shape. Tags name what a graph uses (``all_tags("image")`` lists them all).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from fuzz.builder import BATCH, Builder

__all__ = ["TAGS", "build_image"]

MAX_CHANNELS = 16
MAX_SIDE = 32

ACTIVATIONS = {
    "relu": "nn.ReLU()",
    "relu_inplace": "nn.ReLU(inplace=True)",
    "relu6": "nn.ReLU6()",
    "leaky_relu": "nn.LeakyReLU(0.1)",
    "hardswish": "nn.Hardswish()",
    "silu": "nn.SiLU()",
    "gelu": "nn.GELU()",
    "sigmoid": "nn.Sigmoid()",
    "tanh": "nn.Tanh()",
}
FUNCTIONAL_ACTIVATIONS = {
    "f_relu": "F.relu({})",
    "torch_relu": "torch.relu({})",
    "method_relu": "{}.relu()",
    "f_relu6_inplace": "F.relu6({}, inplace=True)",
    "f_hardswish": "F.hardswish({})",
}


def _pool_out(size: int, kernel: int, stride: int, padding: int, dilation: int = 1, ceil: bool = False) -> int:
    span = size + 2 * padding - dilation * (kernel - 1) - 1
    out = (math.ceil(span / stride) if ceil else span // stride) + 1
    if ceil and (out - 1) * stride >= size + padding:
        out -= 1
    return out


def _conv_out(size: int, kernel: int, stride: int, padding: int, dilation: int) -> int:
    return (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1


def _divisors(n: int) -> list[int]:
    return [d for d in range(2, n + 1) if n % d == 0]


# -- weighted ops -----------------------------------------------------------------------------------
def conv(b: Builder, cur: str, kind: str | None = None, cout: int | None = None) -> str | None:
    _, c, h, w = b.shape(cur)
    kind = kind or b.rng.choice(
        ["plain", "groups", "depthwise", "dilation", "stride", "padding_mode", "same", "nobias"]
    )
    k = b.rng.choice([1, 3, 3, 5]) if min(h, w) >= 6 else b.rng.choice([1, 3])
    stride, dilation, groups, padding, extra = 1, 1, 1, b.rng.choice([0, k // 2, k // 2]), ""
    cout = cout or b.rng.randint(1, 8)
    if kind == "groups":
        options = [g for g in _divisors(c) if g < c] or _divisors(c)
        if not options:
            return None
        groups = b.rng.choice(options)
        cout = groups * b.rng.randint(1, max(1, 8 // groups))
    elif kind == "depthwise":
        groups, cout, k = c, c * b.rng.choice([1, 1, 2]), 3
        padding = 1
    elif kind == "dilation":
        k, dilation, padding = 3, 2, b.rng.choice([0, 2])
    elif kind == "stride":
        stride, padding = 2, k // 2
    elif kind == "padding_mode":
        k = 3
        padding = 1
        extra = f", padding_mode={b.rng.choice(['reflect', 'replicate', 'circular'])!r}"
    elif kind == "same":
        k = b.rng.choice([2, 3, 5]) if min(h, w) >= 6 else 3
        dilation = b.rng.choice([1, 2])
        extra = ", padding='same'"
    elif kind == "nobias":
        extra = ", bias=False"
    if cout > MAX_CHANNELS:
        return None
    if (
        kind != "same"
        and min(_conv_out(h, k, stride, padding, dilation), _conv_out(w, k, stride, padding, dilation)) < 2
    ):
        return None
    args = f"{c}, {cout}, {k}"
    if stride != 1:
        args += f", stride={stride}"
    if kind != "same" and padding:
        args += f", padding={padding}"
    if dilation != 1:
        args += f", dilation={dilation}"
    if groups != 1:
        args += f", groups={groups}"
    name = b.module("conv", f"nn.Conv2d({args}{extra})")
    b.tags.add(f"conv_{kind}")
    return b.emit(f"self.{name}({cur})", "conv")


def deconv(b: Builder, cur: str) -> str | None:
    _, c, h, w = b.shape(cur)
    k = b.rng.choice([2, 3, 4])
    stride = b.rng.choice([1, 2])
    padding = b.rng.randint(0, (k - 1) // 2)
    output_padding = b.rng.choice([0, 1]) if stride == 2 else 0
    grouped = b.chance(0.4) and bool(_divisors(c))
    groups = b.rng.choice(_divisors(c)) if grouped else 1
    cout = groups * b.rng.randint(1, max(1, 8 // groups))
    out = (max(h, w) - 1) * stride - 2 * padding + k + output_padding
    if out > MAX_SIDE or cout > MAX_CHANNELS or (min(h, w) - 1) * stride - 2 * padding + k < 2:
        return None
    args = f"{c}, {cout}, {k}, stride={stride}, padding={padding}"
    if output_padding:
        args += f", output_padding={output_padding}"
    if groups != 1:
        args += f", groups={groups}"
    name = b.module("deconv", f"nn.ConvTranspose2d({args})")
    return b.emit(f"self.{name}({cur})", "deconv_groups" if groups != 1 else "deconv")


def conv_block(b: Builder, cur: str) -> str | None:
    """Conv, then maybe BatchNorm, then maybe an activation: the chains backends fuse."""
    out = conv(b, cur)
    if out is None:
        return None
    if b.chance(0.5):
        out = batchnorm(b, out)
    if b.chance(0.6):
        out = activation(b, out)
    return out


def batchnorm(b: Builder, cur: str) -> str:
    c = b.shape(cur)[1]
    name = b.module("bn", f"nn.BatchNorm2d({c})")
    b.init(f"self.{name}.running_mean.uniform_(-0.5, 0.5)")
    b.init(f"self.{name}.running_var.uniform_(0.5, 2.0)")
    b.init(f"nn.init.uniform_(self.{name}.weight, 0.5, 1.5)")
    b.init(f"nn.init.uniform_(self.{name}.bias, -0.5, 0.5)")
    return b.emit(f"self.{name}({cur})", "bn")


def linear_on_channels(b: Builder, cur: str) -> str | None:
    _, c, _, _ = b.shape(cur)
    cout = b.rng.randint(1, 8)
    name = b.module("fc", f"nn.Linear({c}, {cout})")
    if b.chance(0.5):
        moved = b.emit(f"{cur}.permute(0, 2, 3, 1)", "permute")
        return b.emit(f"self.{name}({moved}).permute(0, 3, 1, 2)", "linear_channels")
    moved = b.emit(f"torch.movedim({cur}, 1, -1)", "movedim")
    return b.emit(f"torch.movedim(self.{name}({moved}), -1, 1)", "linear_channels")


def shared_conv(b: Builder, cur: str) -> str | None:
    """One shape-keeping conv called on two values (or twice in a row)."""
    _, c, _, _ = b.shape(cur)
    name = b.module("shared", f"nn.Conv2d({c}, {c}, 3, padding=1)")
    first = b.emit(f"self.{name}({cur})", "shared_module")
    between = activation(b, first)
    return b.emit(f"self.{name}({between})")


def head(b: Builder, cur: str) -> str:
    """Flatten to (N, F): global pooling + flatten, or a reshape of the whole map; then Linear."""
    _, c, h, w = b.shape(cur)
    style = b.rng.choice(["gap_flatten", "gap_view", "reshape", "nn_flatten"])
    if style in ("gap_flatten", "gap_view") or c * h * w > 2048:
        pool = b.module("gap", "nn.AdaptiveAvgPool2d(1)")
        pooled = b.emit(f"self.{pool}({cur})", "adaptive_avgpool")
        if style == "gap_view":
            flat = b.emit(f"{pooled}.view({pooled}.size(0), -1)", "view")
        else:
            flat = b.emit(f"torch.flatten({pooled}, 1)", "flatten")
    elif style == "reshape":
        flat = b.emit(f"{cur}.reshape({cur}.shape[0], -1)", "reshape")
    else:
        module = b.module("flatten", "nn.Flatten()")
        flat = b.emit(f"self.{module}({cur})", "flatten")
    features = b.shape(flat)[1]
    fc = b.module("fc", f"nn.Linear({features}, {b.rng.randint(2, 10)})")
    out = b.emit(f"self.{fc}({flat})", "linear_head")
    if b.chance(0.3):
        out = activation(b, out)
        fc2 = b.module("fc", f"nn.Linear({b.shape(out)[1]}, {b.rng.randint(2, 6)})")
        out = b.emit(f"self.{fc2}({out})")
    return out


# -- ops without weights ----------------------------------------------------------------------------
def activation(b: Builder, cur: str) -> str:
    if b.chance(0.7):
        tag = b.rng.choice(sorted(ACTIVATIONS))
        name = b.module("act", ACTIVATIONS[tag])
        return b.emit(f"self.{name}({cur})", tag)
    tag = b.rng.choice(sorted(FUNCTIONAL_ACTIVATIONS))
    return b.emit(FUNCTIONAL_ACTIVATIONS[tag].format(cur), tag)


def pool(b: Builder, cur: str) -> str | None:
    _, _, h, w = b.shape(cur)
    kind = b.rng.choice(["max", "avg", "adaptive"])
    if kind == "adaptive":
        size = b.rng.choice(["1", "2", f"({max(1, h // 2)}, {max(1, w // 2)})"])
        name = b.module("pool", f"nn.AdaptiveAvgPool2d({size})")
        return b.emit(f"self.{name}({cur})", "adaptive_avgpool")
    k = b.rng.choice([2, 3])
    stride = b.rng.choice([1, 2])
    padding = b.rng.randint(0, k // 2)
    ceil = b.chance(0.4)
    if min(_pool_out(h, k, stride, padding, ceil=ceil), _pool_out(w, k, stride, padding, ceil=ceil)) < 2:
        return None
    args = f"{k}, stride={stride}, padding={padding}" + (", ceil_mode=True" if ceil else "")
    tags = ["ceil_mode"] if ceil else []
    if kind == "max":
        name = b.module("pool", f"nn.MaxPool2d({args})")
        return b.emit(f"self.{name}({cur})", "maxpool", *tags)
    if padding and b.chance(0.5):
        args += ", count_include_pad=False"
        tags.append("count_include_pad_false")
    if b.chance(0.3):
        return b.emit(f"F.avg_pool2d({cur}, {args})", "avgpool", *tags)
    name = b.module("pool", f"nn.AvgPool2d({args})")
    return b.emit(f"self.{name}({cur})", "avgpool", *tags)


def _branch_like(b: Builder, cur: str) -> str:
    """A shape-keeping conv branch off ``cur`` (for a residual add or a product)."""
    _, c, _, _ = b.shape(cur)
    name = b.module("conv", f"nn.Conv2d({c}, {c}, 3, padding=1)")
    out = b.emit(f"self.{name}({cur})", "conv")
    return activation(b, out) if b.chance(0.5) else out


def _same_shape(b: Builder, cur: str) -> list[str]:
    return [n for n in b.float_values(4) if n != cur and b.shape(n) == b.shape(cur)]


def add(b: Builder, cur: str, weighted: bool = True) -> str | None:
    others = _same_shape(b, cur)
    if others and b.chance(0.6):
        other = b.rng.choice(others)
    elif weighted:
        other = _branch_like(b, cur)
    else:
        other = b.emit(f"torch.sigmoid({cur})", "sigmoid")
    form = b.rng.choice(["{} + {}", "torch.add({}, {})", "{1} + {0}"])
    return b.emit(form.format(cur, other), "add")


def mul(b: Builder, cur: str, weighted: bool = True) -> str | None:
    _, c, _, _ = b.shape(cur)
    kind = b.rng.choice(["tensor", "buffer", "scalar"])
    if kind == "buffer":
        values = [b.rng.uniform(-2.0, 2.0) for _ in range(c)]
        values[0] = -abs(values[0]) - 0.25  # at least one negative channel scale
        buffer = b.fresh("scale")
        b.init(f"self.register_buffer({buffer!r}, torch.tensor({b.constant(values)}).view(1, {c}, 1, 1))")
        return b.emit(f"{cur} * self.{buffer}", "mul_buffer")
    if kind == "scalar":
        factor = b.rng.choice(["-0.5", "2.0", "0.25", "-1.5"])
        form = b.rng.choice(["{} * {}", "{1} * {0}"])
        return b.emit(form.format(cur, factor), "mul_scalar")
    others = _same_shape(b, cur)
    other = b.rng.choice(others) if others else (_branch_like(b, cur) if weighted else cur)
    return b.emit(f"{cur} * {other}" if b.chance(0.5) else f"torch.mul({cur}, {other})", "mul")


def cat(b: Builder, cur: str, weighted: bool = True) -> str | None:
    _, c, h, w = b.shape(cur)
    others = [n for n in b.float_values(4) if n != cur and b.shape(n)[2:] == (h, w)]
    if others and b.chance(0.5):
        other = b.rng.choice(others)
    elif weighted:
        candidate = conv(b, cur, kind="plain")
        if candidate is None or b.shape(candidate)[2:] != (h, w):
            return None
        other = candidate
    else:
        other = b.emit(f"torch.relu({cur})", "torch_relu")
    if c + b.shape(other)[1] > MAX_CHANNELS:
        return None
    form = b.rng.choice(["torch.cat([{}, {}], dim=1)", "torch.cat(({}, {}), 1)"])
    return b.emit(form.format(cur, other), "cat")


def interpolate(b: Builder, cur: str) -> str | None:
    _, _, h, w = b.shape(cur)
    mode = b.rng.choice(["nearest", "bilinear"])
    corners = ", align_corners=False" if mode == "bilinear" and b.chance(0.5) else ""
    if b.chance(0.5):
        factor = 2 if max(h, w) <= 14 else 0.5
        if factor == 0.5 and min(h, w) < 4:
            return None
        if b.chance(0.3):
            name = b.module("up", f"nn.Upsample(scale_factor={factor}, mode={mode!r}{corners})")
            return b.emit(f"self.{name}({cur})", f"interpolate_scale_{mode}")
        return b.emit(
            f"F.interpolate({cur}, scale_factor={factor}, mode={mode!r}{corners})", f"interpolate_scale_{mode}"
        )
    size = (b.rng.randint(4, 20), b.rng.randint(4, 20))
    return b.emit(f"F.interpolate({cur}, size={size}, mode={mode!r}{corners})", f"interpolate_size_{mode}")


def slicing(b: Builder, cur: str) -> str | None:
    _, c, h, w = b.shape(cur)
    options = []
    if c >= 2:
        start = b.rng.randint(0, c - 2)
        options.append((f"{cur}[:, {start}:{b.rng.randint(start + 1, c)}]", "slice_channels"))
    if min(h, w) >= 4:
        options.append((f"{cur}[:, :, 1:, :-1]", "slice_spatial"))
        options.append((f"{cur}[:, :, ::2, ::2]", "slice_strided"))
    if not options:
        return None
    expression, tag = b.rng.choice(options)
    return b.emit(expression, tag)


def chunk_split(b: Builder, cur: str) -> str | None:
    _, c, h, _ = b.shape(cur)
    first, second = b.fresh("t"), b.fresh("t")
    if c >= 2 and b.chance(0.5):
        b.stmt(f"{first}, {second} = {cur}.chunk(2, dim=1)", "chunk")
    elif c >= 2 and b.chance(0.5):
        part = b.rng.randint(1, c - 1)
        b.stmt(f"{first}, {second} = torch.split({cur}, [{part}, {c - part}], dim=1)", "split")
    elif h >= 4:
        b.stmt(f"{first}, {second} = {cur}.split([{h // 2}, {h - h // 2}], dim=2)", "split_spatial")
    else:
        return None
    b.live += [first, second]
    return b.rng.choice([first, second])


def view_roundtrip(b: Builder, cur: str) -> str | None:
    _, c, h, w = b.shape(cur)
    method = "view" if b.value(cur).is_contiguous() else "reshape"
    if b.chance(0.5):
        flat = b.emit(f"{cur}.{method}({cur}.size(0), {cur}.shape[1], {cur}.shape[2] * {cur}.shape[3])", "shape_arith")
    else:
        flat = b.emit(f"{cur}.{method}(-1, {c}, {h * w})", method)
    if b.chance(0.5):
        flat = b.emit(f"{flat}.softmax(dim=-1)", "softmax")
    return b.emit(f"{flat}.reshape({flat}.shape[0], {c}, {h}, {w})", "reshape")


def squeeze_excite(b: Builder, cur: str) -> str:
    """A squeeze-and-excitation gate: global mean, 1x1 conv, ReLU, 1x1 conv, sigmoid, product with the input."""
    _, c, _, _ = b.shape(cur)
    hidden = max(1, c // 2)
    pooled = b.emit(
        f"{cur}.mean(dim=(2, 3), keepdim=True)" if b.chance(0.5) else f"F.adaptive_avg_pool2d({cur}, 1)",
        "squeeze_excite",
    )
    down = b.module("conv", f"nn.Conv2d({c}, {hidden}, 1)")
    up = b.module("conv", f"nn.Conv2d({hidden}, {c}, 1)")
    gate = b.emit(f"torch.sigmoid(self.{up}(torch.relu(self.{down}({pooled}))))")
    return b.emit(f"{cur} * {gate}", "mul")


def functional_conv(b: Builder, cur: str) -> str:
    """``F.conv2d`` with the module's own parameters (no nn.Conv2d)."""
    _, c, _, _ = b.shape(cur)
    cout = b.rng.randint(1, 8)
    weight, bias = b.fresh("weight"), b.fresh("bias")
    b.init(f"self.{weight} = nn.Parameter(torch.randn({cout}, {c}, 3, 3) * {1 / (3 * c**0.5):.3f})")
    b.init(f"self.{bias} = nn.Parameter(torch.randn({cout}) * 0.1)")
    return b.emit(f"F.conv2d({cur}, self.{weight}, self.{bias}, padding=1)", "functional_conv")


def pad(b: Builder, cur: str) -> str:
    mode = b.rng.choice(["constant", "reflect", "replicate"])
    if mode == "reflect" and min(b.shape(cur)[2:]) < 2:  # reflection needs more than the padded border
        mode = "constant"
    extra = "" if mode == "constant" else f", mode={mode!r}"
    return b.emit(f"F.pad({cur}, (1, 0, 1, 1){extra})", "pad")


def dropout_or_clamp(b: Builder, cur: str) -> str:
    kind = b.rng.choice(["dropout", "clamp", "hardtanh"])
    if kind == "dropout":
        name = b.module("drop", "nn.Dropout(0.1)")
        return b.emit(f"self.{name}({cur})", "dropout")
    if kind == "clamp":
        return b.emit(f"torch.clamp({cur}, -1.0, 1.0)", "clamp")
    return b.emit(f"F.hardtanh({cur})", "hardtanh")


WEIGHTED: list[Callable[[Builder, str], str | None]] = [
    conv_block,
    conv_block,
    conv_block,
    deconv,
    linear_on_channels,
    shared_conv,
    add,
    mul,
    cat,
    pool,
    interpolate,
    slicing,
    chunk_split,
    view_roundtrip,
    squeeze_excite,
    functional_conv,
    pad,
    dropout_or_clamp,
]
UNWEIGHTED: list[Callable[..., str | None]] = [
    activation,
    pool,
    add,
    mul,
    cat,
    interpolate,
    slicing,
    view_roundtrip,
    pad,
    dropout_or_clamp,
]


# -- user patterns that break tools ----------------------------------------------------------------
def output_feeds_quantized(b: Builder, cur: str) -> str:
    """``v = relu(conv1(x)); return conv2(v), v``: an output that is also a quantized layer's input."""
    v = conv(b, cur, kind="plain") or cur
    v = b.emit(f"torch.relu({v})", "torch_relu")
    b.outputs.append(v)
    b.tags.add("output_feeds_quantized")
    return conv(b, v, kind="plain") or v


def inplace_on_read(b: Builder, cur: str) -> str:
    """An inplace activation on a tensor another layer has read: ``b = conv2(a); a.relu_(); a + b``."""
    a = conv(b, cur, kind="plain") or _branch_like(b, cur)
    read = _branch_like(b, a)
    b.stmt(f"{a}.relu_()" if b.chance(0.5) else f"F.relu({a}, inplace=True)", "inplace_on_read")
    return b.emit(f"{a} + {read}", "add")


def dead_code(b: Builder, cur: str) -> str:
    """A branch whose result is never used; sometimes it calls an inplace ReLU the live path shares."""
    live = conv(b, cur, kind="plain") or cur
    if b.chance(0.5):
        relu = b.module("relu_shared", "nn.ReLU(inplace=True)")
        live = b.emit(f"self.{relu}({live})", "relu_inplace")
        dead = conv(b, cur, kind="plain") or _branch_like(b, cur)
        b.live.remove(dead)
        b.emit(f"self.{relu}({dead})", "dead_shared_inplace_relu", live=False)
    else:
        dead = conv(b, cur, kind="plain") or _branch_like(b, cur)
        b.live.remove(dead)
        b.emit(f"torch.sigmoid({dead})", live=False)
    b.tags.add("dead_code")
    return live


def build_image(b: Builder) -> None:
    c, h, w = b.rng.randint(1, 8), b.rng.randint(8, 16), b.rng.randint(8, 16)
    cur = b.add_input((BATCH, c, h, w))
    first_input = cur
    nothing_to_quantize = b.chance(0.06)
    if not nothing_to_quantize and b.chance(0.25):  # a second image input, merged by a concat or an add
        second = b.add_input((BATCH, b.rng.randint(1, 4), h, w))
        if b.chance(0.5) and c + b.shape(second)[1] <= MAX_CHANNELS:
            cur = b.emit(f"torch.cat([{cur}, {second}], dim=1)", "cat")
        else:
            cur = b.emit(f"{cur} + self.{b.module('conv', f'nn.Conv2d({b.shape(second)[1]}, {c}, 1)')}({second})")
            b.tags.update({"conv", "add"})
    if b.chance(0.1):
        b.add_input((BATCH, 3, h, w), live=False)
        b.tags.add("unused_input")
    patterns = [] if nothing_to_quantize else [output_feeds_quantized, inplace_on_read, dead_code]
    chosen = [p for p in patterns if b.chance(0.2)]
    ops = UNWEIGHTED if nothing_to_quantize else WEIGHTED
    steps = b.rng.randint(3, 7)
    for step in range(steps):
        if chosen and b.chance(1 / max(1, steps - step)):
            cur = chosen.pop()(b, cur)
            continue
        for _ in range(10):
            op = b.rng.choice(ops)
            out = op(b, cur, False) if nothing_to_quantize and op in (add, mul, cat) else op(b, cur)
            if out is not None:
                cur = out
                break
    for pattern in chosen:
        cur = pattern(b, cur)
    if nothing_to_quantize:
        b.tags.add("nothing_to_quantize")
    elif b.chance(0.4):
        cur = head(b, cur)
    extras = [n for n in b.float_values(4) if n not in (cur, first_input, *b.outputs)]
    if extras and b.chance(0.25):
        b.outputs.append(b.rng.choice(extras))
    b.outputs.insert(0, cur)
    if b.chance(0.1):
        b.outputs.append(first_input)
        b.tags.add("input_as_output")


TAGS = frozenset(
    {f"conv_{k}" for k in ("plain", "groups", "depthwise", "dilation", "stride", "padding_mode", "same", "nobias")}
    | set(ACTIVATIONS)
    | set(FUNCTIONAL_ACTIVATIONS)
    | {"conv", "deconv", "deconv_groups", "bn", "permute", "movedim", "linear_channels", "shared_module"}
    | {"adaptive_avgpool", "view", "flatten", "reshape", "linear_head", "maxpool", "avgpool", "ceil_mode"}
    | {"count_include_pad_false", "add", "mul", "mul_buffer", "mul_scalar", "cat", "softmax"}
    | {f"interpolate_{how}_{mode}" for how in ("scale", "size") for mode in ("nearest", "bilinear")}
    | {"slice_channels", "slice_spatial", "slice_strided", "chunk", "split", "split_spatial"}
    | {"output_feeds_quantized", "inplace_on_read", "dead_code", "dead_shared_inplace_relu", "unused_input"}
    | {"nothing_to_quantize", "input_as_output", "multi_input", "multi_output", "sigmoid"}
    | {"squeeze_excite", "functional_conv", "pad", "dropout", "clamp", "hardtanh", "shape_arith"}
)
