"""keep_freed_memory: applied in a fresh process on glibc, refused with the opt-out, called by the commands."""

import os
import platform
import subprocess
import sys

import pytest

from mqbench import cli
from mqbench.utils import memory

PROBE = "from mqbench.utils.memory import keep_freed_memory; print(keep_freed_memory())"


def probe(**environment: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "MQBENCH_KEEP_FREED_MEMORY"} | environment
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt's thresholds are glibc's")
def test_applied_on_glibc():
    assert probe() == "True"


def test_opt_out():
    assert probe(MQBENCH_KEEP_FREED_MEMORY="0") == "False"


def test_commands_apply_it_first(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(memory, "keep_freed_memory", lambda: calls.append(1) or True)
    with pytest.raises(SystemExit):  # a missing config file is a usage error, after the setting
        cli.main(["ptq", "--config", str(tmp_path / "missing.yaml"), "--output", str(tmp_path / "run")])
    assert calls == [1]
