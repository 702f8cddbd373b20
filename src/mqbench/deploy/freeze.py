"""The deployed form of a quantized model: BatchNorm merged, every quantizer frozen to fixed qparams.

``freeze_quantizers`` replaces each enabled fake quantizer with a :class:`FrozenQuantizer`
holding the fixed scale and integer zero point it is equivalent to (or, for the logarithmic
NNIE grid, its ``data_max``), and replaces every linear-grid weight by its quantized value
``(q - zero_point) * scale`` (after a quantizer's weight transform, e.g. DoReFa's normalisation),
so that the backend re-quantizing that weight gets the same integers by any formula, ties included.
"""

from __future__ import annotations

import copy
import typing
import warnings
from collections.abc import Callable

import torch
from torch import Tensor, fx, nn

from mqbench.custom_quantizer.passes import set_submodule
from mqbench.fake_quantize.quantize_base import QuantizeBase, _exporting
from mqbench.functional import fake_quantize, fake_quantize_for_export, from_groups, to_groups
from mqbench.grids import grid_of
from mqbench.nn.intrinsic.qat.modules.bn_folding import BnFoldingModule
from mqbench.qparams import TensorQParams, float32_refusal
from mqbench.utils.role import role_of, set_role
from mqbench.utils.state import UncalibratedError, calibrate_weights, quantizers
from mqbench.utils.tied import shared_weights

__all__ = [
    "FrozenQuantizer",
    "UncalibratedError",
    "freeze_quantizers",
    "merge_bn",
    "merge_bn_in_place",
    "uncalibrated_quantizers",
]

Tap = Callable[["FrozenQuantizer", Tensor, Tensor], None]


class FrozenQuantizer(nn.Module):
    """A fake quantizer reduced to constants: ``scale``/``zero_point`` (linear) or ``data_max`` (log grid).

    Eager forward is the simulation's arithmetic; under ONNX export it is the standard
    QuantizeLinear/DequantizeLinear form. ``tap`` (set while exporting for deployment)
    sees every call's input and output.
    """

    scale: Tensor
    zero_point: Tensor

    def __init__(
        self,
        name: str,
        scale: Tensor,
        zero_point: Tensor,
        quant_min: int,
        quant_max: int,
        axis: int | None,
        kind: str,
        data_max: Tensor | None = None,
        grid: str = "linear",
        group_size: int | None = None,
    ) -> None:
        super().__init__()
        self.name = name
        self.group_size = group_size  # quantized as rows of this many input channels (mqbench.functional.to_groups)
        self.register_buffer("scale", scale.detach().float().reshape(-1).clone())
        self.register_buffer("zero_point", torch.round(zero_point.detach().float()).to(torch.int32).reshape(-1))
        self.quant_min, self.quant_max, self.axis, self.kind = quant_min, quant_max, axis, kind
        self.data_max = None if data_max is None else float(data_max.reshape(-1)[0])
        self.grid = grid
        self._entry: TensorQParams | None = None
        if grid != "linear":  # computed from its table entry, by its grid (mqbench.grids)
            self._entry = TensorQParams(
                self.scale.numpy(), self.zero_point.numpy(), quant_min, quant_max, axis, kind, None, grid, self.data_max
            )
        self.tap: Tap | None = None

    def forward(self, x: Tensor) -> Tensor:
        if self.group_size is not None:
            y = from_groups(self._quantize(to_groups(x, self.group_size)), x.shape, self.group_size)
        else:
            y = self._quantize(x)
        if self.tap is not None:
            self.tap(self, x, y)
        return y

    def _quantize(self, x: Tensor) -> Tensor:
        if self._entry is not None:
            y = grid_of(self.grid).simulate(self._entry, x)
        elif _exporting():
            y = fake_quantize_for_export(x, self.scale, self.zero_point, self.quant_min, self.quant_max, self.axis)
        else:
            y = fake_quantize(x, self.scale, self.zero_point, self.quant_min, self.quant_max, self.axis)
        return y

    def extra_repr(self) -> str:
        if self.grid != "linear":
            return f"{self.name}: {self.grid} grid, data_max={self.data_max}"
        groups = f", groups of {self.group_size}" if self.group_size is not None else ""
        return f"{self.name}: [{self.quant_min}, {self.quant_max}], axis={self.axis}{groups}, {self.kind}"


def uncalibrated_quantizers(model: nn.Module) -> list[str]:
    """Enabled quantizers whose observer never saw a tensor (their qparams are the initial ones)."""
    missing = []
    for name, found in quantizers(model):
        quantizer = typing.cast(QuantizeBase, found)
        if quantizer._switch("fake_quant") and not quantizer.activation_post_process.calibrated:
            missing.append(name)
    return missing


def merge_bn_in_place(model: nn.Module) -> nn.Module:
    """``model`` itself, in eval mode, with every BN-folding QAT module merged into its conv/linear."""
    model.eval()
    for name, module in list(model.named_modules()):
        if isinstance(module, BnFoldingModule):
            set_submodule(model, name, module.merge_bn().eval())
    if isinstance(model, fx.GraphModule):
        model.recompile()
    return model


def merge_bn(model: nn.Module) -> nn.Module:
    """A copy of ``model`` in eval mode with every BN-folding QAT module merged into its conv/linear."""
    return merge_bn_in_place(copy.deepcopy(model))


def _freeze(name: str, quantizer: QuantizeBase, kind: str) -> FrozenQuantizer:
    grid = grid_of(quantizer.deploy_grid)
    params = grid.qparams_of(quantizer)
    return FrozenQuantizer(
        name,
        params["scale"],
        params["zero_point"],
        quantizer.quant_min,
        quantizer.quant_max,
        quantizer.axis,
        kind,
        params.get("data_max"),
        grid.name,
        quantizer.group_size,
    )


