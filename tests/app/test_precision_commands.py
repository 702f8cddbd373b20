"""`mqbench profile` and `mqbench mixed-precision` on the shipped examples: the run folder, the figures
against what the saved files give when reloaded here, the report sections, and the errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml

from mqbench.app.config import ConfigError, load_config, parse_config
from mqbench.app.precision import run_mixed_precision
from mqbench.cli import main
from mqbench.functional import bits_of_range
from mqbench.models.zoo import zoo_model
from mqbench.prepare_by_platform import prepare_by_platform

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_the_profile_example_measures_every_layer(tmp_path):
    run = tmp_path / "profile"
    assert main(["profile", "--config", str(EXAMPLES / "profile_resnet18_digits.yaml"), "--output", str(run)]) == 0
    results = json.loads((run / "results.json").read_text())
    assert results["status"] == "finished" and results["verify"]["passed"]
    rows = results["profile"]
    layers = {row["name"] for row in rows}
    assert {"conv1", "fc"} <= layers
    kinds = {(row["mode"], row["part"]) for row in rows if row["name"] == "conv1"}
    standalone = {("standalone", part) for part in ("weight", "activation", "both")}
    assert kinds == standalone | {("interaction", "both")}
    assert all(math.isfinite(row["sqnr_db"]) and row["sqnr_db"] > 10 for row in rows)  # 8-bit TensorRT
    # accumulated error grows: the last layer's interaction SQNR is below its standalone one
    fc = {(row["mode"], row["part"]): row["sqnr_db"] for row in rows if row["name"] == "fc"}
    assert fc[("interaction", "both")] < fc[("standalone", "both")]
    assert "Per-layer profile" in (run / "report.md").read_text()
    assert 'id="plot-profile"' in (run / "report.html").read_text()
    assert (run / "profile.md").read_text().startswith("| layer | op |")


def test_the_mixed_precision_example_meets_its_budget_deploys_and_reloads(tmp_path):
    config = load_config(EXAMPLES / "mixed_precision_resnet18_digits.yaml")
    config["mixed_precision"]["pareto"] = config["mixed_precision"]["pareto"][:1]  # one sweep point: suite time
    run = tmp_path / "mixed"
    results = run_mixed_precision(config, run, quiet=True)
    assert results["status"] == "finished" and results["verify"]["passed"], results.get("verify")
    mixed = results["mixed_precision"]
    zoo = zoo_model("resnet18")
    params = sum(m.weight.numel() for m in zoo.model.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear)))
    assert mixed["budget"]["size_bytes"] == pytest.approx(params * 3 / 8)
    assert mixed["size_bytes"] <= mixed["budget"]["size_bytes"]
    widths = [bits[0] for bits in mixed["bits"].values()]
    assert widths[0] == 8 and widths[-1] == 8 and min(widths) < 8
    assert len(mixed["pareto"]) == 1 and mixed["pareto"][0]["accuracy"] is not None
    # the saved state dict loads into the model prepared with the written extra_prepare_dict, at those widths
    extra = yaml.safe_load((run / "mixed_precision.yaml").read_text())
    qmodel = prepare_by_platform(zoo.model, "academic", extra)
    qmodel.load_state_dict(torch.load(run / "quantized_state_dict.pt", weights_only=True))
    named = dict(qmodel.named_modules())
    for layer, (weight_bits, _) in mixed["bits"].items():
        quantizer = named[f"{layer}.weight_fake_quant"]
        assert bits_of_range(quantizer.quant_min, quantizer.quant_max) == weight_bits, layer
    report = (run / "report.md").read_text()
    assert "## Mixed precision" in report and "| budget | size MB | BitOps | accuracy |" in report
    assert 'id="plot-pareto"' in (run / "report.html").read_text()


def test_a_single_width_backend_and_bad_budgets_are_named(tmp_path, capsys):
    config = tmp_path / "mixed.yaml"
    config.write_text(yaml.safe_dump({"quantize": {"backend": "Tensorrt"}, "mixed_precision": {"weight_bits": [8, 4]}}))
    with pytest.raises(SystemExit):
        main(["mixed-precision", "--config", str(config), "--output", str(tmp_path / "run"), "--quiet"])
    assert "academic" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"mixed_precision\.budget"):
        parse_config({"mixed_precision": {"budget": {"average_bits": 4}}}, "run.yaml")
    with pytest.raises(ConfigError, match=r"mixed_precision\.weight_bits"):
        parse_config({"mixed_precision": {"weight_bits": [8, 1]}}, "run.yaml")
    given = parse_config({"mixed_precision": {"budget": {"bitops": 1e9}}}, "run.yaml")
    assert given["mixed_precision"]["budget"] == {"bitops": 1e9}  # replaces the default budget
