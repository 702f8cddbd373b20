import subprocess
import sys
from pathlib import Path

import pytest

from mqbench import __version__
from mqbench.cli import main


def test_version_and_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"mqbench {__version__}"
    assert main([]) == 0
    assert "demo" in capsys.readouterr().out


def test_console_script_is_installed():
    script = Path(sys.executable).parent / "mqbench"
    result = subprocess.run([str(script), "--help"], capture_output=True, text=True, check=True)
    assert "usage: mqbench" in result.stdout and "demo" in result.stdout


def test_demo_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--epochs", "0"])
    assert exit_info.value.code == 2
    assert "--epochs must be at least 1" in capsys.readouterr().err


@pytest.mark.slow
def test_demo_deploys_and_verifies_every_backend():
    from mqbench.backends import ParamsTable
    from mqbench.demo import run_demo

    printed: list[str] = []
    rows = {row.name: row for row in run_demo(epochs=15, qat_epochs=4, log=printed.append)}
    assert printed[0].startswith("host: ")  # the host facts come first
    assert "deployed" in printed[-1] and "academic W4A4 (QAT)" in printed[-1]
    assert rows["float"].accuracy > 0.93
    for backend, spec in ParamsTable.items():
        row = rows[f"{backend} (PTQ)"]
        # 8-bit post-training quantization of a small CNN loses at most a couple of test images in a hundred
        assert abs(row.accuracy - rows["float"].accuracy) <= 0.02, backend
        # The deployed model computes what the simulation computes: the same answers on all but a few
        # of the 450 test images (a logit tie flipped by a 1-LSB rounding difference).
        assert abs(row.deployed_accuracy - row.accuracy) <= 3 / 450, backend
        assert row.max_lsb is not None and row.max_lsb <= spec.lsb_tolerance, backend
        # the Q/DQ model and every other artifact (the LLM runtimes' checkpoints are for Hugging Face models only)
        written = [key for key in spec.deploy if key not in ("compressed_tensors", "gguf", "genai")]
        assert row.verified >= 1 + len(written), backend
        assert row.passed, (backend, row.failures)  # both verdicts, as `mqbench verify` decides them
    qat = rows["academic W4A4 (QAT)"]
    assert qat.accuracy > 0.9
    assert abs(qat.deployed_accuracy - qat.accuracy) <= 3 / 450


def test_verify_command_checks_artifacts_and_rejects_bad_arguments(capsys, tmp_path):
    assert main(["verify", "--backend", "snpe", "--output-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "== snpe: ok" in out and "encodings" in out and "onnxruntime (rebuilt)" in out
    assert (tmp_path / "snpe" / "digits_clip_ranges.json").is_file()
    with pytest.raises(SystemExit) as exit_info:
        main(["verify", "--backend", "nonexistent"])
    assert exit_info.value.code == 2
    assert "unknown backend" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["verify", "--backend", "snpe", "--state-dict", str(tmp_path / "missing.pt")])
    assert "is not a file" in capsys.readouterr().err


def test_verify_command_host_verdict_exit_status_and_remedy(capsys, monkeypatch, tmp_path):
    """OpenVINO serves its artifact: on a host whose int8 kernels saturate the verdict may fail (exit 1, with
    cause and remedy); the remedy passes everywhere. Temporary folders are removed."""
    import tempfile

    from mqbench.utils.host import int8_pairs_saturate

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    status = main(["verify", "--backend", "openvino"])
    out = capsys.readouterr().out
    assert out.startswith("host: ")
    assert status in (0, 1)
    if status == 1:
        assert int8_pairs_saturate()
        assert "FAILED openvino_onnx: OpenVINO CPU on this host" in out and "16-bit" in out and "reduce_range" in out
    assert main(["verify", "--backend", "openvino", "--reduce-range"]) == 0
    assert "== openvino: ok" in capsys.readouterr().out
    # no folder of mqbench's left behind (torch's own compile cache may appear there when torch.optim first loads)
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith("torchinductor")] == []


def test_verify_command_loads_a_prepared_models_state_dict(capsys, tmp_path):
    import torch

    from mqbench.models import DigitsCNN
    from mqbench.prepare_by_platform import prepare_by_platform
    from mqbench.utils.state import enable_calibration, enable_quantization

    qmodel = prepare_by_platform(DigitsCNN().eval(), "tengine_u8")
    enable_calibration(qmodel)
    qmodel(torch.randn(8, 1, 8, 8))
    enable_quantization(qmodel)
    path = tmp_path / "qmodel.pt"
    torch.save(qmodel.state_dict(), path)
    assert main(["verify", "--backend", "tengine_u8", "--state-dict", str(path), "--tensors"]) == 0
    out = capsys.readouterr().out
    assert "tengine_scale" in out and "x_post_act_fake_quantizer" not in out  # rows name tensors
