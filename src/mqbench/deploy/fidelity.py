"""How far a quantization simulation is from the float model, and which quantizers make it so.

Verification proves that the deployed files compute what the simulation computes; it says
nothing of whether the simulation is close to the float model. :func:`simulation_fidelity`
measures that on the same inputs, with two forward passes:

* each output of the prepared model against the float model's (the same model with every
  quantizer off): SQNR ``10 log10(sum f^2 / sum (f - q)^2)`` in dB and cosine similarity;
* each enabled quantizer's own error where it operates: its output against its input in the
  quantized forward (the noise that quantizer adds, weights and activations alike).

The simulation is *far* from float when an output's SQNR is below ``threshold_db`` (default
20 dB: an error whose power is 1% of the output's). :meth:`Fidelity.warning` then names the
quantizers adding the most error and what usually helps.

The float model is the prepared model with its quantizers off: where an algorithm rounded the
weights in place (GPTQ records them in ``model.meta["rounded_weights"]``), that rounding is on
both sides, and :attr:`Fidelity.reference_note` says so.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from mqbench.prepare_by_platform import prepare_by_platform
    >>> from mqbench.utils.state import enable_calibration, enable_quantization
    >>> from mqbench.deploy.fidelity import simulation_fidelity
    >>> torch.manual_seed(0) and None
    >>> qmodel = prepare_by_platform(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)).eval(), "tensorrt")
    >>> x = torch.randn(64, 8)
    >>> enable_calibration(qmodel); _ = qmodel(x); enable_quantization(qmodel)
    >>> fidelity = simulation_fidelity(qmodel, lambda m: m(x))
    >>> fidelity.far, fidelity.outputs[0].sqnr_db > 30
    (False, True)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn

from mqbench.fake_quantize.quantize_base import QuantizeBase
from mqbench.utils.role import role_of
from mqbench.utils.state import all_switched_off

__all__ = ["FAR_SQNR_DB", "Fidelity", "TensorFidelity", "simulation_fidelity"]

FAR_SQNR_DB = 20.0


@dataclass(frozen=True)
class TensorFidelity:
    """One tensor's quantized value against its float value: ``kind`` is output, weight or activation."""

    name: str
    kind: str
    sqnr_db: float
    cosine: float

    def to_dict(self) -> dict[str, Any]:
        """Plain values for JSON: an exact tensor's SQNR (infinite) is None."""
        sqnr = self.sqnr_db if math.isfinite(self.sqnr_db) else None
        return {"name": self.name, "kind": self.kind, "sqnr_db": sqnr, "cosine": self.cosine}


@dataclass
class Fidelity:
    """The simulation against the float model: per output, and per quantizer (worst first)."""

    outputs: list[TensorFidelity]
    quantizers: list[TensorFidelity] = field(default_factory=list)
    threshold_db: float = FAR_SQNR_DB
    # what the float reference is, where it is not the model as given (e.g. weights an algorithm rounded in place)
    reference_note: str | None = None

    @property
    def far(self) -> bool:
        """Whether an output's SQNR is below ``threshold_db``."""
        return any(o.sqnr_db < self.threshold_db for o in self.outputs)

    def worst(self, count: int = 3) -> list[TensorFidelity]:
        return self.quantizers[:count]

    def summary(self) -> str:
        shown = ", ".join(f"{o.name} {_db(o.sqnr_db)} (cosine {o.cosine:.4f})" for o in self.outputs[:4])
        lines = [f"simulation vs float model: {shown or 'no float outputs'}"]
        if self.reference_note:
            lines.append(f"  ({self.reference_note})")
        if self.far:
            lines.append(f"WARNING: {self.warning()}")
        return "\n".join(lines)

    def warning(self) -> str | None:
        """None when the simulation is close to float; else what is far, the worst quantizers and the remedies."""
        if not self.far:
            return None
        far = [o for o in self.outputs if o.sqnr_db < self.threshold_db]
        outputs = ", ".join(f"{o.name} SQNR {_db(o.sqnr_db)} (cosine {o.cosine:.3f})" for o in far[:4])
        worst = "; ".join(f"{q.name} ({q.kind}, {_db(q.sqnr_db)})" for q in self.worst())
        remedies = [
            "calibrate with the backend's recipe (mqbench.advanced_ptq.calibrate applies its ptq_recipe: "
            "percentile activations, equalization and bias correction where the backend's grids need them)",
            "per-tensor weights (depthwise layers above all): cross-layer equalization "
            "(mqbench.advanced_ptq.cross_layer_equalization) or a per-channel weight scheme",
            "activations: another observer (extra_qconfig_dict a_observer: MSEObserver or PercentileObserver) or "
            "more calibration data",
            "keep the worst layers in float (extra_quantizer_dict exclude_node_name), or reconstruct "
            "(mqbench.advanced_ptq.ptq_reconstruction)",
        ]
        return (
            f"the quantized simulation is far from the float model: {outputs}, below {self.threshold_db:g} dB. "
            f"The quantizers adding the most error: {worst or 'none enabled'}. What usually helps: "
            + "; ".join(remedies)
            + ". A passing verification means the deployed files compute this simulation, not the float model."
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "outputs": [o.to_dict() for o in self.outputs],
            "worst_quantizers": [q.to_dict() for q in self.worst(5)],
            "threshold_db": self.threshold_db,
            "far": self.far,
            "warning": self.warning(),
            "reference_note": self.reference_note,
        }


