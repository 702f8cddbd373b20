"""One run of the shipped PTQ example, shared by the tests that read its run folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from mqbench.cli import main

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="session")
def ptq_example_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """The run folder of `mqbench ptq --config examples/ptq_resnet18_digits.yaml` and its exit status."""
    run = tmp_path_factory.mktemp("ptq_example") / "run"
    code = main(["ptq", "--config", str(EXAMPLES / "ptq_resnet18_digits.yaml"), "--output", str(run), "--quiet"])
    return run, code
