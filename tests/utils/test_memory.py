"""keep_freed_memory: applied in a fresh process on glibc, refused with the opt-out, called by the commands;
release_freed_memory gives the kept pages back."""

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


RELEASE = """
import torch
from mqbench.utils.memory import keep_freed_memory, release_freed_memory
def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20
keep_freed_memory()  # freed blocks stay in the heap
blocks = [torch.ones(2**18) for _ in range(512)]  # 512 MiB in blocks of 1 MiB
held = resident()
del blocks[::2]  # every other block freed: 256 MiB of holes between blocks in use
kept = resident()
released = release_freed_memory()
print(held, kept, resident(), released)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc" or not os.path.exists("/proc/self/statm"), reason="glibc's")
def test_freed_memory_kept_in_the_heap_is_given_back_when_released():
    env = {k: v for k, v in os.environ.items() if k != "MQBENCH_KEEP_FREED_MEMORY"}
    done = subprocess.run([sys.executable, "-c", RELEASE], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    held, kept, after, released = done.stdout.split()
    assert float(kept) > float(held) - 32  # freed, but kept resident by the heap
    assert released == "True" and float(after) < float(kept) - 200  # the 256 MiB of holes given back
