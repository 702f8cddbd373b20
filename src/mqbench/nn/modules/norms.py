"""What a normalization module computes, read from the module itself: :func:`norm_of`.

Every model family brings its own normalization class (``LlamaRMSNorm``, ``Qwen2RMSNorm``, ``Gemma3RMSNorm``
with its ``1 + weight``, ...). Algorithms that fold into a norm (the rotation) or that must see a norm as one
step (capture) ask :func:`norm_of` what a module computes instead of checking its class: ``torch.nn``'s
``LayerNorm`` and ``RMSNorm`` are read from their attributes; any other module without children whose parameters
are a weight (and a bias) of one width is run once on a probe and compared with the four functions a
normalization over the last dimension can be:

* RMS normalization times ``weight`` or times ``1 + weight`` (Gemma's offset gain);
* layer normalization (mean removed) times ``weight`` or ``1 + weight``, plus ``bias`` when it has one.

Example:
    >>> import torch
    >>> from torch import nn
    >>> class FamilyRMSNorm(nn.Module):  # a model family's own class
    ...     def __init__(self, width):
    ...         super().__init__()
    ...         self.weight = nn.Parameter(torch.zeros(width))
    ...         self.variance_epsilon = 1e-6
    ...     def forward(self, x):
    ...         y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    ...         return y * (1.0 + self.weight)
    >>> norm = norm_of(FamilyRMSNorm(8))
    >>> (norm.width, norm.centered, norm.gain.tolist()[:2], norm.eps)
    (8, False, [1.0, 1.0], 1e-06)
    >>> norm_of(nn.Linear(8, 8)) is None
    True
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = ["Norm", "norm_classes", "norm_of"]

# the attributes model families keep a norm's epsilon in
_EPS_ATTRIBUTES = ("variance_epsilon", "eps", "epsilon")
_DEFAULT_EPS = 1e-6


@dataclass(frozen=True)
class Norm:
    """A normalization over the last dimension: ``gain * (x - mean) / sqrt(var + eps) + shift`` when ``centered``
    (a LayerNorm), else ``gain * x / sqrt(mean(x^2) + eps) + shift``. ``gain`` is the effective per-channel scale
    (``1 + weight`` for Gemma's offset form), float64, None for no scale; ``shift`` likewise."""

    width: int
    centered: bool
    gain: Tensor | None
    shift: Tensor | None
    eps: float
    offset: float = 0.0  # the gain is ``offset + weight``: 1.0 for Gemma's RMSNorm

    def __call__(self, x: Tensor) -> Tensor:
        """The function, computed in ``x``'s dtype (the probe's reference)."""
        y = x - x.mean(-1, keepdim=True) if self.centered else x
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.gain is not None:
            y = y * self.gain.to(x.dtype)
        return y + self.shift.to(x.dtype) if self.shift is not None else y


def _eps(module: nn.Module) -> float:
    for name in _EPS_ATTRIBUTES:
        value = getattr(module, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
            return float(value)
    return _DEFAULT_EPS


def _from_torch(module: nn.LayerNorm | nn.RMSNorm) -> Norm | None:
    shape = tuple(module.normalized_shape)
    if len(shape) != 1:
        return None
    weight = module.weight.detach().double() if module.weight is not None else None
    bias = getattr(module, "bias", None)
    shift = bias.detach().double() if bias is not None else None
    eps = module.eps if module.eps is not None else torch.finfo(torch.float32).eps
    return Norm(shape[0], isinstance(module, nn.LayerNorm), weight, shift, float(eps))


def _probe(module: nn.Module) -> Norm | None:
    if any(True for _ in module.children()) or any(True for _ in module.buffers()):
        return None
    parameters = dict(module.named_parameters())
    weight, bias = parameters.get("weight"), parameters.get("bias")
    if weight is None or weight.dim() != 1 or set(parameters) - {"weight", "bias"}:
        return None
    if bias is not None and bias.shape != weight.shape:
        return None
    if weight.is_meta:  # a model built without its weights: a copy with values of its own says what it computes
        return _probe_without_values(module)
    width, eps = weight.numel(), _eps(module)
    generator = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 5, width, generator=generator) * 3 + 0.5).to(weight.dtype)
    try:  # a module of unknown kind: anything it raises on one tensor says it is not a norm
        with torch.no_grad():
            y = module(x)
    except Exception:
        return None
    if not isinstance(y, Tensor) or y.shape != x.shape:
        return None
    w = weight.detach().double()
    shift = bias.detach().double() if bias is not None else None
    for centered in (False, True):
        for offset in (0.0, 1.0):
            candidate = Norm(width, centered, w + offset, shift, eps, offset)
            if torch.allclose(y.double(), candidate(x.double()), rtol=1e-3, atol=1e-4):
                return candidate
    return None


def _probe_without_values(module: nn.Module) -> Norm | None:
    """:func:`_probe` of a module whose parameters are on ``meta``: a copy given values (1 + noise) is probed; the
    norm it computes is returned with the module's own (``meta``) parameters."""
    stand_in = copy.deepcopy(module).to_empty(device="cpu")
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in stand_in.parameters():
            parameter.copy_(1 + 0.1 * torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype))
    found = _probe(stand_in)
    if found is None:
        return None
    own = dict(module.named_parameters())
    weight = own["weight"].detach().double() + found.offset
    shift = own["bias"].detach().double() if "bias" in own else None
    return Norm(found.width, found.centered, weight, shift, found.eps, found.offset)


def norm_of(module: nn.Module) -> Norm | None:
    """What ``module`` computes if it is a normalization over its input's last dimension, else None."""
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
        return _from_torch(module)
    if type(module).__module__.startswith("torch.nn.modules."):
        return None  # torch's other modules are what their class says
    return _probe(module)


def norm_classes(model: nn.Module) -> tuple[type[nn.Module], ...]:
    """The classes of ``model``'s modules that :func:`norm_of` recognises and ``torch.nn`` does not define (a
    capture keeps them whole, as it keeps ``nn.LayerNorm``)."""
    verdicts: dict[type[nn.Module], bool] = {}  # one instance decides for its class: each is probed once
    for module in model.modules():
        kind = type(module)
        if kind not in verdicts and not kind.__module__.startswith("torch."):
            verdicts[kind] = norm_of(module) is not None
    return tuple(kind for kind, is_norm in verdicts.items() if is_norm)
