"""Package-wide properties: public names, registries, no deprecated PyTorch quantization."""

import importlib
import pkgutil
import re
from pathlib import Path

import pytest
import torch

import mqbench
from mqbench.fake_quantize import FakeQuantizeDict, QuantizeBase
from mqbench.observer import ObserverBase, ObserverDict
from mqbench.utils.factory import Factory

SOURCE = Path(mqbench.__file__).resolve().parent


def test_no_deprecated_torch_quantization_in_sources():
    # `import torch` itself loads torch.ao.quantization, so the sources are what can be checked.
    pattern = re.compile(r"torch\.ao\b|torch\.quantization\b|from torch import ao\b|torch\.nn\.quantized\b")
    offenders = [str(path) for path in SOURCE.rglob("*.py") if pattern.search(path.read_text())]
    assert offenders == []


def test_every_public_module_declares_all():
    for info in pkgutil.walk_packages(mqbench.__path__, "mqbench."):
        if info.name.rsplit(".", 1)[-1].startswith("_"):
            continue
        module = importlib.import_module(info.name)
        assert isinstance(getattr(module, "__all__", None), list), f"{info.name} has no __all__"
        for name in module.__all__:
            assert hasattr(module, name), f"{info.name}.__all__ names missing {name!r}"


EXPECTED_OBSERVERS = {
    "MinMaxObserver",
    "EMAMinMaxObserver",
    "MinMaxFloorObserver",
    "PoTModeObserver",
    "EMAQuantileObserver",
    "ClipStdObserver",
    "LSQObserver",
    "LSQPlusObserver",
    "MSEObserver",
    "EMAMSEObserver",
    "HistogramObserver",
    "KLDObserver",
    "PercentileObserver",
}
EXPECTED_FAKE_QUANTIZERS = {
    "FixedFakeQuantize",
    "LearnableFakeQuantize",
    "PACTFakeQuantize",
    "DoReFaFakeQuantize",
    "DSQFakeQuantize",
    "TqtFakeQuantize",
    "NNIEFakeQuantize",
}


def test_registries_hold_every_builtin():
    assert set(ObserverDict) >= EXPECTED_OBSERVERS
    assert set(FakeQuantizeDict) >= EXPECTED_FAKE_QUANTIZERS


def test_backend_type_names_exactly_the_builtin_backends():
    from mqbench import prepare_by_platform
    from mqbench.backends import BackendType, registry

    assert [backend.value for backend in BackendType] == [module.SPEC.name for module in registry._BUILTIN]
    assert prepare_by_platform.BackendType is BackendType  # the historical import path


@pytest.mark.parametrize("name", sorted(EXPECTED_OBSERVERS))
def test_observer_with_args_builds_and_observes(name):
    cls = ObserverDict[name]
    factory = cls.with_args(quant_min=-128, quant_max=127, qscheme=torch.per_tensor_symmetric)
    assert isinstance(factory, Factory)
    observer = factory()
    assert isinstance(observer, ObserverBase) and observer.quant_min == -128
    x = torch.randn(4, 8, 16)
    assert observer(x) is x
    scale, zero_point = observer.calculate_qparams()
    assert torch.isfinite(scale).all() and (scale > 0).all() and zero_point.dtype == torch.int32


@pytest.mark.parametrize("name", sorted(EXPECTED_FAKE_QUANTIZERS))
def test_fake_quantizer_with_args_builds_and_runs(name):
    cls = FakeQuantizeDict[name]
    factory = cls.with_args(
        observer=ObserverDict["MinMaxObserver"], quant_min=-128, quant_max=127, qscheme=torch.per_tensor_symmetric
    )
    quantizer = factory()
    assert isinstance(quantizer, QuantizeBase)
    x = torch.randn(4, 8, 16)
    out = quantizer(x)
    assert out.shape == x.shape and torch.isfinite(out).all()


def _module_imports() -> dict[str, tuple[set[str], set[str]]]:
    """Each module of src/mqbench -> (the mqbench modules it imports anywhere, those imported inside functions).

    Imports under ``if TYPE_CHECKING:`` are not executed and are left out; a package's ``__init__``
    is the package's name.
    """
    import ast
    from pathlib import Path

    root = Path(mqbench.__file__).parent
    names = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def targets(node: ast.AST) -> set[str]:
        found = set()
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("mqbench"):
            for alias in node.names:
                child = f"{node.module}.{alias.name}"
                found.add(child if child in names else node.module)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("mqbench")}
        return {name for name in found if name in names}

    result = {}
    for module, path in names.items():
        tree = ast.parse(path.read_text())
        skipped = {
            id(inner)
            for block in ast.walk(tree)
            if isinstance(block, ast.If)
            and getattr(block.test, "id", getattr(block.test, "attr", "")) == "TYPE_CHECKING"
            for inner in ast.walk(block)
        }
        everywhere, in_functions = set(), set()
        for function in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            for node in ast.walk(function):
                in_functions |= targets(node)
        for node in ast.walk(tree):
            if id(node) not in skipped:
                everywhere |= targets(node)
        result[module] = (everywhere - {module}, in_functions - {module})
    return result


def test_the_modules_of_mqbench_import_each_other_without_a_cycle():
    """No import cycle, counting the imports inside functions too (which would otherwise hide one)."""
    graph = {module: edges for module, (edges, _) in _module_imports().items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for other in sorted(graph[module]):
            if state.get(other) == 1:
                cycle = [*path[path.index(other) :], other]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if other not in state:
                visit(other)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)


def test_imports_inside_functions_only_keep_the_command_line_fast():
    """mqbench's own modules are imported at the top; the CLI defers its commands so `--help` needs no torch."""
    deferred = {module: inner for module, (_, inner) in _module_imports().items() if inner}
    assert set(deferred) <= {"mqbench.cli"}, deferred


def test_no_source_file_is_over_700_lines():
    """A module past 700 lines holds more than one idea: split it by what its parts do."""
    from pathlib import Path

    root = Path(mqbench.__file__).parent
    long = {str(p.relative_to(root)): n for p in root.rglob("*.py") if (n := len(p.read_text().splitlines())) > 700}
    assert not long, long


def test_the_subsystems_of_mqbench_import_each_other_without_a_cycle():
    """``mqbench.<package>`` as one node each (utils, observer, fake_quantize, advanced_ptq, deploy, ...): the
    foundation (utils) imports nothing above it, so the layers stack without a circle."""
    graph: dict[str, set[str]] = {}
    for module, (edges, _) in _module_imports().items():
        here = ".".join(module.split(".")[:2])
        graph.setdefault(here, set()).update(".".join(e.split(".")[:2]) for e in edges)
    for node, edges in graph.items():
        edges.discard(node)
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for other in sorted(graph.get(node, ())):
            if state.get(other) == 1:
                raise AssertionError("subsystem cycle: " + " -> ".join([*path[path.index(other) :], other]))
            if other not in state:
                visit(other)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not {e for e in graph["mqbench.utils"] if e != "mqbench.utils"}, graph["mqbench.utils"]
