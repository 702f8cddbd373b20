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
def test_demo_trains_and_quantizes(capsys):
    assert main(["demo"]) == 0
    table = capsys.readouterr().out
    accuracy = {}
    for line in table.splitlines():
        for name in ("float", "W8A8 fixed (PTQ)", "W4A4 LSQ (PTQ init)", "W4A4 LSQ (QAT)"):
            if line.startswith(name + " "):
                accuracy[name] = float(line.split("%")[0].split()[-1]) / 100
    assert set(accuracy) == {"float", "W8A8 fixed (PTQ)", "W4A4 LSQ (PTQ init)", "W4A4 LSQ (QAT)"}
    assert accuracy["float"] > 0.93
    assert abs(accuracy["W8A8 fixed (PTQ)"] - accuracy["float"]) <= 0.02  # 8 bits: no measurable loss
    assert accuracy["W4A4 LSQ (QAT)"] > 0.9  # QAT recovers most of the 4-bit loss
    assert accuracy["W4A4 LSQ (QAT)"] >= accuracy["W4A4 LSQ (PTQ init)"] - 0.01
