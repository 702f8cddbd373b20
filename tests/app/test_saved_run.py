"""`mqbench deploy --run DIR` and `mqbench verify --run DIR` on finished run folders: the quantized model
rebuilt from the folder deploys to the artifacts the run wrote, verification checks the folder's own
files (a changed weight is caught), and folders that cannot be used say why."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import yaml
from onnx import numpy_helper

from app.test_qat_command import TINY_MODELS
from mqbench.app.folder import update_checksums
from mqbench.cli import main


def _initializers(path: Path) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}


@pytest.fixture
def ptq_run(ptq_example_run, tmp_path) -> Path:
    run, code = ptq_example_run
    assert code == 0
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    return copy


def test_a_saved_ptq_run_verifies_and_deploys_again_to_the_same_artifacts(ptq_run, tmp_path, capsys):
    assert main(["verify", "--run", str(ptq_run)]) == 0
    assert "passed" in capsys.readouterr().out
    assert main(["deploy", "--run", str(ptq_run), "--output", str(tmp_path / "again"), "--quiet"]) == 0
    listed = dict(line.split(": ", 1) for line in capsys.readouterr().out.strip().splitlines())
    saved = sorted(p.name for p in (ptq_run / "deploy").iterdir())
    assert sorted(Path(path).name for path in listed.values()) == saved
    original = _initializers(ptq_run / "deploy" / "resnet18.onnx")
    again = _initializers(tmp_path / "again" / "resnet18.onnx")
    assert original.keys() == again.keys() and len(original) > 20
    for name, values in original.items():
        np.testing.assert_array_equal(again[name], values, err_msg=name)


def test_verify_checks_the_files_in_the_folder(ptq_run, capsys):
    path = ptq_run / "deploy" / "resnet18.onnx"
    model = onnx.load(str(path))
    weights = max(model.graph.initializer, key=lambda t: numpy_helper.to_array(t).size)
    changed = numpy_helper.to_array(weights).copy()
    changed.reshape(-1)[: changed.size // 2] = changed.reshape(-1)[: changed.size // 2][::-1]
    weights.CopyFrom(numpy_helper.from_array(changed, weights.name))
    onnx.save(model, str(path))
    with pytest.raises(SystemExit) as exit_info:  # the run's checksum list names the changed file first
        main(["verify", "--run", str(ptq_run)])
    assert exit_info.value.code == 2
    assert "deploy/resnet18.onnx changed after the run finished" in capsys.readouterr().err
    update_checksums(ptq_run, [path])  # recorded as the run's: the verification itself measures the change
    assert main(["verify", "--run", str(ptq_run)]) == 1
    assert "FAILED" in capsys.readouterr().out.upper()


def test_a_saved_qat_run_is_rebuilt_with_its_folded_batch_norm(tmp_path, user_modules, capsys):
    user_modules("tiny_models", TINY_MODELS)
    config = {
        "model": {"type": "tiny_models:cnn"},
        "data": {"batch_size": 16, "input_size": 16, "max_eval": 32},
        "quantize": {"cali_batchsize": 2, "backend": "tensorrt", "verify_samples": 8},
        "training": {"epochs": 1, "max_steps": 2, "lr": 0.05, "optimizer": "sgd"},
    }
    (tmp_path / "qat.yaml").write_text(yaml.safe_dump(config))
    assert main(["qat", "--config", "qat.yaml", "--output", "run", "--quiet"]) == 0
    capsys.readouterr()
    assert main(["verify", "--run", "run"]) == 0
    assert "passed" in capsys.readouterr().out


def test_folders_that_cannot_be_used_say_why(ptq_run, tmp_path, capsys):
    def usage_error(argv: list[str]) -> str:
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
        return capsys.readouterr().err

    assert "not a run folder (it needs results.json and config.yaml)" in usage_error(["verify", "--run", str(tmp_path)])
    assert "drop --backend" in usage_error(["verify", "--run", str(ptq_run), "--backend", "tensorrt"])
    shutil.rmtree(ptq_run / "deploy")
    assert (
        "is missing (the run recorded its checksum in checksums.sha256); write the run's artifacts again with "
        "mqbench deploy --run" in usage_error(["verify", "--run", str(ptq_run)])
    )
    (ptq_run / "checksums.sha256").unlink()  # a run from before checksum lists: the verification finds it
    assert "write them with mqbench deploy --run" in usage_error(["verify", "--run", str(ptq_run)])
    results = json.loads((ptq_run / "results.json").read_text())
    (ptq_run / "results.json").write_text(json.dumps({**results, "status": "interrupted"}))
    assert "the run's status is 'interrupted'" in usage_error(["deploy", "--run", str(ptq_run)])