def _db(value: float) -> str:
    return "inf dB" if math.isinf(value) else f"{value:.1f} dB"


class _Sums:
    def __init__(self) -> None:
        self.signal = 0.0
        self.noise = 0.0
        self.dot = 0.0
        self.quantized = 0.0

    def add(self, reference: Tensor, value: Tensor) -> None:
        f, q = reference.detach().double().flatten(), value.detach().double().flatten()
        self.signal += float(f @ f)
        self.noise += float((f - q) @ (f - q))
        self.dot += float(f @ q)
        self.quantized += float(q @ q)

    def fidelity(self, name: str, kind: str) -> TensorFidelity:
        if self.noise == 0.0:
            sqnr = math.inf
        elif self.signal == 0.0:
            sqnr = -math.inf
        else:
            sqnr = 10 * math.log10(self.signal / self.noise)
        norms = math.sqrt(self.signal * self.quantized)
        cosine = self.dot / norms if norms > 0 else (1.0 if self.noise == 0.0 else 0.0)
        return TensorFidelity(name, kind, sqnr, cosine)


def _float_leaves(value: Any) -> list[Tensor]:
    return [t for t in pytree.tree_leaves(value) if isinstance(t, Tensor) and t.is_floating_point()]


@torch.no_grad()
def simulation_fidelity(
    qmodel: nn.Module, call: Callable[[nn.Module], Any], threshold_db: float = FAR_SQNR_DB
) -> Fidelity:
    """The simulation of ``qmodel`` against its float model on the inputs ``call(model)`` runs it with.

    ``qmodel`` is prepared and calibrated (observers are not run: the quantizers' switches are
    put back as they were). Outputs are compared in the order of their tensors (``output_0``, ...).
    """
    sums: dict[str, _Sums] = {}
    kinds: dict[str, str] = {}
    handles = []
    for name, module in qmodel.named_modules():
        if not isinstance(module, QuantizeBase):
            continue
        kinds[name] = role_of(name, module).kind

        def hook(mod: QuantizeBase, args: Any, output: Any, name: str = name) -> None:
            source = args[0] if args else None
            if (
                isinstance(source, Tensor)
                and isinstance(output, Tensor)
                and source.is_floating_point()
                and source.shape == output.shape
                and mod._switch("fake_quant")
            ):
                sums.setdefault(name, _Sums()).add(source, output)

        handles.append(module.register_forward_hook(hook))
    saved = {n: bool(m.observer_enabled[0]) for n, m in qmodel.named_modules() if isinstance(m, QuantizeBase)}
    try:
        for module in qmodel.modules():
            if isinstance(module, QuantizeBase):
                module.enable_observer(False)
        quantized = _float_leaves(call(qmodel))
    finally:
        for handle in handles:
            handle.remove()
        for name, module in qmodel.named_modules():
            if isinstance(module, QuantizeBase) and name in saved:
                module.enable_observer(saved[name])
    with all_switched_off(qmodel):
        reference = _float_leaves(call(qmodel))
    outputs = []
    for index, (f, q) in enumerate(zip(reference, quantized, strict=False)):
        one = _Sums()
        one.add(f, q)
        outputs.append(one.fidelity(f"output_{index}", "output"))
    per_quantizer = sorted((s.fidelity(n, kinds[n]) for n, s in sums.items()), key=lambda t: t.sqnr_db)
    return Fidelity(outputs, per_quantizer, threshold_db, _reference_note(qmodel))


def _reference_note(qmodel: nn.Module) -> str | None:
    """What the float reference holds where an algorithm rewrote weights in place (``meta["rounded_weights"]``)."""
    rounded = getattr(qmodel, "meta", {}).get("rounded_weights")
    if not rounded:
        return None
    return (
        f"the float model holds the weights {rounded['by']} rounded in place ({len(rounded['layers'])} layer(s)): "
        "their rounding is in both sides of this comparison, not in the figure; the algorithm's report in "
        f"model.meta[{rounded['by']!r}] has each layer's output error"
    )
