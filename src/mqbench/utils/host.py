"""What decides int8 behaviour and speed on this host: instruction sets and runtime versions.

x86 int8 kernels without VNNI (AVX2, or AVX-512 without its VNNI extension) multiply unsigned 8-bit
activations by signed 8-bit weights with ``vpmaddubsw``, which sums two adjacent products into a
*saturating* 16-bit value; hosts with AVX-512 VNNI, AVX-VNNI or AMX accumulate in 32 bits. So the same
deployment can compute different integers on two CPUs. :func:`host_facts` reports the facts
(``int8_pairs_saturate`` says whether this host's kernels are of the saturating kind);
``mqbench verify``, the demo, every benchmark JSON and every verify report carry them.

Example:
    >>> facts = host_facts()
    >>> sorted(k for k in facts if k in ("machine", "int8_pairs_saturate", "vnni"))
    ['int8_pairs_saturate', 'machine', 'vnni']
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import platform
from pathlib import Path
from typing import Any

__all__ = ["describe_host", "host_facts", "int8_pairs_saturate"]

# CPU flags (as /proc/cpuinfo spells them) that matter for int8 kernels.
_X86_FLAGS = ("sse4_1", "avx2", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_int8", "amx_bf16")
_X86_VNNI = ("avx512_vnni", "avx_vnni", "amx_int8")
_ARM_FLAGS = ("asimd", "asimddp", "i8mm", "sve", "sve2")  # asimddp: the sdot/udot instructions
_RUNTIMES = ("torch", "onnxruntime", "openvino", "onnx", "numpy")


def _cpuinfo() -> tuple[str, set[str]]:
    """(processor name, flags) from /proc/cpuinfo; empty where there is none (macOS, Windows)."""
    path = Path("/proc/cpuinfo")
    name, flags = "", set[str]()
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return platform.processor(), flags
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("model name", "hardware", "cpu model") and not name:
            name = value.strip()
        elif key in ("flags", "features") and not flags:
            flags = set(value.split())
    return name or platform.processor(), flags


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.cache
def _facts() -> tuple[tuple[str, Any], ...]:
    machine = platform.machine().lower()
    processor, flags = _cpuinfo()
    x86 = machine in ("x86_64", "amd64", "i386", "i686")
    arm = machine in ("aarch64", "arm64") or machine.startswith("arm")
    known = _X86_FLAGS if x86 else _ARM_FLAGS if arm else ()
    isa = sorted(flag for flag in known if flag in flags)
    vnni = any(flag in flags for flag in _X86_VNNI) if x86 else False
    facts: dict[str, Any] = {
        "machine": machine,
        "processor": processor,
        "cpu_count": os.cpu_count(),
        "isa": isa,
        "vnni": vnni,
        # x86 without VNNI: u8 x s8 pair sums saturate at int16 in onnxruntime's and OpenVINO's kernels.
        # Arm's int8 kernels widen (smull/sdot) and do not saturate; unknown architectures are not assumed to.
        "int8_pairs_saturate": bool(x86 and "avx2" in flags and not vnni),
        "python": platform.python_version(),
        "runtimes": {name: _version(name) for name in _RUNTIMES},
    }
    return tuple(facts.items())


def host_facts() -> dict[str, Any]:
    """A fresh dict of this host's facts: machine, processor, ``isa`` flags, ``vnni``, runtimes' versions.

    ``int8_pairs_saturate`` is True on x86 CPUs whose int8 kernels sum two u8 x s8 products in a
    saturating 16-bit register (AVX2 without VNNI), where onnxruntime and OpenVINO can compute a
    deployment differently from the simulation unless its weights fit 7 bits.
    """
    facts = dict(_facts())
    facts["isa"] = list(facts["isa"])
    facts["runtimes"] = dict(facts["runtimes"])
    return facts


def int8_pairs_saturate(facts: dict[str, Any] | None = None) -> bool:
    """Whether this host's (or ``facts``') int8 CPU kernels saturate 16-bit pair sums."""
    return bool((facts or host_facts())["int8_pairs_saturate"])


def describe_host(facts: dict[str, Any] | None = None) -> str:
    """One line for reports: processor, int8-relevant flags, runtime versions."""
    facts = facts or host_facts()
    runtimes = ", ".join(f"{name} {version}" for name, version in facts["runtimes"].items() if version)
    kind = (
        "int8 pair sums saturate (no VNNI)"
        if facts["int8_pairs_saturate"]
        else ("VNNI int8" if facts["vnni"] else "int8 without pair saturation")
    )
    flags = " ".join(facts["isa"]) or "-"
    return f"host: {facts['processor'] or facts['machine']} [{flags}]: {kind}; {runtimes}"
