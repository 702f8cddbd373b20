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
def test_demo_quantizes_for_every_backend(capsys):
    from mqbench.backends import ParamsTable

    assert main(["demo", "--epochs", "15", "--qat-epochs", "4"]) == 0
    table = capsys.readouterr().out
    accuracy = {}
    for line in table.splitlines():
        name = line[:24].strip()
        if "%" in line:
            accuracy[name] = float(line.split("%")[0].split()[-1]) / 100
    assert accuracy["float"] > 0.93
    for backend in ParamsTable:
        # 8-bit post-training quantization of a small CNN loses at most a couple of test images in a hundred
        assert abs(accuracy[f"{backend} (PTQ)"] - accuracy["float"]) <= 0.02, backend
    assert accuracy["academic W4A4 (QAT)"] > 0.9


def test_backends_command_lists_every_backend(capsys):
    from mqbench.backends import ParamsTable

    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    for name, spec in ParamsTable.items():
        assert f"{name}: {spec.description}" in out
    assert "inputs of add, concat, conv" in out and "[-127, 127]" in out
