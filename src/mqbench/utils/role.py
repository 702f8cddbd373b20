"""What a quantizer of a prepared model quantizes: its role, written by prepare, read by what comes after.

Prepare gives every quantizer it creates a :class:`QuantizerRole`: a weight quantizer names the layer whose
weight it quantizes, an activation quantizer the graph values it quantizes (more than one where the backend
requires them to share it). Freezing, stripping, the reports and QAT read the role instead of working it out
from the quantizer's module name. A quantizer prepare did not create (a QAT module built by hand) has no role
written; :func:`role_of` then reads the one fact its place gives: a quantizer held as a layer's
``weight_fake_quant`` quantizes that layer's weight.

Example:
    >>> import torch
    >>> from mqbench.prepare_by_platform import prepare_by_platform
    >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Flatten()).eval()
    >>> qmodel = prepare_by_platform(model, "tensorrt")
    >>> role_of("0.weight_fake_quant", qmodel.get_submodule("0.weight_fake_quant"))
    QuantizerRole(kind='weight', layer='0', values=())
    >>> role_of("input_1_post_act_fake_quantizer", qmodel.get_submodule("input_1_post_act_fake_quantizer")).subject
    'input_1'
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torch import nn

__all__ = ["ROLE_ATTRIBUTE", "QuantizerRole", "role_of", "set_role"]

ROLE_ATTRIBUTE = "mqbench_role"  # the attribute of a quantizer module holding its role


@dataclass(frozen=True)
class QuantizerRole:
    """A weight quantizer's layer, or the values an activation quantizer quantizes."""

    kind: Literal["weight", "activation"]
    layer: str = ""  # weight: the module path of the layer (or "" for the model itself)
    values: tuple[str, ...] = ()  # activation: the graph values, in graph order

    @property
    def subject(self) -> str:
        """What a reader calls the quantized tensor: ``<layer>.weight``, or the (first) value's name."""
        if self.kind == "weight":
            return f"{self.layer}.weight" if self.layer else "weight"
        return self.values[0] if self.values else "tensor"


def set_role(quantizer: nn.Module, role: QuantizerRole) -> None:
    """Write ``role`` on ``quantizer`` (kept by ``copy.deepcopy``; not part of the state dict)."""
    setattr(quantizer, ROLE_ATTRIBUTE, role)


def role_of(name: str, quantizer: nn.Module) -> QuantizerRole:
    """The role prepare wrote on ``quantizer`` (at module path ``name``); for one prepare did not create, a
    quantizer held as ``<layer>.weight_fake_quant`` quantizes that layer's weight, any other an activation."""
    role = getattr(quantizer, ROLE_ATTRIBUTE, None)
    if isinstance(role, QuantizerRole):
        return role
    layer, _, attribute = name.rpartition(".")
    if attribute == "weight_fake_quant":
        return QuantizerRole("weight", layer=layer)
    return QuantizerRole("activation", values=(name,))
