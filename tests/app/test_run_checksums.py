"""A finished run's checksum list: `mqbench verify --run` and `mqbench deploy --run` refuse a run folder whose
saved state dict has flipped bytes (which torch.load reads without a word) or whose parameter files were edited,
naming the file and what to do; `mqbench deploy --run` writes the artifacts again and records them."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest
import torch
import yaml

from app.test_qat_command import TINY_MODELS
from mqbench.cli import main

CONFIG = {
    "model": {"type": "tiny_models:cnn"},
    "data": {"batch_size": 16, "input_size": 16, "max_eval": 32},
    "quantize": {"cali_batchsize": 2, "backend": "tensorrt", "verify_samples": 8},
}


@pytest.fixture
def run(tmp_path, user_modules) -> Path:
    user_modules("tiny_models", TINY_MODELS)
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(CONFIG))
    assert main(["ptq", "--config", "tiny.yaml", "--output", "run", "--quiet"]) == 0
    return Path("run")


def _refused(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def _flip_bytes_inside(state_file: Path, tensor_name: str) -> None:
    """Invert 4 bytes in the middle of one tensor's stored data (torch.save's zip stores it uncompressed)."""
    state = torch.load(state_file, weights_only=True)
    target = state[tensor_name]
    with zipfile.ZipFile(state_file) as archive:
        entries = [i for i in archive.infolist() if "/data/" in i.filename]
        entry = next(i for i in entries if i.file_size == target.untyped_storage().nbytes())
    raw = bytearray(state_file.read_bytes())
    header = entry.header_offset
    name_length = int.from_bytes(raw[header + 26 : header + 28], "little")
    extra_length = int.from_bytes(raw[header + 28 : header + 30], "little")
    start = header + 30 + name_length + extra_length + entry.file_size // 2
    raw[start : start + 4] = bytes(b ^ 0xFF for b in raw[start : start + 4])
    state_file.write_bytes(bytes(raw))


def test_flipped_bytes_inside_a_saved_weight_are_refused_by_verify_and_deploy(run, capsys):
    state_file = run / "quantized_state_dict.pt"
    before = torch.load(state_file, weights_only=True)
    name = max((k for k, v in before.items() if k.endswith("weight")), key=lambda k: before[k].numel())
    _flip_bytes_inside(state_file, name)
    after = torch.load(state_file, weights_only=True)  # the damage loads silently...
    assert not torch.equal(after[name], before[name])
    assert all(torch.equal(after[k], before[k]) for k in before if k != name)

    for command in ("verify", "deploy"):  # ...and is refused by both, naming the file
        error = _refused([command, "--run", str(run)], capsys)
        assert "run: quantized_state_dict.pt changed after the run finished" in error
        assert "restore the file from a copy, or run the command again (--overwrite replaces the run)" in error


@pytest.mark.parametrize("edit", ["clip_ranges", "calib_cache"])
def test_an_edited_parameter_file_is_refused_until_deploy_writes_it_again(edit, run, capsys):
    if edit == "clip_ranges":  # the network input's range x1.5
        file = run / "deploy" / "model_clip_ranges.json"
        ranges = json.loads(file.read_text())
        ranges["tensorrt"]["blob_range"]["x"] *= 1.5
        file.write_text(json.dumps(ranges))
    else:  # the first activation's scale x2 (TensorRT's cache holds float32 bits as hex)
        file = run / "deploy" / "model_calib_cache.txt"
        lines = file.read_text().splitlines()
        name, bits = lines[1].split(": ")
        scale = torch.tensor([int(bits, 16)], dtype=torch.int32).view(torch.float32) * 2
        lines[1] = f"{name}: {int(scale.view(torch.int32)) & 0xFFFFFFFF:08x}"
        file.write_text("\n".join(lines) + "\n")
    error = _refused(["verify", "--run", str(run)], capsys)
    assert f"run: deploy/{file.name} changed after the run finished" in error
    assert "write the run's artifacts again with mqbench deploy --run (it records their new checksums)" in error

    assert main(["deploy", "--run", str(run), "--quiet"]) == 0  # reads only the model's files, which are intact
    capsys.readouterr()
    assert main(["verify", "--run", str(run)]) == 0
    assert "passed" in capsys.readouterr().out
