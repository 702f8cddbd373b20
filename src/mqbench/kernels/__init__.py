"""Optional fused CPU kernels, compiled on first use and cached per Python environment.

The kernels compute exactly what :mod:`mqbench.functional`'s PyTorch code
computes (same division, same round-half-to-even) in one pass over the data.
They are used for float32 CPU tensors when a C++ compiler is available (built once per
Python environment under ``~/.cache/mqbench/kernels``, or ``MQBENCH_KERNEL_CACHE``); set
``MQBENCH_KERNELS=0`` to use the PyTorch code only. If the build fails, mqbench
warns once and falls back.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import sys
import time
import warnings
from pathlib import Path
from types import ModuleType

import torch

__all__ = ["clear_stale_lock", "load", "module", "usable"]

_SOURCE = Path(__file__).with_name("fake_quant.cpp")


@functools.cache
def load() -> ModuleType | None:
    """The compiled extension, or None where it is disabled or cannot be built."""
    if os.environ.get("MQBENCH_KERNELS", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load as build

        directory = _build_directory()
        directory.mkdir(parents=True, exist_ok=True)
        clear_stale_lock(directory)
        return build(
            name="mqbench_fake_quant",
            sources=[str(_SOURCE)],
            build_directory=str(directory),
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as error:  # a missing compiler or headers must not stop quantization
        warnings.warn(
            f"mqbench: fused CPU kernels unavailable ({type(error).__name__}: {error}); using PyTorch ops, "
            "which are slower but give identical results",
            RuntimeWarning,
            stacklevel=2,
        )
        return None


STALE_LOCK_SECONDS = 600  # a build takes about a minute; a lock this old was left by a process that died


def clear_stale_lock(directory: Path, stale_after: float = STALE_LOCK_SECONDS) -> bool:
    """Remove the build lock a process left when it was killed while building (True if so, with a warning).

    PyTorch's extension builder waits for the lock's owner to finish, without a limit: a lock nobody holds any
    more (older than ``stale_after`` seconds) would make every later first use of the kernels wait forever. A
    younger one is another process building now, and is waited for.
    """
    lock = directory / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age < stale_after:
        return False
    lock.unlink(missing_ok=True)
    warnings.warn(
        f"mqbench: removed the kernel build lock {lock}, left {age / 60:.0f} minutes ago by a build that did not "
        "finish (a killed process); building again",
        RuntimeWarning,
        stacklevel=3,
    )
    return True


def _build_directory() -> Path:
    """One build per Python environment and PyTorch version (they compile against its headers)."""
    root = Path(os.environ.get("MQBENCH_KERNEL_CACHE", Path.home() / ".cache" / "mqbench" / "kernels"))
    key = hashlib.sha256(f"{sys.prefix}|{torch.__version__}|{platform.machine()}".encode()).hexdigest()[:16]
    return root / key


def module() -> ModuleType:
    """The compiled extension; call only after :func:`usable` said yes."""
    extension = load()
    if extension is None:
        raise RuntimeError("mqbench's fused kernels are not available; check usable() first")
    return extension


def usable(*tensors: torch.Tensor) -> bool:
    """Whether the fused kernels apply to these tensors (float32 on the CPU, kernels built)."""
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors) and load() is not None
