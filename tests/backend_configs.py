"""Quantizer settings the tests give the Academic backends (which have no defaults of their own)."""

from __future__ import annotations

from mqbench.app.check import reduce_range_config
from mqbench.backends import resolve_backend
from mqbench.utils.host import int8_pairs_saturate


def academic_config(bits: int = 8) -> dict:
    """LSQ quantizers calibrated by MinMax / EMA-MinMax: symmetric per-channel weights, asymmetric activations."""
    return {
        "extra_qconfig_dict": {
            "w_observer": "MinMaxObserver",
            "a_observer": "EMAMinMaxObserver",
            "w_fakequantize": "LearnableFakeQuantize",
            "a_fakequantize": "LearnableFakeQuantize",
            "w_qscheme": {"bit": bits, "symmetry": True, "per_channel": True, "pot_scale": False},
            "a_qscheme": {"bit": bits, "symmetry": False, "per_channel": False, "pot_scale": False},
        }
    }


ACADEMIC_8BIT = academic_config(8)


def config_for(backend: str) -> dict | None:
    """The prepare_custom_config_dict a backend needs in the tests: the 8-bit settings for the academic ones."""
    return ACADEMIC_8BIT if backend.startswith("academic") else None


def host_config(backend: str) -> dict | None:
    """``config_for(backend)``; on a host whose int8 kernels saturate 16-bit pair sums (x86 without VNNI), a
    backend a CPU runtime serves also gets the documented remedy (7-bit weights), so that what the host's
    runtime serves is the artifact's arithmetic and a test of the host verdict tests the deployment."""
    spec = resolve_backend(backend)
    if spec.served_on_cpu and int8_pairs_saturate():
        return reduce_range_config(spec, config_for(backend))
    return config_for(backend)
