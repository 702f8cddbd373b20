"""Run folders: outputs that cannot take a run are named with what to do, a full disk fails cleanly (results.json
says failed, nothing half-written), a finished run is never overwritten unless asked and never lost to a run
that does not finish, and a finished run lists the SHA-256 of its files (checked here with sha256sum)."""

from __future__ import annotations

import errno
import hashlib
import json
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch
import yaml

from app.test_qat_command import TINY_MODELS
from mqbench.cli import main
from mqbench.utils.host import int8_pairs_saturate

CONFIG = {
    "model": {"type": "tiny_models:cnn"},
    "data": {"batch_size": 16, "input_size": 16, "max_eval": 32},
    "quantize": {"cali_batchsize": 2, "backend": "tensorrt", "verify_samples": 8},
}


@pytest.fixture
def config(tmp_path, user_modules) -> Path:
    user_modules("tiny_models", TINY_MODELS)
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(CONFIG))
    return path


def _usage_error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "Traceback" not in error
    return error


def _digests(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_output_paths_that_cannot_take_a_run_say_what_is_wrong(config, tmp_path, capsys, monkeypatch):
    (tmp_path / "a_file").write_text("not a folder\n")
    error = _usage_error(["ptq", "--config", str(config), "--output", "a_file", "--quiet"], capsys)
    assert "the run folder a_file is a file, not a folder: give --output a folder path" in error

    error = _usage_error(["ptq", "--config", str(config), "--output", "a_file/run", "--quiet"], capsys)
    assert "cannot create the run folder a_file/run: Not a directory (a part of that path is a file)" in error

    def refused(*args, **kwargs):  # what a read-only folder answers (root writes through chmod)
        raise PermissionError(errno.EACCES, "Permission denied", kwargs.get("dir"))

    monkeypatch.setattr(tempfile, "mkstemp", refused)
    error = _usage_error(["ptq", "--config", str(config), "--output", "readonly", "--quiet"], capsys)
    assert "the run folder readonly is not writable (Permission denied): give --output a folder you can write" in error
    assert not (tmp_path / "readonly" / "results.json").exists()


def _disk_fills_at_the_state_dict(monkeypatch) -> dict[str, bool]:
    """torch.save writes part of the file, then the disk is full; from then on every write fails the same way."""
    state = {"full": False}
    save = torch.save

    def save_until_full(payload, file, *args, **kwargs):
        if str(file).endswith("quantized_state_dict.pt.partial"):
            Path(file).write_bytes(b"PK\x03\x04 half a file")
            state["full"] = True
            raise OSError(errno.ENOSPC, "No space left on device")
        return save(payload, file, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save_until_full)
    return state


def test_a_full_disk_is_a_clear_error_and_the_run_says_failed(config, tmp_path, capsys, monkeypatch):
    _disk_fills_at_the_state_dict(monkeypatch)
    error = _usage_error(["ptq", "--config", str(config), "--output", "run", "--quiet"], capsys)
    assert "cannot write run/quantized_state_dict.pt: No space left on device; free space on that disk" in error
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["status"] == "failed"
    assert "quantized_state_dict.pt: No space left on device" in results["error"]
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["config.yaml", "results.json"]  # no partial


def test_a_disk_too_full_for_the_failure_record_leaves_no_running_status(config, tmp_path, capsys, monkeypatch):
    state = _disk_fills_at_the_state_dict(monkeypatch)
    write_text = Path.write_text

    def write_unless_full(self, *args, **kwargs):
        if state["full"]:
            raise OSError(errno.ENOSPC, "No space left on device", str(self))
        return write_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", write_unless_full)
    _usage_error(["ptq", "--config", str(config), "--output", "run", "--quiet"], capsys)
    results = tmp_path / "run" / "results.json"  # written over the old file (its space), or removed
    assert not results.exists() or json.loads(results.read_text())["status"] == "failed"
    assert not [p for p in (tmp_path / "run").iterdir() if p.name.endswith(".partial")]


def test_a_finished_run_is_refused_kept_through_an_interrupted_overwrite_and_replaced_whole(
    config, tmp_path, capsys, monkeypatch
):
    run = tmp_path / "run"
    assert main(["ptq", "--config", str(config), "--output", "run", "--quiet"]) == 0
    finished = _digests(run)
    assert "checksums.sha256" in finished and "deploy/model_clip_ranges.json" in finished
    check = subprocess.run(["sha256sum", "--check", "--strict", "checksums.sha256"], cwd=run, capture_output=True)
    assert check.returncode == 0, check.stdout + check.stderr  # an independent reading of the list
    listed = {line.split("  ", 1)[1] for line in (run / "checksums.sha256").read_text().splitlines()}
    assert listed == {"config.yaml", "quantized_state_dict.pt", *(f for f in finished if f.startswith("deploy/"))}

    error = _usage_error(["ptq", "--config", str(config), "--output", "run", "--quiet"], capsys)
    assert "run holds a finished run" in error and "--overwrite" in error
    assert _digests(run) == finished

    import mqbench.app.ptq

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(mqbench.app.ptq, "calibrate", interrupted)
        with pytest.raises(KeyboardInterrupt):
            main(["ptq", "--config", str(config), "--output", "run", "--quiet", "--overwrite"])
    assert _digests(run) == finished  # byte for byte, and nothing else left
    assert sorted(p.name for p in run.iterdir() if p.name.startswith(".")) == []

    other = tmp_path / "openvino.yaml"
    openvino = {**CONFIG, "quantize": {**CONFIG["quantize"], "backend": "openvino"}}
    if int8_pairs_saturate():  # the documented remedy on CPUs without VNNI, so that the host serves the artifact
        openvino["extra_prepare_dict"] = {"reduce_range": True}
    other.write_text(yaml.safe_dump(openvino))
    assert main(["ptq", "--config", str(other), "--output", "run", "--quiet", "--overwrite"]) == 0
    replaced = _digests(run)
    results = json.loads((run / "results.json").read_text())
    assert results["status"] == "finished" and results["backend"] == "openvino"
    deployed = {f for f in replaced if f.startswith("deploy/")}
    assert deployed == {str(Path(p).resolve().relative_to(run)) for p in results["artifacts"].values()}
    assert "deploy/model_clip_ranges.json" not in replaced and "deploy/model_calib_cache.txt" not in replaced
    assert sorted(p.name for p in run.iterdir() if p.name.startswith(".")) == []
    check = subprocess.run(["sha256sum", "--check", "--strict", "checksums.sha256"], cwd=run, capture_output=True)
    assert check.returncode == 0, check.stdout + check.stderr


def test_a_failed_run_is_run_again_into_its_folder_without_overwrite(config, tmp_path, capsys, monkeypatch):
    with monkeypatch.context() as patch:
        _disk_fills_at_the_state_dict(patch)
        _usage_error(["ptq", "--config", str(config), "--output", "run", "--quiet"], capsys)
    shutil.copy(config, tmp_path / "again.yaml")
    assert main(["ptq", "--config", "again.yaml", "--output", "run", "--quiet"]) == 0
    assert json.loads((tmp_path / "run" / "results.json").read_text())["config"] == "again.yaml"


def test_a_disk_that_fills_while_deploying_is_named_and_the_run_says_failed(config, tmp_path, capsys, monkeypatch):
    write_text = Path.write_text

    def full_at_the_calibration_cache(self, *args, **kwargs):
        if self.name.endswith("calib_cache.txt"):
            raise OSError(errno.ENOSPC, "No space left on device", str(self))
        return write_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full_at_the_calibration_cache)
    error = _usage_error(["ptq", "--config", str(config), "--output", "run", "--quiet"], capsys)
    assert "model_calib_cache.txt: No space left on device; free space on that disk" in error
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["status"] == "failed" and "No space left on device" in results["error"]
    assert not (tmp_path / "run" / "checksums.sha256").exists()
