"""One run of the shipped PTQ example, shared by the tests that read its run folder."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path

import pytest

from mqbench.cli import main

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture
def user_modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[str, str], Path]:
    """The test's ``tmp_path`` as an importable working directory (as ``python -m`` makes it); returns
    ``write(name, source)``, which writes the module ``name.py`` there."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(name: str, source: str) -> Path:
        path = tmp_path / f"{name}.py"
        path.write_text(source)
        importlib.invalidate_caches()  # a module written after the directory was put on sys.path
        return path

    return write


@pytest.fixture(scope="session")
def ptq_example_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """The run folder of `mqbench ptq --config examples/ptq_resnet18_digits.yaml` and its exit status."""
    run = tmp_path_factory.mktemp("ptq_example") / "run"
    code = main(["ptq", "--config", str(EXAMPLES / "ptq_resnet18_digits.yaml"), "--output", str(run), "--quiet"])
    return run, code
