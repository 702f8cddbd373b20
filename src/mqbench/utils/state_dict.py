"""Loading helpers for quantizers whose buffers change shape once calibrated."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["resize_to_state_dict"]


def resize_to_state_dict(module: nn.Module, state_dict: dict[str, Any], prefix: str) -> None:
    """Give the module's own parameters and buffers the shapes stored in ``state_dict``.

    A freshly built per-channel quantizer holds ``[1]``-shaped placeholders; a
    calibrated one holds ``[C]``. Resizing before loading lets either state load into
    a fresh instance.
    """
    for name, tensor in list(module._parameters.items()) + list(module._buffers.items()):
        key = prefix + name
        if tensor is None or key not in state_dict:
            continue
        incoming = state_dict[key]
        if isinstance(incoming, torch.Tensor) and incoming.shape != tensor.shape:
            with torch.no_grad():
                resized = torch.empty(incoming.shape, dtype=tensor.dtype, device=tensor.device)
                if isinstance(tensor, nn.Parameter):
                    module._parameters[name] = nn.Parameter(resized, requires_grad=tensor.requires_grad)
                else:
                    module._buffers[name] = resized
