"""The graph builder of the fuzz grammar: source written line by line, each line run as it is written.

Each graph is generated as Python source (a ``Net(nn.Module)`` class) and built by running that
source, so ``describe()`` is exactly the code that runs and a failure can be reproduced by hand.
While generating, every line is run at once on meta tensors (batch 2, shapes without data): the
shapes the next choices depend on are the real ones, and a line the grammar should not have written
fails here.

Same seed -> same source, same weights (``torch.manual_seed(seed)`` before ``Net()``), same data.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["BATCH", "CALIBRATION_BATCHES", "Builder", "FuzzGraph", "InputSpec"]

BATCH = 2
CALIBRATION_BATCHES = 3


@dataclass(frozen=True)
class InputSpec:
    """One forward input: its name, shape (batch first), dtype, and for integer inputs the value range."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"  # or "int64"
    high: int = 0  # int64 inputs: values in [0, high)

    def sample(self, generator: torch.Generator, scale: float = 1.0) -> Tensor:
        if self.dtype == "int64":
            return torch.randint(0, self.high, self.shape, generator=generator, dtype=torch.int64)
        return torch.randn(self.shape, generator=generator) * scale


@dataclass(frozen=True)
class FuzzGraph:
    """One generated graph: its source, inputs, and the grammar tags it uses."""

    seed: int
    family: str
    source: str
    inputs: tuple[InputSpec, ...]
    tags: frozenset[str] = field(default_factory=frozenset)

    def build(self) -> nn.Module:
        """The model in eval mode, weights from ``torch.manual_seed(seed)`` (the global RNG is restored)."""
        namespace: dict[str, object] = {}
        exec(compile(self.source, f"<fuzz graph {self.seed}>", "exec"), namespace)
        with torch.random.fork_rng():
            torch.manual_seed(self.seed)
            model = namespace["Net"]()  # type: ignore[operator]
        return model.eval()

    def batch(self, index: int, scale: float = 1.0) -> tuple[Tensor, ...]:
        """Input batch ``index`` (0.. calibration, -1 verification); float inputs are N(0, 1) * ``scale``."""
        generator = torch.Generator().manual_seed(self.seed * 1009 + 17 * (index + 2))
        return tuple(spec.sample(generator, scale) for spec in self.inputs)

    def calibration_batches(self) -> list[tuple[Tensor, ...]]:
        return [self.batch(i) for i in range(CALIBRATION_BATCHES)]

    def verify_inputs(self, scale: float = 1.0) -> tuple[Tensor, ...]:
        """A batch apart from the calibration ones, from the same distribution (times ``scale``)."""
        return self.batch(-1, scale)

    def describe(self) -> str:
        """A runnable script: the module source, then how the model and the data are made."""
        shapes = ", ".join(f"{s.name}: {list(s.shape)} {s.dtype}" for s in self.inputs)
        return (
            f"# fuzz graph seed={self.seed} family={self.family}; inputs {shapes}\n"
            f"# tags: {', '.join(sorted(self.tags))}\n"
            f"{self.source}\n"
            f"torch.manual_seed({self.seed})\n"
            "model = Net().eval()\n"
            f"# data (with tests/ on sys.path): from fuzz.grammar import generate; "
            f"generate({self.seed}, {self.family!r}).batch(i), calibration i = 0..{CALIBRATION_BATCHES - 1}, "
            "verification i = -1\n"
        )


class Builder:
    """Writes a Net class line by line, running each line on example tensors as it goes."""

    def __init__(self, seed: int, family: str) -> None:
        self.rng = random.Random(f"{family}:{seed}")
        self.seed = seed
        self.holder = nn.Module()
        self.namespace: dict[str, object] = {"torch": torch, "nn": nn, "F": F, "self": self.holder}
        self.init_lines: list[str] = []
        self.forward_lines: list[str] = []
        self.inputs: list[InputSpec] = []
        self.live: list[str] = []  # values the next ops may read
        self.outputs: list[str] = []
        self.tags: set[str] = set()
        self.notes: dict[str, str] = {}  # values a family's ops share (e.g. an attention mask)
        self._count = 0
        torch.manual_seed(seed)

    # -- writing ----------------------------------------------------------------------------------
    def fresh(self, prefix: str) -> str:
        self._count += 1
        return f"{prefix}{self._count}"

    def module(self, prefix: str, constructor: str) -> str:
        name = self.fresh(prefix)
        self.init(f"self.{name} = {constructor}")
        return name

    def init(self, line: str) -> None:
        exec(line, self.namespace)
        self.init_lines.append(line)

    def emit(self, expression: str, *tags: str, live: bool = True) -> str:
        """``tN = expression`` in forward; returns the new value's name."""
        name = self.fresh("t")
        self.stmt(f"{name} = {expression}", *tags)
        if live:
            self.live.append(name)
        return name

    def stmt(self, line: str, *tags: str) -> None:
        exec(line, self.namespace)
        self.forward_lines.append(line)
        self.tags.update(tags)

    def add_input(self, shape: tuple[int, ...], dtype: str = "float32", high: int = 0, live: bool = True) -> str:
        name = f"x{len(self.inputs)}" if dtype == "float32" else f"ids{len(self.inputs)}"
        self.inputs.append(InputSpec(name, shape, dtype, high))
        self.namespace[name] = torch.empty(shape, dtype=getattr(torch, dtype), device="meta")
        if live:
            self.live.append(name)
        return name

    # -- reading ----------------------------------------------------------------------------------
    def shape(self, name: str) -> tuple[int, ...]:
        value = self.namespace[name]
        assert isinstance(value, Tensor)
        return tuple(value.shape)

    def value(self, name: str) -> Tensor:
        value = self.namespace[name]
        assert isinstance(value, Tensor)
        return value

    def float_values(self, rank: int) -> list[str]:
        return [n for n in self.live if self.value(n).is_floating_point() and self.value(n).dim() == rank]

    def constant(self, values: list[float]) -> str:
        return "[" + ", ".join(f"{v:.2f}" for v in values) + "]"

    def chance(self, p: float) -> bool:
        return self.rng.random() < p

    # -- the result -------------------------------------------------------------------------------
    def source(self) -> str:
        args = ", ".join(spec.name for spec in self.inputs)
        outputs = ", ".join(self.outputs) + ("," if len(self.outputs) == 1 else "")
        body = "\n".join(f"        {line}" for line in self.init_lines) or "        pass"
        forward = "\n".join(f"        {line}" for line in self.forward_lines)
        returned = self.outputs[0] if len(self.outputs) == 1 else f"({outputs})"
        return (
            "import torch\n"
            "import torch.nn.functional as F\n"
            "from torch import nn\n\n\n"
            "class Net(nn.Module):\n"
            "    def __init__(self):\n"
            "        super().__init__()\n"
            f"{body}\n\n"
            f"    def forward(self, {args}):\n"
            f"{forward}\n"
            f"        return {returned}\n"
        )

    def finish(self, family: str) -> FuzzGraph:
        if len(self.outputs) > 1:
            self.tags.add("multi_output")
        if len(self.inputs) > 1:
            self.tags.add("multi_input")
        return FuzzGraph(self.seed, family, self.source(), tuple(self.inputs), frozenset(self.tags))
