"""Keep freed memory in the process heap, so that training steps do not fault in fresh pages.

PyTorch on the CPU allocates every activation, gradient and quantizer output with the C library's
``malloc``. glibc serves large blocks with fresh ``mmap`` pages, or hands the top of its heap back
to the system once more than a threshold of it is free; either way the next step's tensors
land on new pages, and the kernel zeroes and maps each one on first touch. For a ResNet-18
training step (batch 16, 112 px) that costs about a tenth of the step, and more for a QAT step,
which allocates more. :func:`keep_freed_memory` raises both glibc thresholds so that freed blocks
stay in the heap for reuse (as jemalloc or tcmalloc would keep them); the process's resident
memory then stays at its peak. ``mqbench ptq``, ``qat``, ``bench``, ``profile`` and
``mixed-precision`` call it at start unless ``MQBENCH_KEEP_FREED_MEMORY=0``; the speed
benchmarks call it too. A training script of one's own calls it once, before the first step.

The opposite, for a run whose memory is bounded by design (weights kept on disk and loaded a block at a time):
:func:`release_freed_memory` hands the heap's free pages back to the system at once, whatever the thresholds.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
from typing import Any

__all__ = ["keep_freed_memory", "release_freed_memory"]

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (glibc's malloc.h)


@functools.cache
def keep_freed_memory() -> bool:
    """Keep freed blocks of up to 1 GiB in the heap and never trim it (glibc); True where applied.

    False off glibc (macOS, Windows, musl), or with ``MQBENCH_KEEP_FREED_MEMORY=0``. Applies to the
    whole process and cannot be undone; applied once.
    """
    if os.environ.get("MQBENCH_KEEP_FREED_MEMORY", "1") == "0":
        return False
    mallopt = _glibc("mallopt")
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, 1 << 30)) and bool(mallopt(_M_TRIM_THRESHOLD, (1 << 31) - 1))


def release_freed_memory() -> bool:
    """Return the free pages of every heap to the system now (glibc's ``malloc_trim(0)``); True where some were.

    False off glibc. The blocks stay allocated; only pages no block uses are given back, so the resident memory
    drops to what is in use (a few milliseconds for a heap of gigabytes)."""
    trim = _glibc("malloc_trim")
    return bool(trim(0)) if trim is not None else False


@functools.cache
def _glibc(function: str) -> Any:
    """The C library's ``function``, or None where the C library is not glibc (or has no such function)."""
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name or "libc.so.6"), function)
    except (OSError, AttributeError):
        return None