def _checked_freeze(name: str, quantizer: QuantizeBase, kind: str) -> FrozenQuantizer:
    """:func:`_freeze`, refusing (naming the quantizer) parameters that no deployed file can hold in float32."""
    subject = f"quantizer {name!r} ({kind} of {'layer' if kind == 'weight' else 'tensor'} {_quantized(name)!r})"
    for what in ("data_max", "scale"):  # a statistic that overflowed float32 (or saw inf) before it is frozen
        value = getattr(quantizer, what, None)
        values = torch.as_tensor(value if value is not None else 1.0).detach().to(torch.float64).reshape(-1)
        if not bool(torch.isfinite(values).all()):
            shown = values[~torch.isfinite(values)][0].item()
            raise ValueError(
                float32_refusal(
                    subject,
                    f"its {what} is {shown} (beyond float32, largest {torch.finfo(torch.float32).max:.6g}, or from "
                    "non-finite values in calibration)",
                )
            )
    frozen = _freeze(name, quantizer, kind)
    try:
        entry = TensorQParams(
            frozen.scale.numpy(),
            frozen.zero_point.numpy(),
            frozen.quant_min,
            frozen.quant_max,
            frozen.axis,
            kind,
            grid=frozen.grid,
            data_max=frozen.data_max,
        )
    except ValueError:  # not a table entry's form (say, a zero scale): the table's own checks say why, later
        return frozen
    why = entry.float32_overflow()
    if why is not None:
        raise ValueError(float32_refusal(subject, why))
    return frozen


def _quantized(name: str) -> str:
    """What a quantizer's name says it quantizes: ``conv1.weight_fake_quant`` -> ``conv1``,
    ``add_post_act_fake_quantizer`` -> ``add``."""
    for suffix in (".weight_fake_quant", "_post_act_fake_quantizer"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def freeze_quantizers(model: nn.Module) -> nn.Module:
    """Replace every enabled quantizer of ``model`` (in place) with its :class:`FrozenQuantizer`.

    Disabled quantizers become identities (nn.Identity). Weights read by a weight quantizer
    are transformed (:meth:`QuantizeBase.deploy_weight`) and replaced by their quantized values.
    A weight quantizer that never observed calibrates on its own weight first (weights need no data).
    Raises :class:`UncalibratedError` naming every other enabled quantizer that never saw data, and
    ValueError for a quantizer whose qparams depend on each input (no fixed deployed form).
    """
    calibrate_weights(model)  # weights need no data: a weight quantizer that never observed reads its weight now
    missing = uncalibrated_quantizers(model)
    if missing:
        shown = ", ".join(missing[:10]) + (f" and {len(missing) - 10} more" if len(missing) > 10 else "")
        raise UncalibratedError(
            f"{len(missing)} quantizer(s) were never calibrated: {shown}. Run the model on calibration data "
            "under mqbench.utils.state.enable_calibration(model) (or load a calibrated state dict) before deploying."
        )
    degenerate: list[str] = []
    shared = shared_weights(model)
    for name, found in list(quantizers(model)):
        quantizer = typing.cast(QuantizeBase, found)
        if not quantizer._switch("fake_quant"):
            set_submodule(model, name, nn.Identity())
            continue
        role = role_of(name, quantizer)
        # the layer holding it (found from where it sits, so that a wrapper's prefix does not matter)
        owner = model.get_submodule(name.rpartition(".")[0]) if role.kind == "weight" else None
        kind = role.kind
        if kind == "activation" and not quantizer.deploys_activations:
            raise ValueError(
                f"{name} ({type(quantizer).__name__}) quantizes activations with parameters computed from each "
                "input, which no deployment format can hold; use it for weights only"
            )
        frozen = _checked_freeze(name, quantizer, kind)
        set_role(frozen, role)
        if kind == "activation" and frozen.grid == "linear":
            degenerate.extend(_degenerate(name, quantizer))
        if owner is not None:
            parameter = typing.cast(Tensor, owner.weight)
            with torch.no_grad():
                weight = quantizer.deploy_weight(parameter.detach())
                if frozen.grid == "linear":
                    # on the grid itself (q - z) * s, as the simulation quantizes it: every format and runtime
                    # then recovers the same integers, with no rounding tie left to decide
                    weight = frozen(weight)
                if name.rpartition(".")[0] in shared:  # tied: the other holders (an embedding table) keep theirs
                    owner.weight = nn.Parameter(weight, requires_grad=parameter.requires_grad)
                else:
                    parameter.copy_(weight)
        set_submodule(model, name, frozen)
    if degenerate:
        warnings.warn(
            f"{len(degenerate)} activation quantizer(s) saw only zeros in calibration: {', '.join(degenerate[:5])}. "
            "Their range has no width, so it is taken as [0, 1] (any scale holds zeros; that one keeps a bias "
            "quantized at its scale within int32): other values are clipped to it. Calibrate on representative "
            "data (not zeros) if these tensors carry values in use",
            stacklevel=3,
        )
    if isinstance(model, fx.GraphModule):
        model.recompile()
    return model


def _degenerate(name: str, quantizer: QuantizeBase) -> list[str]:
    """``name`` where calibration saw only zeros (a range of no width: qparams_from_range takes it as [0, 1])."""
    post = quantizer.activation_post_process
    low, high = getattr(post, "min_val", None), getattr(post, "max_val", None)
    if not isinstance(low, Tensor) or not isinstance(high, Tensor) or not low.numel():
        return []
    if not (torch.isfinite(low).all() and torch.isfinite(high).all()):
        return []
    return [name] if bool((low == 0).all() and (high == 0).all()) else []
